"""`clip_direction`: CLIP's directional similarity of an edit, cos(E_img(edit) - E_img(source), E_txt(instruction) -
E_txt("")), on the `clipscore` model (`model=`, `processor=`); rewards/edit.py says what it measures and what not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from solrl_engine.rewards._clip import CLIPScorer, check_images, device_of, load_clip, resolve_dtype
from solrl_engine.rewards.clipscore import DEFAULT_MODEL
from solrl_engine.rewards.clipscore import check_weights as check_weights  # the same model and processor checks
from solrl_engine.rewards.edit import SourceImages


class CLIPDirection(CLIPScorer):
    """`clip_direction`: cos(E_img(edit) - E_img(source), E_txt(instruction) - E_txt("")) (see the module
    docstring)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        processor: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        check_weights(model, processor)
        super().__init__(load_clip(model), processor or model, device_of(device), resolve_dtype(dtype), batch_size)
        self.sources = SourceImages()

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_images(images, prompts)
        src = self.sources(prompts, tuple(images.shape[-2:]), "clip_direction")
        texts = [str(p) for p in prompts]
        unique = {p: i for i, p in enumerate(dict.fromkeys(texts))}
        txt = self.text_embeds([*unique, ""])
        t_dir = txt[torch.tensor([unique[p] for p in texts], device=self.device)] - txt[-1:]
        out = []
        for i in range(0, len(prompts), self.batch_size):
            i_dir = self.image_embeds(images[i : i + self.batch_size]) - self.image_embeds(src[i : i + self.batch_size])
            out.append(F.cosine_similarity(i_dir, t_dir[i : i + self.batch_size], dim=-1))
        return torch.cat(out)
