"""`pickscore`: PickScore v1 (Kirstain et al., 2023), a CLIP ViT-H-14 fine-tuned on Pick-a-Pic human
preferences.

score = logit_scale.exp() * cos(image_embeds, text_embeds) / 26. The official PickScore reports the
logit itself, logit_scale.exp() * cos (about 18-24 for generated images); Flow-GRPO, DiffusionNFT and
Sol-RL train on it divided by 26, which puts it near [0, 1] beside the other rewards.

Defaults: model yuvalkirstain/PickScore_v1 (the weights), processor laion/CLIP-ViT-H-14-laion2B-s32B-b79K
(the tokenizer and image sizes PickScore was trained with); each a hub id or a local directory
(`reward_args=pickscore.model=/w/pickscore,pickscore.processor=/w/clip-h`).
"""

from __future__ import annotations

import torch

from solrl_engine.rewards._clip import CLIPScorer, check_model, check_processor, device_of, load_clip, resolve_dtype

DEFAULT_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
DIVISOR = 26.0


def check_weights(model: str = DEFAULT_MODEL, processor: str = DEFAULT_PROCESSOR, **_: object) -> None:
    """Before loading: the model and processor exist locally, or are cached hub ids when offline."""
    check_model(model, "pickscore model")
    check_processor(processor, "pickscore processor")


class PickScore(CLIPScorer):
    """logit_scale.exp() * cos / 26 (see the module docstring)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        processor: str = DEFAULT_PROCESSOR,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        check_weights(model, processor)
        super().__init__(load_clip(model), processor, device_of(device), resolve_dtype(dtype), batch_size)

    def multiplier(self) -> float:
        return self.logit_scale / DIVISOR
