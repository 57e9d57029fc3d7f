"""`shapes`: an exact, analytic prompt-fidelity reward for the procedural shapes world.

For each object the prompt names, the image is segmented by colour (soft membership to the palette
colour), and scored for presence, shape (soft IoU of the colour mask with an ideal circle, square
and triangle of the mask's own area and centroid, drawn by the world's renderer; a softmax over the
three says which shape it is), size (area) and, for two objects, their relation (centroids).
Pixels of colours the prompt does not name count as clutter. Every term is a smooth function of
the pixels, so the score is continuous in [0, 1] and rankings have few ties. Vectorised over the
batch; no learned weights.
"""

from __future__ import annotations

import functools

import torch

from solrl_engine.data import shapes as world

_COLOR_NAMES = list(world.COLORS)
_PALETTE = torch.tensor([world.COLORS[c] for c in _COLOR_NAMES])
SHAPE_TEMPERATURE = 0.03  # IoU differences between the right and a wrong template are ~0.1-0.4
_REL = list(world.RELATIONS)
COLOR_TOLERANCE = 0.25  # hue distance (RGB, per unit of coverage) at which membership reaches 0


def _membership(x: torch.Tensor) -> torch.Tensor:
    """Soft membership [B, C, H, W] of each pixel to each palette colour: how much of the pixel the
    colour covers (its position on the background-to-colour segment, so anti-aliased edges count
    by their coverage), times how close the pixel's hue is to the colour's."""
    bg = torch.tensor(world.BACKGROUND, device=x.device).view(1, 1, 3, 1, 1)
    pal = _PALETTE.to(x.device).view(1, -1, 3, 1, 1)
    seg = pal - bg
    rel = x[:, None] - bg
    alpha = ((rel * seg).sum(2) / (seg * seg).sum(2)).clamp(0, 1)  # [B, C, H, W]
    # distance from the segment per unit of coverage: a hue mismatch that does not fade at edges
    resid = (rel - alpha[:, :, None] * seg).norm(dim=2) / alpha.clamp(min=1e-3)
    return alpha * (1 - resid / COLOR_TOLERANCE).clamp(0, 1)


@functools.lru_cache(maxsize=4096)
def _encode(prompt: str) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int], int]:
    """(colour, shape, size, valid) for two object slots and a relation index (-1: none)."""
    scene = world.parse(prompt)
    slots = []
    for o in (*scene.objects, None)[:2]:
        if o is None:
            slots.append((0, 0, 0, 0))
        else:
            size = 0 if o.size is None else 1 + world.SIZES.index(o.size)
            slots.append((_COLOR_NAMES.index(o.color), world.SHAPES.index(o.shape), size, 1))
    rel = -1 if scene.relation is None else _REL.index(scene.relation)
    return slots[0], slots[1], rel


def _features(m: torch.Tensor) -> dict[str, torch.Tensor]:
    """Area, centroid and template IoU per shape of soft masks m [..., H, W]."""
    h, w = m.shape[-2:]
    ys = torch.arange(h, dtype=m.dtype, device=m.device).view(h, 1) + 0.5
    xs = torch.arange(w, dtype=m.dtype, device=m.device).view(1, w) + 0.5
    area = m.sum((-2, -1))
    safe = area.clamp(min=1e-6)
    cx = (m * xs).sum((-2, -1)) / safe
    cy = (m * ys).sum((-2, -1)) / safe
    dx, dy = xs - cx[..., None, None], ys - cy[..., None, None]
    ious = []
    for s in world.SHAPES:
        t = world.coverage(s, dx, dy, area[..., None, None])
        ious.append(torch.minimum(m, t).sum((-2, -1)) / torch.maximum(m, t).sum((-2, -1)).clamp(min=1e-6))
    return {"area": area, "cx": cx, "cy": cy, "iou": torch.stack(ious, -1)}


def score(images: torch.Tensor, prompts: list[str], details: bool = False) -> torch.Tensor | dict[str, torch.Tensor]:
    """Reward per image in [0, 1]; with `details`, every term as well."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W] floats in [0, 1]; got shape {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
    dev = images.device
    x = images.detach().float().clamp(0, 1)
    b, _, h, w = x.shape
    scale = (h * w) / (world.IMAGE_SIZE**2)  # areas are defined at 32x32
    enc = [_encode(p) for p in prompts]
    slot = torch.tensor([[e[0], e[1]] for e in enc], device=dev)  # [B, 2, 4]
    rel = torch.tensor([e[2] for e in enc], device=dev)
    color, shape, size, valid = slot.unbind(-1)
    valid = valid.float()

    member = _membership(x)
    m = torch.gather(member, 1, color[:, :, None, None].expand(b, 2, h, w))  # [B, 2, H, W]
    f = _features(m)
    area = f["area"] / scale

    presence = 1 - torch.exp(-((area / 15) ** 2))
    iou = f["iou"]  # [B, 2, 3]
    p_shape = torch.softmax(iou / SHAPE_TEMPERATURE, -1).gather(-1, shape[..., None]).squeeze(-1)
    shape_ok = p_shape * iou.gather(-1, shape[..., None]).squeeze(-1)
    size_ok = torch.where(
        size == 0,
        torch.ones_like(area),
        torch.where(size == 1, torch.sigmoid((80 - area) / 6), torch.sigmoid((area - 125) / 6)),
    )
    # size only counts for an object-like blob (best template IoU): scattered pixels of the right
    # colour earn presence, not size
    obj = presence * (0.3 + 0.5 * shape_ok + 0.2 * size_ok * iou.amax(-1))  # [B, 2]
    objects = (obj * valid).sum(-1) / valid.sum(-1)

    axis = torch.tensor([world.RELATIONS[r][0] for r in _REL], device=dev)[rel.clamp(min=0)]
    sign = torch.tensor([world.RELATIONS[r][1] for r in _REL], device=dev, dtype=torch.float32)[rel.clamp(min=0)]
    ca = torch.where(axis == 0, f["cx"][:, 0], f["cy"][:, 0])
    cb = torch.where(axis == 0, f["cx"][:, 1], f["cy"][:, 1])
    delta = sign * (ca - cb) / (w / world.IMAGE_SIZE)
    relation = torch.where(rel >= 0, torch.sigmoid((delta - 2) / 1.5) * presence[:, 1] * presence[:, 0], 1.0)

    named = torch.zeros(b, len(_COLOR_NAMES), device=dev)
    named.scatter_add_(1, color, valid)
    clutter_area = (member.sum((-2, -1)) * (1 - named.clamp(max=1))).sum(-1) / scale
    clutter = torch.exp(-clutter_area / 40)

    total = objects * torch.where(rel >= 0, 0.3 + 0.7 * relation, 1.0) * clutter
    if details:
        return {
            "reward": total,
            "presence": presence,
            "shape": shape_ok,
            "size": size_ok,
            "relation": relation,
            "clutter": clutter,
            "iou": iou,
            "area": area,
        }
    return total


class ShapesReward:
    """Callable `(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]` in [0, 1]."""

    name = "shapes"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return score(images, prompts)  # type: ignore[return-value]

    def check_prompts(self, prompts: list[str]) -> None:
        """Every prompt inside the grammar (PromptError naming the first that is not), without scoring."""
        for p in dict.fromkeys(prompts):
            world.parse(p)
