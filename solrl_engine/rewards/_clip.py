"""What CLIPScore, PickScore and HPSv2 share: a transformers CLIPModel, its tokenizer, tensor-side
image preprocessing (no PIL round trip), weight checks before loading, batched no-grad scoring."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def is_local(name: str) -> bool:
    p = Path(name)
    return p.is_absolute() or name.startswith((".", "~")) or p.exists() or name.count("/") != 1


def check_source(name: str, what: str, filename: str = "config.json") -> None:
    """A local directory must exist and hold `filename`; a hub id must be cached when offline."""
    if is_local(name):
        p = Path(name).expanduser()
        if not (p / filename).exists():
            raise FileNotFoundError(
                f"{what}: {name!r} is not a directory holding {filename}; pass a local copy "
                f"(e.g. `huggingface-cli download <hub id> --local-dir {name}`) or a hub id"
            )
        return
    if offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, filename), str):
            raise FileNotFoundError(
                f"{what}: hub id {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                f"run `huggingface-cli download {name}` on a machine with internet, or pass a local directory"
            )


def check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, 3, H, W] float tensor in [0, 1]; got {got}")
    if not images.is_floating_point():
        raise ValueError(f"images must be float in [0, 1]; got {images.dtype} (divide uint8 images by 255)")


def preprocess(images: torch.Tensor, size: int, mean: Any, std: Any) -> torch.Tensor:
    """CLIP's preprocessing on tensors: resize the shorter side to `size` (bicubic, antialiased, as
    PIL), center crop, normalize."""
    h, w = images.shape[-2:]
    s = size / min(h, w)
    nh, nw = max(size, round(h * s)), max(size, round(w * s))
    x = images.float()
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    top, left = (nh - size) // 2, (nw - size) // 2
    x = x[..., top : top + size, left : left + size]
    m = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    sd = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return (x - m) / sd


def _features(out: Any) -> torch.Tensor:
    """transformers 5 returns an output object from get_*_features; the projection is pooler_output."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class CLIPScorer:
    """score = scale * cos(image, text) with a transformers CLIPModel (and its processor's sizes)."""

    name = "clip"

    def __init__(self, model: str, processor: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, batch_size: int = 32, weights: bool = True
                 ) -> None:  # fmt: skip
        """weights=False builds the model from `model`'s config only (its weights come from elsewhere)."""
        from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        if weights:
            self.model = CLIPModel.from_pretrained(model, torch_dtype=self.dtype).to(self.device).eval()
        else:
            self.model = CLIPModel(CLIPConfig.from_pretrained(model)).eval()
        src = processor or model
        ip = CLIPImageProcessor.from_pretrained(src)
        crop = ip.crop_size  # a dict, a SizeDict (transformers 5) or an int
        self.size = int(getattr(crop, "height", None) or (crop["height"] if isinstance(crop, dict) else crop))
        self.mean, self.std = ip.image_mean, ip.image_std
        self.tokenizer = AutoTokenizer.from_pretrained(src)
        positions = self.model.config.text_config.max_position_embeddings
        self.max_length = min(int(self.tokenizer.model_max_length), positions)
        self.batch_size = batch_size

    def logit_scale(self) -> float:
        """The multiplier of the cosine; subclasses divide the model's own logit."""
        return 1.0

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images for {len(prompts)} prompts")
        out = []
        for i in range(0, len(prompts), self.batch_size):
            px = preprocess(images[i : i + self.batch_size].to(self.device), self.size, self.mean, self.std)
            tok = self.tokenizer(prompts[i : i + self.batch_size], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)  # fmt: skip
            img = _features(self.model.get_image_features(pixel_values=px.to(self.dtype))).float()
            txt = _features(self.model.get_text_features(input_ids=tok.input_ids, attention_mask=tok.attention_mask))
            img = img / img.norm(dim=-1, keepdim=True)
            txt = txt.float() / txt.float().norm(dim=-1, keepdim=True)
            out.append((img * txt).sum(-1) * self.logit_scale())
        return torch.cat(out).cpu()
