"""Prompt sets by name, so a config names its prompts with one string (`train_prompts`, `eval_prompts`):

- "shapes/train", "shapes/heldout": the bundled procedural world (the tiny model's);
- "sample/train", "sample/test": a small bundled set in the style of the paper's prompts (written for
  this project), so the real-model presets run without a download;
- a file: one prompt per line (.txt or any other suffix), or JSON lines with a "prompt" field (.jsonl;
  other fields are ignored);
- "DIR:train" / "DIR:test" (any split name): DIR/<split>.txt or DIR/<split>.jsonl, the layout of
  Flow-GRPO's and DiffusionNFT's prompt sets (dataset/pickscore/train.txt, test.txt).
"""

from __future__ import annotations

import json
from pathlib import Path

BUNDLED = Path(__file__).parent / "prompts"
SHAPES_SPLITS = ("train", "heldout")
SAMPLE_SPLITS = ("train", "test")
# prompts/<set>_<split>.txt or .jsonl: general prompts; text to render (the ocr reward's); GenEval-style composition
# (objects, counts, colours, positions, with GenEval's metadata per line: ready for a detector reward)
BUNDLED_SETS = ("sample", "ocr", "geneval")
SPLIT_SUFFIXES = (".txt", ".jsonl")
ACCEPTED = (
    "shapes/train, shapes/heldout, sample/train, sample/test, ocr/train, ocr/test, geneval/train, geneval/test, "
    "a .txt file (one prompt per line), "
    'a .jsonl file ({"prompt": ...} per line), or DIR:SPLIT for DIR/SPLIT.txt or DIR/SPLIT.jsonl'
)


def _read_jsonl(path: Path, text: str) -> list[str]:
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f'{path}:{i}: a JSON line needs a "prompt" string; got {line[:80]!r}')
        if not rec["prompt"].strip():
            raise ValueError(f'{path}:{i}: the "prompt" is empty')
        prompts.append(rec["prompt"].strip())
    return prompts


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts of one file: JSON lines for .jsonl, else one per line (blank lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        why = f"byte {e.start}: {e.reason}"
        raise ValueError(f"prompt file {path} is not UTF-8 text ({why}): save it as UTF-8") from None
    if path.suffix == ".jsonl":
        prompts = _read_jsonl(path, text)
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts")
    return prompts


def _split_file(root: Path, split: str, spec: str) -> Path:
    for suffix in SPLIT_SUFFIXES:
        if (root / f"{split}{suffix}").is_file():
            return root / f"{split}{suffix}"
    have = sorted(p.name for p in root.iterdir() if p.suffix in SPLIT_SUFFIXES)
    raise ValueError(
        f"prompt set {spec!r}: {root} has no {split}.txt or {split}.jsonl "
        f"(it has: {', '.join(have) or 'no .txt or .jsonl files'}); accepted: {ACCEPTED}"
    )


def load_prompts(spec: str) -> list[str]:
    """The prompts named by `spec` (see the module docstring); an error naming the spec and what is
    accepted when it names nothing, and the file and line of a malformed JSON line."""
    head, _, split = spec.partition("/")
    if head == "shapes" and split in SHAPES_SPLITS:
        from solrl_engine.data import shapes

        return shapes.prompts(split)
    if head in BUNDLED_SETS and split in SAMPLE_SPLITS:
        return read_prompt_file(_split_file(BUNDLED, f"{head}_{split}", spec))
    path = Path(spec)
    if path.is_file():
        return read_prompt_file(path)
    if path.is_dir():
        raise ValueError(f"prompt set {spec!r} is a directory: name a split, e.g. {spec}:train; accepted: {ACCEPTED}")
    root, sep, split = spec.rpartition(":")
    if sep and root and split and Path(root).is_dir():
        return read_prompt_file(_split_file(Path(root), split, spec))
    if path.suffix in SPLIT_SUFFIXES:
        raise ValueError(f"prompt file {spec!r} does not exist; accepted: {ACCEPTED}")
    raise ValueError(f"unknown prompt set {spec!r}; accepted: {ACCEPTED}")
