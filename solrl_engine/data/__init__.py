"""Prompt sets by name, so a config names its prompts with one string (`train_prompts`, `eval_prompts`):

- "shapes/train", "shapes/heldout": the bundled procedural world (the tiny model's);
- "sample/train", "sample/test": a small bundled set in the style of the paper's prompts (written for
  this project), so the real-model presets run without a download;
- a file: one prompt per line (.txt or any other suffix), or JSON lines with a "prompt" field (.jsonl;
  other fields are ignored);
- "DIR:train" / "DIR:test" (any split name): DIR/<split>.txt or DIR/<split>.jsonl, the layout of
  Flow-GRPO's and DiffusionNFT's prompt sets (dataset/pickscore/train.txt, test.txt).

Conditioned prompt sets (an edit's source image, an image-to-video's first frame) are JSON lines with an image:
`{"prompt": "make the sky red", "image": "src/0001.png"}` or `"images": [...]`, paths relative to the file. Each
line becomes a `ConditionedPrompt`: a string wherever the engine passes prompts (caches, logs, rewards), carrying
its images for the families and rewards that read them. Every image is opened at load, and a missing,
unreadable, too small or unusable one is refused with its file and line, before any weights load. A set is
either conditioned on every line or on none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BUNDLED = Path(__file__).parent / "prompts"
SHAPES_SPLITS = ("train", "heldout")
SAMPLE_SPLITS = ("train", "test")
# prompts/<set>_<split>.txt or .jsonl: general prompts; text to render (the ocr reward's); GenEval-style composition
# (objects, counts, colours, positions, with GenEval's metadata per line: ready for a detector reward)
# edit, i2v: instructions on images the project draws, and motions from them as first frames (data/edit.py)
BUNDLED_SETS = ("sample", "ocr", "geneval", "edit", "i2v")
SPLIT_SUFFIXES = (".txt", ".jsonl")
ACCEPTED = (
    "shapes/train, shapes/heldout, sample/train, sample/test, ocr/train, ocr/test, geneval/train, geneval/test, "
    "edit/train, edit/test, i2v/train, i2v/test (conditioned on images), "
    "a .txt file (one prompt per line), "
    'a .jsonl file ({"prompt": ...} per line, with "image": PATH for a conditioned set), or DIR:SPLIT for '
    "DIR/SPLIT.txt or DIR/SPLIT.jsonl"
)


# image modes a conditioned prompt's image may have: each converts to RGB without guessing (16-bit and float
# images would need a scale the file does not state)
IMAGE_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "1")
MIN_IMAGE_SIDE, MAX_IMAGE_SIDE = 16, 8192


class ConditionedPrompt(str):
    """A prompt and the images it is conditioned on: equal to another only with the same text and images (so two
    edits of one instruction on different sources are two prompts to every cache), pickled with its images."""

    images: tuple[Path, ...]

    def __new__(cls, text: str, images: tuple[str | Path, ...] | list[str | Path]) -> ConditionedPrompt:
        obj = super().__new__(cls, text)
        obj.images = tuple(Path(p) for p in images)
        return obj

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConditionedPrompt):
            return str.__eq__(self, other) and self.images == other.images
        return False if isinstance(other, str) else NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((str(self), self.images))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ConditionedPrompt, (str(self), self.images))

    def __repr__(self) -> str:
        return f"ConditionedPrompt({str(self)!r}, images={[str(p) for p in self.images]})"

    def open_images(self) -> list[Any]:
        """Its images as RGB PIL images (read again each call: the cache of a family holds what it encodes)."""
        from PIL import Image

        out = []
        for path in self.images:
            with Image.open(path) as im:
                out.append(im.convert("RGB"))
        return out


def prompt_images(prompt: str) -> tuple[Path, ...]:
    """The images a prompt is conditioned on (none for a plain string)."""
    return prompt.images if isinstance(prompt, ConditionedPrompt) else ()


def single_images(prompts: list[str], what: str) -> list[Any]:
    """The one image each prompt carries, opened as RGB, for a family that takes one per prompt (`what` it does
    with it); a prompt with none or several is refused, naming it and the prompt-set format."""
    out = []
    for p in prompts:
        images = prompt_images(p)
        if len(images) != 1:
            raise ValueError(f"{what} one image per prompt; {p!r} has {len(images)}: use a conditioned prompt set, "
                             'JSON lines {"prompt": ..., "image": PATH} (solrl_engine/data)')  # fmt: skip
        out.append(p.open_images()[0])  # type: ignore[attr-defined]
    return out


def probe_prompt() -> ConditionedPrompt:
    """A conditioned prompt for probes that need any conditioning of a model that takes images (the FLOP count of
    one step): the bundled editing set's first instruction with its source."""
    return load_prompts("edit/test")[0]  # type: ignore[return-value]


def _check_image(path: Path, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise ValueError(f"{where}: image {path} does not exist (paths are relative to the prompt file)")
    try:
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            mode, (w, h) = im.mode, im.size
            im.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{where}: image {path} cannot be read as an image ({e}): re-save it as PNG or JPEG") from None
    if mode not in IMAGE_MODES:
        raise ValueError(f"{where}: image {path} has mode {mode!r}, which has no agreed conversion to RGB (16-bit or "
                         f"float data): save it as 8-bit RGB; accepted modes: {', '.join(IMAGE_MODES)}")  # fmt: skip
    if min(w, h) < MIN_IMAGE_SIDE or max(w, h) > MAX_IMAGE_SIDE:
        raise ValueError(f"{where}: image {path} is {w} x {h}: use sides between {MIN_IMAGE_SIDE} and "
                         f"{MAX_IMAGE_SIDE} pixels")  # fmt: skip


def _line_images(rec: dict[str, Any], path: Path, i: int) -> list[Path]:
    if "image" in rec and "images" in rec:
        raise ValueError(f'{path}:{i}: give "image" or "images", not both')
    raw = [rec["image"]] if "image" in rec else rec.get("images", [])
    if not isinstance(raw, list) or not all(isinstance(x, str) and x.strip() for x in raw):
        raise ValueError(f'{path}:{i}: "image" is a path and "images" a list of paths; got {raw!r}')
    if "images" in rec and not raw:
        raise ValueError(f'{path}:{i}: "images" is empty: list at least one image, or drop the key')
    images = [(path.parent / x).resolve() for x in raw]
    for img in images:
        _check_image(img, f"{path}:{i}")
    return images


def _read_jsonl(path: Path, text: str) -> list[str]:
    prompts: list[str] = []
    first: tuple[int, bool] | None = None  # (line, conditioned) of the first prompt
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
        images = _line_images(rec, path, i)
        if first is None:
            first = (i, bool(images))
        elif bool(images) != first[1]:
            has, lacks = (i, first[0]) if images else (first[0], i)
            raise ValueError(f"{path}:{i}: line {has} is conditioned on an image and line {lacks} is not: a prompt set "
                             "is conditioned on every line or on none; split it into two sets")  # fmt: skip
        text_ = rec["prompt"].strip()
        prompts.append(ConditionedPrompt(text_, images) if images else text_)
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


def check_conditioning(prompts: list[str], conditioned: bool, model: str, key: str, spec: str,
                       takers: tuple[str, ...] = (), per_prompt: int | None = 1) -> None:  # fmt: skip
    """A conditioned family (an editor) takes a prompt set with an image per line (`per_prompt` of them; None: any
    number, as many on every line), the others one without: refused before any weight loads, naming the config key,
    the set and the fix (`takers`: the families that take images, named in it)."""
    has = bool(prompts) and isinstance(prompts[0], ConditionedPrompt)
    if conditioned and has:
        counts = [len(prompt_images(p)) for p in prompts]
        want = per_prompt if per_prompt is not None else counts[0]
        bad = next((i for i, n in enumerate(counts) if n != want), None)
        if bad is not None:
            rule = f"{per_prompt} image(s) per prompt" if per_prompt is not None else "as many images on every line"
            raise ValueError(f"{key}={spec!r}: model={model} takes {rule}; prompt {bad + 1} ({str(prompts[bad])!r}) "
                             f"has {counts[bad]} where {'the first has' if per_prompt is None else 'it needs'} "
                             f"{want}: give every line {want} ('image': PATH or 'images': [PATH, ...])")  # fmt: skip
    if conditioned and not has:
        raise ValueError(f"{key}={spec!r}: model={model} takes an image per prompt (an edit's source, a clip's first "
                         "frame), and this prompt set has none: use JSON lines "
                         '{"prompt": "...", "image": "PATH"} (paths relative to the file), e.g. the bundled edit/train '
                         "or i2v/train")
    if has and not conditioned:
        which = ", ".join(takers) or "an editing family"
        raise ValueError(f"{key}={spec!r}: its prompts carry images, which model={model} does not take (it draws from "
                         f"text alone): pick a model that takes them ({which}) or a prompt set without images")


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
