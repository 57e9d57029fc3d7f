"""`clipscore`: image-text agreement of a CLIP model, reported as its logit divided by 100.

score = logit_scale.exp() * cos(image_embeds, text_embeds) / divisor, divisor 100 by default. OpenAI
CLIP's learned logit scale is exactly 100, so with the default model the score is the plain cosine
similarity (about 0.15-0.35 for matching pairs). `divisor` changes the scale only, never the ranking:
Flow-GRPO's `clip_scorer.py` (and the DiffusionNFT code built on it) divides the logit by 30 instead
(`reward_args=clipscore.divisor=30` reproduces its numbers).

Default model: openai/clip-vit-large-patch14 (`model=` a hub id or a local directory; `processor=` the
tokenizer and image sizes when they live elsewhere, by default the model's own).
"""

from __future__ import annotations

import torch

from solrl_engine.rewards._clip import CLIPScorer, check_model, check_processor, device_of, load_clip, resolve_dtype

DEFAULT_MODEL = "openai/clip-vit-large-patch14"


def check_weights(model: str = DEFAULT_MODEL, processor: str | None = None, **_: object) -> None:
    """Before loading: the model (and processor) exist locally, or are cached hub ids when offline."""
    check_model(model, "clipscore model")
    check_processor(processor or model, "clipscore processor")


class CLIPScore(CLIPScorer):
    """logit_scale.exp() * cos / divisor (see the module docstring)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        processor: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
        divisor: float = 100.0,
    ) -> None:
        check_weights(model, processor)
        self.divisor = float(divisor)
        super().__init__(load_clip(model), processor or model, device_of(device), resolve_dtype(dtype), batch_size)

    def multiplier(self) -> float:
        return self.logit_scale / self.divisor
