"""Prompt sets by name:

- "shapes/train", "shapes/heldout": the bundled procedural world (the tiny model's);
- "sample/train", "sample/test": a small bundled set in the style of the paper's prompts
  (written for this project), for trying the real-model presets;
- a file: one prompt per line (.txt), or JSON lines with a "prompt" field (.jsonl);
- "DIR:train" / "DIR:test": DIR/train.txt or DIR/train.jsonl, the layout of Flow-GRPO and
  DiffusionNFT's prompt sets (dataset/pickscore/train.txt, test.txt).
"""

from __future__ import annotations

import json
from pathlib import Path

BUNDLED = Path(__file__).parent / "prompts"
ACCEPTED = (
    "shapes/train, shapes/heldout, sample/train, sample/test, a .txt file (one prompt per line), "
    "a .jsonl file ({\"prompt\": ...} per line), or DIR:SPLIT for DIR/SPLIT.txt or DIR/SPLIT.jsonl"
)


def _read(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        prompts = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f'{path}:{i}: a JSON line needs a "prompt" string; got {line[:80]!r}')
            prompts.append(rec["prompt"].strip())
    else:
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts")
    return prompts


def load_prompts(spec: str) -> list[str]:
    """The prompts named by `spec` (see the module docstring); a clear error when there are none."""
    if spec.startswith("shapes/"):
        from solrl_engine.data import shapes

        return shapes.prompts(spec.split("/", 1)[1])
    if spec in ("sample/train", "sample/test"):
        return _read(BUNDLED / f"sample_{spec.split('/')[1]}.txt")
    path = Path(spec)
    if path.is_file():
        return _read(path)
    root, sep, split = spec.rpartition(":")
    if sep and Path(root).is_dir():
        for ext in (".txt", ".jsonl"):
            if (Path(root) / f"{split}{ext}").is_file():
                return _read(Path(root) / f"{split}{ext}")
        raise ValueError(f"prompt set {spec!r}: {root} has no {split}.txt or {split}.jsonl")
    raise ValueError(f"unknown prompt set {spec!r}: use {ACCEPTED}")
