"""`pickscore`: PickScore v1 (Kirstain et al., 2023), a CLIP-H fine-tuned on human preferences.

score = logit_scale.exp() * cos(image, text) / 26: PickScore's own logit scaled to about [0, 1], as
Flow-GRPO / DiffusionNFT / Sol-RL train with it. Defaults: model yuvalkirstain/PickScore_v1,
processor (tokenizer and image sizes) laion/CLIP-ViT-H-14-laion2B-s32B-b79K; both take a hub id or a
local directory (`reward_args=pickscore.model=/w/ps,pickscore.processor=/w/clip-h`).
"""

from __future__ import annotations

from solrl_engine.rewards._clip import CLIPScorer, check_source

DEFAULT_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


def check_weights(model: str = DEFAULT_MODEL, processor: str = DEFAULT_PROCESSOR, **_: object) -> None:
    check_source(model, "pickscore model")
    check_source(processor, "pickscore processor", "preprocessor_config.json")


class PickScore(CLIPScorer):
    def __init__(self, model: str = DEFAULT_MODEL, processor: str = DEFAULT_PROCESSOR, **kw: object) -> None:
        check_weights(model, processor)
        super().__init__(model, processor, **kw)  # type: ignore[arg-type]

    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp()) / 26.0
