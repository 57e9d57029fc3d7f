"""Rewards for image editing, which read each prompt's source image (a conditioned prompt, solrl_engine/data).

- `preserve`: how much of the source an edit keeps, 1 - mean |edit - source| over pixels (the source resized to
  the edit's size, bilinear, both in [0, 1]): 1 for an unchanged copy. Without an edit mask it cannot tell the
  region the instruction names from the rest: it is the term that stops a run from winning by drawing a new
  image, and an edit that ignores the instruction scores highest on it, so weight it against an
  instruction-following term. On clips (image-to-video) it compares the first frame with the starting image.
- `clip_direction` (rewards/clip_direction.py): CLIP's directional similarity, cos(E_img(edit) - E_img(source),
  E_txt(instruction) - E_txt("")): does the image move the way the instruction's text moves CLIP's space
  (InstructPix2Pix's measure, with the instruction against the empty text where that paper has captions before
  and after). 0 for an unchanged copy. Runs without a server, on the `clipscore` model (`model=`, `processor=`).

    --set reward=clip_direction:1.0,preserve:0.5 --set reward_args=clip_direction.model=/w/clip-l

An instruction judge on a served VLM is the `vlm` reward with an editing question (docs).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from solrl_engine.data import prompt_images
from solrl_engine.rewards._clip import check_images


class SourceImages:
    """Each prompt's source image as a [3, H, W] tensor in [0, 1], read once per path."""

    def __init__(self) -> None:
        self._cache: dict[Path, torch.Tensor] = {}

    def __call__(self, prompts: list[str], size: tuple[int, int], reward: str) -> torch.Tensor:
        out = []
        for p in prompts:
            images = prompt_images(p)
            if not images:
                raise ValueError(f"reward {reward} compares an edit with its source image, and {p!r} has none: use a "
                                 'conditioned prompt set, JSON lines {"prompt": ..., "image": PATH}')  # fmt: skip
            if images[0] not in self._cache:
                import numpy as np

                rgb = p.open_images()[0]  # type: ignore[attr-defined]
                self._cache[images[0]] = torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).float() / 255
            out.append(self._cache[images[0]])
        return torch.stack([F.interpolate(s[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]
                            for s in out]).clamp(0, 1)  # fmt: skip


class Preservation:
    """`preserve`: 1 - mean |edit - source| (see the module docstring); on clips [B, T, 3, H, W] (image-to-video) it
    compares the first frame with the image the clip starts from: frame-0 consistency."""

    video = True  # gets clips whole (not scored frame by frame): it reads their first frame

    def __init__(self) -> None:
        self.sources = SourceImages()

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if images.dim() == 5:
            images = images[:, 0]
        check_images(images, prompts)
        src = self.sources(prompts, tuple(images.shape[-2:]), "preserve").to(images.device)
        return 1.0 - (images.float() - src).abs().mean(dim=(1, 2, 3))

    def __repr__(self) -> str:
        return "Preservation()"
