"""The bundled editing prompt set, `edit/train` and `edit/test`: source images the project draws itself (the
shapes world's renderer, enlarged to 128 px) and instructions that change one thing in them (a colour, a shape,
an added object), as JSON lines `{"prompt": ..., "image": "edit/NNN.png"}`; and the image-to-video set
`i2v/train`, `i2v/test`: the same images as first frames, each with a motion of its object. They exist so the
editing and image-to-video families run offline end to end; they say nothing about real quality. The shipped
files are what `write_edit_set` writes (a test redraws them and compares the pixels).

    python -m solrl_engine.data.edit        # redraw prompts/edit_*.jsonl, prompts/i2v_*.jsonl and prompts/edit/
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from solrl_engine.data import shapes

SIDE = 128
SPLITS = {"train": 16, "test": 8}


def edits(split: str) -> list[tuple[str, str, int]]:
    """(source scene prompt, instruction, layout seed) per line of `split`: a fixed draw per split."""
    rng = random.Random({"train": 11, "test": 29}[split])
    colors, kinds = sorted(shapes.COLORS), list(shapes.SHAPES)
    out = []
    for i in range(SPLITS[split]):
        color, kind = rng.choice(colors), rng.choice(kinds)
        source = f"a {color} {kind}"
        how = i % 3
        if how == 0:
            new = rng.choice([c for c in colors if c != color])
            instruction = f"make the {kind} {new}"
        elif how == 1:
            new = rng.choice([k for k in kinds if k != kind])
            instruction = f"turn the {color} {kind} into a {new}"
        else:
            other = rng.choice([c for c in colors if c != color])
            instruction = f"add a small {other} {rng.choice(kinds)} next to the {kind}"
        out.append((source, instruction, rng.randrange(1 << 30)))
    return out


MOTIONS = ("slides to the left", "slides to the right", "rises slowly", "sinks slowly", "grows larger", "shrinks")


def i2v_lines(split: str) -> list[tuple[str, str]]:
    """(motion prompt, image name) per line of the image-to-video set `split`: each editing source as a first
    frame, with a motion of its object."""
    rng = random.Random({"train": 5, "test": 17}[split])
    return [(f"the {source.split(' ', 2)[2]} {rng.choice(MOTIONS)}", f"edit/{split}_{i:02d}.png")
            for i, (source, _, _) in enumerate(edits(split))]  # fmt: skip


def render_source(source: str, seed: int) -> object:
    """The source image of one line: the shapes renderer's 32 px scene (its object sizes are set at 32 px),
    enlarged to SIDE px (bicubic), as an 8-bit PIL image."""
    from PIL import Image

    img = shapes.render(source, random.Random(seed))
    small = Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy())
    return small.resize((SIDE, SIDE), Image.Resampling.BICUBIC)


def write_edit_set(root: Path) -> list[Path]:
    """Write root/edit_<split>.jsonl and root/edit/<split>_NN.png; returns the JSONL files."""
    (root / "edit").mkdir(parents=True, exist_ok=True)
    files = []
    for split in SPLITS:
        lines = []
        for i, (source, instruction, seed) in enumerate(edits(split)):
            name = f"edit/{split}_{i:02d}.png"
            render_source(source, seed).save(root / name)  # type: ignore[attr-defined]
            lines.append(json.dumps({"prompt": instruction, "image": name, "source": source}))
        path = root / f"edit_{split}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
        motion = [json.dumps({"prompt": p, "image": name}) for p, name in i2v_lines(split)]
        (root / f"i2v_{split}.jsonl").write_text("\n".join(motion) + "\n")
        files.append(root / f"i2v_{split}.jsonl")
    return files


if __name__ == "__main__":
    for f in write_edit_set(Path(__file__).parent / "prompts"):
        print(f"wrote {f}")
