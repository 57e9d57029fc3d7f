"""Pictures people would rather look at than read: image grids with captions, line plots, and for videos frame
strips (a still of each clip) and animated GIFs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from solrl_engine.store.safe import replacing

if TYPE_CHECKING:
    from PIL.Image import Image


def save_image(img: Image, path: str | Path) -> Path:
    """Write a PIL image (a grid, a before/after figure) to `path` the way every run file is written:
    whole or not at all, never through a link left there."""
    path = Path(path)
    with replacing(path) as tmp:
        img.save(tmp)
    return path


def image_grid(
    images: torch.Tensor,
    captions: Sequence[str] | None = None,
    ncol: int = 8,
    scale: int | None = None,
    header: str = "",
    tile: int = 256,
) -> Image:
    """[B, 3, H, W] in [0, 1] -> a PIL image of tiles, each with its caption (wrapped) below.

    Small images are upscaled by `scale` (nearest; default: up to about `tile` px), large ones
    (1024 px samples) are downscaled to `tile` px, so a grid of 16 stays a few MB.
    """
    import textwrap

    from PIL import Image as PILImage
    from PIL import ImageDraw

    imgs = images.detach().float().clamp(0, 1).cpu()
    b, _, h, w = imgs.shape
    ncol = max(1, min(ncol, b))
    nrow = (b + ncol - 1) // ncol
    if scale is None:
        scale = max(1, tile // max(h, w)) if max(h, w) < tile else 0
    th, tw = (h * scale, w * scale) if scale else (tile * h // max(h, w), tile * w // max(h, w))
    wrapped = [textwrap.wrap(str(c), max(8, tw // 6))[:4] for c in captions] if captions is not None else None
    cap_h = 12 * max(1, max(len(x) for x in wrapped)) + 2 if wrapped else 0
    head_h = 16 if header else 0
    pad = 2
    grid = PILImage.new("RGB", (ncol * (tw + pad) + pad, head_h + nrow * (th + cap_h + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    if header:
        draw.text((pad, 2), header, fill=(0, 0, 0))
    for i in range(b):
        r, c = divmod(i, ncol)
        arr = (imgs[i].permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        tile_img = PILImage.fromarray(arr).resize((tw, th), PILImage.NEAREST if scale else PILImage.LANCZOS)
        x, y = pad + c * (tw + pad), head_h + pad + r * (th + cap_h + pad)
        grid.paste(tile_img, (x, y))
        if wrapped is not None:
            draw.text((x + 1, y + th + 1), "\n".join(wrapped[i]), fill=(0, 0, 0), spacing=1)
    return grid


def line_plot(
    path: str | Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    bands: dict[str, Sequence[float]] | None = None,
) -> Path:
    """Write a PNG line plot of named (x, y) series, with a +-1 standard-error band for the series
    named in `bands`; written to a temporary file, then renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for name, (xs, ys) in series.items():
        (line,) = ax.plot(list(xs), list(ys), label=name, linewidth=1.2)
        if bands and name in bands:
            lo = [y - e for y, e in zip(ys, bands[name], strict=True)]
            hi = [y + e for y, e in zip(ys, bands[name], strict=True)]
            ax.fill_between(list(xs), lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    with replacing(path) as tmp:  # a new temporary file renamed over it: a link there is never written through
        fig.savefig(tmp)
    plt.close(fig)
    return path


def _font(size: int):  # noqa: ANN202 - a PIL font
    """PIL's bundled scalable font at `size` px where this Pillow has one (10.1+), else its bitmap font."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one fixed-size bitmap font
        return ImageFont.load_default()


def pair_grid(
    left: torch.Tensor,
    right: torch.Tensor,
    left_captions: Sequence[str],
    right_captions: Sequence[str],
    pair_captions: Sequence[str],
    labels: tuple[str, str] = ("before", "after"),
    header: str = "",
    pairs_per_row: int = 4,
    tile: int = 192,
    sources: torch.Tensor | None = None,
) -> Image:
    """Side-by-side pairs, left[i] | right[i] ([B, 3, H, W] in [0, 1]), each tile's caption under it
    and the pair's caption (wrapped) under both: the one picture a reader compares at a glance. With `sources`
    (an edit's source images, the same size), each pair follows its source: source | left | right.

    Tiles are `tile` px: small images (the bundled 32 px model) upscaled by a whole factor
    (nearest: the pixels a reward saw), large ones (1024 px samples) downscaled (Lanczos)."""
    import textwrap

    from PIL import Image as PILImage
    from PIL import ImageDraw

    if left.shape != right.shape or not len(left) == len(left_captions) == len(right_captions) == len(pair_captions):
        caps = f"{len(left_captions)}/{len(right_captions)}/{len(pair_captions)}"
        raise ValueError(f"pair_grid: {tuple(left.shape)} vs {tuple(right.shape)} images, {caps} captions: "
                         "give two images and three captions per pair")  # fmt: skip
    if sources is not None and sources.shape != left.shape:
        raise ValueError(f"pair_grid: sources {tuple(sources.shape)} vs images {tuple(left.shape)}: give one source "
                         "of the images' size per pair")  # fmt: skip
    b, _, h, w = left.shape
    scale = max(1, tile // max(h, w)) if max(h, w) < tile else 0
    th, tw = (h * scale, w * scale) if scale else (tile * h // max(h, w), tile * w // max(h, w))
    font, small = _font(15), _font(13)
    pad, gap = 4, 14  # inside a pair / between pairs
    first = 0 if sources is None else tw + pad  # where the pair starts inside its group (after the source)
    wrap = max(12, (first + 2 * tw + pad) // 7)  # characters of the 13 px font per line
    lines = [textwrap.wrap(str(c), wrap)[:3] for c in pair_captions]
    cap_h = 18 + 17 * max(1, max((len(x) for x in lines), default=1)) + 6
    ncol = max(1, min(pairs_per_row, b))
    nrow = (b + ncol - 1) // ncol
    pair_w = first + 2 * tw + pad
    head_h = 26 if header else 0
    label_h = 20
    width = gap + ncol * (pair_w + gap)
    height = head_h + label_h + nrow * (th + cap_h) + gap
    grid = PILImage.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    if header:
        draw.text((gap, 5), header, fill=(0, 0, 0), font=font)
    for c in range(ncol):
        x = gap + c * (pair_w + gap)
        if sources is not None:
            draw.text((x + 2, head_h + 2), "source", fill=(90, 90, 90), font=small)
        draw.text((x + first + 2, head_h + 2), labels[0], fill=(90, 90, 90), font=small)
        draw.text((x + first + tw + pad + 2, head_h + 2), labels[1], fill=(90, 90, 90), font=small)

    def _tile(img: torch.Tensor) -> PILImage.Image:
        arr = (img.detach().float().clamp(0, 1).cpu().permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        return PILImage.fromarray(arr).resize((tw, th), PILImage.NEAREST if scale else PILImage.LANCZOS)

    for i in range(b):
        r, c = divmod(i, ncol)
        x, y = gap + c * (pair_w + gap), head_h + label_h + r * (th + cap_h)
        if sources is not None:
            grid.paste(_tile(sources[i]), (x, y))
        grid.paste(_tile(left[i]), (x + first, y))
        grid.paste(_tile(right[i]), (x + first + tw + pad, y))
        draw.text((x + first + 2, y + th + 2), left_captions[i], fill=(0, 0, 0), font=small)
        draw.text((x + first + tw + pad + 2, y + th + 2), right_captions[i], fill=(0, 0, 0), font=small)
        draw.text((x + 2, y + th + 19), "\n".join(lines[i]), fill=(40, 40, 120), font=small, spacing=3)
    return grid


def frame_indices(frames: int, k: int) -> list[int]:
    """`k` frame indices spread evenly over a clip of `frames` frames, the first and the last included."""
    if k < 1:
        raise ValueError(f"score at least one frame per clip; got {k}")
    if k >= frames:
        return list(range(frames))
    if k == 1:
        return [frames // 2]
    return [round(i * (frames - 1) / (k - 1)) for i in range(k)]


def frame_strips(images: torch.Tensor, k: int = 4) -> torch.Tensor:
    """Videos [B, T, 3, H, W] -> stills [B, 3, H, k W]: `k` frames spread over each clip (the first and the
    last included), side by side, so every image grid and comparison shows a clip as one picture. Images
    [B, 3, H, W] pass through unchanged."""
    if images.dim() != 5:
        return images
    idx = frame_indices(images.shape[1], k)
    return torch.cat([images[:, i] for i in idx], dim=-1)


def write_gif(path: str | Path, videos: torch.Tensor, ncol: int = 4, fps: int = 8, tile: int = 192) -> Path:
    """Videos [B, T, 3, H, W] in [0, 1] as one animated GIF (Pillow's writer), the clips in a grid of `ncol`
    columns, each frame of the GIF the same frame of every clip; tiles up to `tile` px. Written to a
    temporary name and renamed, so a reader never sees half a file."""
    from PIL import Image as PILImage

    vids = videos.detach().float().clamp(0, 1).cpu()
    b, t, _, h, w = vids.shape
    scale = max(1, tile // max(h, w))
    ncol = max(1, min(ncol, b))
    nrow = (b + ncol - 1) // ncol
    frames = []
    for f in range(t):
        grid = torch.ones(3, nrow * h * scale, ncol * w * scale)
        for i in range(b):
            r, c = divmod(i, ncol)
            up = vids[i, f].repeat_interleave(scale, 1).repeat_interleave(scale, 2)
            grid[:, r * h * scale : (r + 1) * h * scale, c * w * scale : (c + 1) * w * scale] = up
        frames.append(PILImage.fromarray((grid.permute(1, 2, 0).numpy() * 255).round().astype("uint8")))
    path = Path(path)
    with replacing(path) as tmp:
        frames[0].save(tmp, format="GIF", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path
