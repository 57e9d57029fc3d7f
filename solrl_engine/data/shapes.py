"""The procedural "shapes" world: a prompt grammar, fixed train / held-out splits, and a renderer of
anti-aliased images for every prompt. It is what the bundled tiny model is trained on and what the
`shapes` reward measures, so the whole Sol-RL loop runs offline and its reward is exact.

Grammar (lower case, single spaces):
    a [small|large] <colour> <shape>
    a <colour> <shape> <relation> a <colour> <shape>      (two different colours)
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import torch

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.12, 0.78, 0.22),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.88, 0.10),
    "purple": (0.62, 0.20, 0.82),
    "cyan": (0.10, 0.85, 0.90),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
RELATIONS: dict[str, tuple[int, int]] = {  # relation -> (axis, sign): holds when sign * (a - b) > 0
    "to the left of": (0, -1),
    "to the right of": (0, 1),
    "above": (1, -1),
    "below": (1, 1),
}
BACKGROUND = (0.08, 0.08, 0.10)
IMAGE_SIZE = 32
# Object areas in pixels (at 32x32): small, unspecified, large. The reward's size test uses these.
AREA = {"small": (36.0, 56.0), None: (70.0, 110.0), "large": (150.0, 210.0)}
AREA_IN_RELATION = (40.0, 75.0)  # two objects must fit side by side in 32 pixels
# (colour, shape) pairs never seen in training: every held-out prompt contains one of them, so
# held-out prompts are unseen combinations of seen words.
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("purple", "triangle"), ("cyan", "square"), ("yellow", "circle"), ("green", "triangle")}
)
VOCAB: tuple[str, ...] = tuple(sorted({"a", *COLORS, *SHAPES, *SIZES, *(w for r in RELATIONS for w in r.split())}))


class PromptError(ValueError):
    """A prompt outside the shapes grammar."""


@dataclass(frozen=True)
class Obj:
    color: str
    shape: str
    size: str | None = None


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]
    relation: str | None = None

    @property
    def prompt(self) -> str:
        def phrase(o: Obj) -> str:
            return " ".join(w for w in ("a", o.size, o.color, o.shape) if w)

        if self.relation is None:
            return phrase(self.objects[0])
        return f"{phrase(self.objects[0])} {self.relation} {phrase(self.objects[1])}"


def _grammar_help() -> str:
    return (
        "expected 'a [small|large] <colour> <shape>' or 'a <colour> <shape> <relation> a <colour> <shape>' "
        f"with colours {sorted(COLORS)}, shapes {list(SHAPES)}, relations {list(RELATIONS)}"
    )


def parse(prompt: str) -> Scene:
    """Parse a prompt of the grammar; PromptError (naming the problem) otherwise."""
    if not isinstance(prompt, str):
        raise PromptError(f"prompts must be strings; got {type(prompt).__name__}")
    words = prompt.strip().lower().rstrip(".").split()

    def obj(ws: list[str], allow_size: bool) -> Obj:
        if len(ws) == 4 and allow_size and ws[1] in SIZES:
            size, ws = ws[1], [ws[0], ws[2], ws[3]]
        else:
            size = None
        if len(ws) != 3 or ws[0] != "a" or ws[1] not in COLORS or ws[2] not in SHAPES:
            raise PromptError(f"prompt {prompt!r} is outside the shapes grammar: {_grammar_help()}")
        return Obj(ws[1], ws[2], size)

    for rel in RELATIONS:
        rw = rel.split()
        for i in range(len(words) - len(rw) + 1):
            if words[i : i + len(rw)] == rw:
                a, b = obj(words[:i], False), obj(words[i + len(rw) :], False)
                if a.color == b.color:
                    raise PromptError(f"prompt {prompt!r}: the two objects must have different colours")
                return Scene((a, b), rel)
    return Scene((obj(words, True),))


def is_heldout(scene: Scene) -> bool:
    return any((o.color, o.shape) in HELDOUT_PAIRS for o in scene.objects)


def all_scenes() -> list[Scene]:
    """Every prompt of the grammar, in a fixed order."""
    singles = [Scene((Obj(c, s, z),)) for c in COLORS for s in SHAPES for z in (None, *SIZES)]
    pairs = [
        Scene((Obj(c1, s1), Obj(c2, s2)), r)
        for (c1, s1), (c2, s2) in itertools.product(itertools.product(COLORS, SHAPES), repeat=2)
        if c1 != c2
        for r in RELATIONS
    ]
    return singles + pairs


def prompts(split: str) -> list[str]:
    """Fixed prompt lists: "train" (all 690 prompts without a held-out colour-shape pair) and
    "heldout" (64 prompts, each containing a held-out pair: all 12 single-object ones and 52
    two-object ones drawn with a fixed seed)."""
    scenes = all_scenes()
    if split == "train":
        return [s.prompt for s in scenes if not is_heldout(s)]
    if split == "heldout":
        held = [s for s in scenes if is_heldout(s)]
        singles = [s.prompt for s in held if s.relation is None]
        rels = [s.prompt for s in held if s.relation is not None]
        rng = random.Random(0)
        return singles[:32] + rng.sample(rels, 64 - min(32, len(singles)))
    raise ValueError(f"unknown split {split!r}; use 'train' or 'heldout'")


# --- rendering -----------------------------------------------------------------------------------


def sdf(shape: str, dx: torch.Tensor, dy: torch.Tensor, area: torch.Tensor | float) -> torch.Tensor:
    """Signed distance in pixels (approximate outside corners) from a shape of the given area whose
    centroid is at offset (dx, dy) = (x - cx, y - cy). Broadcasts over tensors."""
    area = torch.as_tensor(area, dtype=dx.dtype, device=dx.device)
    if shape == "circle":
        return torch.sqrt(dx * dx + dy * dy) - torch.sqrt(area / math.pi)
    if shape == "square":
        return torch.maximum(dx.abs(), dy.abs()) - torch.sqrt(area) / 2
    # upright equilateral triangle (apex up; image y grows downwards): inradius r, area 3*sqrt(3)*r^2;
    # the max over the three edges' signed distances.
    r = torch.sqrt(area / (3 * math.sqrt(3)))
    c30, s30 = math.sqrt(3) / 2, 0.5
    d = torch.maximum(dy - r, c30 * dx - s30 * dy - r)
    return torch.maximum(d, -c30 * dx - s30 * dy - r)


def coverage(shape: str, dx: torch.Tensor, dy: torch.Tensor, area: torch.Tensor | float) -> torch.Tensor:
    """Anti-aliased pixel coverage in [0, 1] of a shape (what the renderer paints)."""
    return (0.5 - sdf(shape, dx, dy, area)).clamp(0, 1)


def extent(shape: str, area: float) -> float:
    """Half-size of a shape's bounding box (pixels), for placement."""
    if shape == "circle":
        return math.sqrt(area / math.pi)
    if shape == "square":
        return math.sqrt(area) / 2
    return 2 * math.sqrt(area / (3 * math.sqrt(3)))


def layout(scene: Scene, rng: random.Random, size: int = IMAGE_SIZE) -> list[tuple[Obj, float, float, float]]:
    """Random (object, cx, cy, area) placements satisfying the scene: sizes, the relation (centroids
    separated by more than both extents along its axis, roughly aligned on the other), no overlap."""
    if scene.relation is None:
        (o,) = scene.objects
        area = rng.uniform(*AREA[o.size])
        e = extent(o.shape, area) + 1.0
        return [(o, rng.uniform(e, size - e), rng.uniform(e, size - e), area)]
    a, b = scene.objects
    axis, sign = RELATIONS[scene.relation]
    for _ in range(100):
        areas = [rng.uniform(*AREA_IN_RELATION) for _ in range(2)]
        ea, eb = (extent(o.shape, ar) for o, ar in zip((a, b), areas, strict=True))
        lo_e, hi_e = (ea, eb) if sign < 0 else (eb, ea)  # the object with the smaller coordinate first
        need, room = ea + eb + 1.0, size - lo_e - hi_e
        if room <= need:
            continue  # these two areas do not fit side by side: draw again
        sep = rng.uniform(need, room)
        lo = rng.uniform(lo_e, size - hi_e - sep)
        pa, pb = (lo, lo + sep) if sign < 0 else (lo + sep, lo)
        oa = rng.uniform(ea, size - ea)
        ob = rng.uniform(max(eb, oa - 5.0), min(size - eb, oa + 5.0))
        ca, cb = ((pa, oa), (pb, ob)) if axis == 0 else ((oa, pa), (ob, pb))
        return [(a, *ca, areas[0]), (b, *cb, areas[1])]
    raise RuntimeError(f"could not lay out {scene.prompt!r}")


def render(scene: Scene | str, rng: random.Random | int = 0, size: int = IMAGE_SIZE) -> torch.Tensor:
    """An anti-aliased RGB image [3, size, size] in [0, 1] of the scene, randomly laid out."""
    if isinstance(scene, str):
        scene = parse(scene)
    if isinstance(rng, int):
        rng = random.Random(rng)
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    img = torch.tensor(BACKGROUND).view(3, 1, 1).expand(3, size, size).clone()
    for o, cx, cy, area in layout(scene, rng, size):
        cover = coverage(o.shape, xs - cx, ys - cy, area)
        img = img * (1 - cover) + torch.tensor(COLORS[o.color]).view(3, 1, 1) * cover
    return img


def render_batch(prompts_: list[str], seed: int) -> torch.Tensor:
    """[B, 3, H, W] renders of the prompts, laid out by one RNG seeded with `seed`."""
    rng = random.Random(seed)
    return torch.stack([render(p, rng) for p in prompts_])
