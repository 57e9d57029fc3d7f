"""`clipscore`: image-text agreement of a CLIP model, the logit divided by 100.

score = logit_scale.exp() * cos(image, text) / 100 (with OpenAI CLIP's logit scale of 100 this is the
cosine similarity itself), as the Flow-GRPO / DiffusionNFT CLIPScore reward computes it.
Default model: openai/clip-vit-large-patch14 (`model=` a hub id or local directory).
"""

from __future__ import annotations

from solrl_engine.rewards._clip import CLIPScorer, check_source

DEFAULT_MODEL = "openai/clip-vit-large-patch14"


def check_weights(model: str = DEFAULT_MODEL, processor: str | None = None, **_: object) -> None:
    check_source(model, "clipscore model")
    if processor:
        check_source(processor, "clipscore processor", "preprocessor_config.json")


class CLIPScore(CLIPScorer):
    def __init__(self, model: str = DEFAULT_MODEL, processor: str | None = None, **kw: object) -> None:
        check_weights(model, processor)
        super().__init__(model, processor, **kw)  # type: ignore[arg-type]

    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp()) / 100.0
