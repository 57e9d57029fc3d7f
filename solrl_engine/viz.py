"""Pictures people would rather look at than read: image grids with captions, and line plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from PIL.Image import Image


def image_grid(
    images: torch.Tensor, captions: Sequence[str] | None = None, ncol: int = 8, scale: int = 4, header: str = ""
) -> Image:
    """[B, 3, H, W] in [0, 1] -> a PIL image: nearest-upscaled tiles, each with its caption below."""
    from PIL import Image as PILImage
    from PIL import ImageDraw

    imgs = images.detach().float().clamp(0, 1).cpu()
    b, _, h, w = imgs.shape
    ncol = max(1, min(ncol, b))
    nrow = (b + ncol - 1) // ncol
    th, tw = h * scale, w * scale
    cap_h = 14 if captions is not None else 0
    head_h = 16 if header else 0
    pad = 2
    grid = PILImage.new("RGB", (ncol * (tw + pad) + pad, head_h + nrow * (th + cap_h + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    if header:
        draw.text((pad, 2), header, fill=(0, 0, 0))
    for i in range(b):
        r, c = divmod(i, ncol)
        tile = (imgs[i].permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        tile_img = PILImage.fromarray(tile).resize((tw, th), PILImage.NEAREST)
        x, y = pad + c * (tw + pad), head_h + pad + r * (th + cap_h + pad)
        grid.paste(tile_img, (x, y))
        if captions is not None:
            draw.text((x + 1, y + th + 1), str(captions[i])[: max(4, tw // 6)], fill=(0, 0, 0))
    return grid


def line_plot(
    path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str, xlabel: str, ylabel: str
) -> Path:
    """Write a PNG line plot of named (x, y) series; written to a temporary file, then renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), label=name, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
