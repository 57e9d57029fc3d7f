"""Qwen-Image-Edit-2509 and later (editing with one or several sources): `QwenImageEditPlusPipeline`, Qwen-Image-Edit's
transformer, Qwen2.5-VL and VAE, for Qwen/Qwen-Image-Edit-2509 (Qwen-Image-Edit-2511 loads into the same pipeline).
This family is QwenImageEditModel (module qwenimage_edit) with several sources a prompt.

Each prompt carries its sources (a conditioned prompt set: `{"prompt": ..., "image": PATH}` or `"images": [PATH,
...]`, the model card's 1 to 3). As the pipeline feeds them:
- through the text encoder: every source at the pipeline's condition size (`CONDITION_IMAGE_SIZE`, 384 x 384 pixels
  for a square), each named in the prompt ("Picture 1: <vision tokens>Picture 2: ..." before the instruction);
- through the VAE: each source at the edit's size, packed after the latent's tokens in order, each with its own grid
  in `img_shapes`. `Conditioning.image` holds them stacked along the channels ([B, n x 16, R/8, R/8]).
Every source is resized to the edit's R x R first (as Qwen-Image-Edit's), so the engine's edit is
`pipe(image=[each source resized to R x R], height=R, width=R)`'s at R = 1024 (where the pipeline's VAE area,
`VAE_IMAGE_SIZE`, is R x R; tests/test_qwenimage_edit.py compares at 64 px with that area set to 64 x 64). The prompts
of one batch must carry as many sources each (their tokens are one sequence): a set whose lines differ is refused
before any weight loads (and a batch that mixes them, for a caller of the model itself). The stock pipeline edits
one prompt a call: regenerate through it with batch_size=1.

Guidance, the negative encoded with the sources, the explore copy, LoRA targets and blocks: Qwen-Image-Edit's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from solrl_engine.data import prompt_images
from solrl_engine.models import qwenimage_edit
from solrl_engine.models.base import Conditioning
from solrl_engine.models.qwenimage_edit import QwenImageEditModel


class QwenImageEditPlusModel(QwenImageEditModel):
    MODEL = "qwenimage_edit_plus"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "QwenImageEditPlusPipeline"
    WHAT = "Qwen-Image-Edit-2509 edits"
    # stand-in text length ("random"): one source's 196 vision tokens at the 384 px condition size (Qwen2-VL's
    # processor rounds it to 392 px: 28 x 28 patches of 14 px, merged 2 x 2) and Qwen-Image's 128 for the instruction
    TEXT_TOKENS = 196 + 128

    def _condition_size(self) -> tuple[int, int]:
        """(width, height) the pipeline gives a square source for its text encoder: its own constant and rounding."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        return plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, 1.0)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Qwen-Image-Edit's, once the batch is known to carry as many sources a prompt."""
        counts = {len(prompt_images(p)) for p in prompts}
        if len(counts) > 1:
            raise ValueError(f"{self.WHAT}: the prompts of one batch carry {sorted(counts)} sources each; one batch "
                             "is one token sequence per edit, so give every line of a prompt set as many sources "
                             "(or split the set by their number)")  # fmt: skip
        return super().encode_prompts(prompts)

    def _seen(self, sources: list[Any]) -> Any:  # noqa: ANN401 - PIL images
        """Every source at the pipeline's condition size, as a list (the pipeline names each "Picture i:")."""
        w, h = self._condition_size()
        return [self.pipe.image_processor.resize(s, h, w) for s in sources]

    def _sources_of(self, prompt: str) -> list[Any]:
        images = prompt_images(prompt)
        if not images:
            raise ValueError(f"{self.WHAT} take one or more source images a prompt; {prompt!r} has none: use a "
                             'conditioned prompt set, JSON lines {"prompt": ..., "images": [PATH, ...]} '
                             "(solrl_engine/data)")  # fmt: skip
        r = self.resolution
        return [self.pipe.image_processor.resize(im, r, r) for im in prompt.open_images()]  # type: ignore[attr-defined]

    def _standin_encode(self, prompts: list[str]) -> Conditioning:
        """Qwen-Image-Edit's stand-in, with as many random sources as each prompt carries (one for a plain prompt)."""
        cond = super()._standin_encode(prompts)
        n = max(1, len(prompt_images(prompts[0]))) if prompts else 1
        cond.image = cond.image.repeat(1, n, 1, 1)
        return cond

    def pipeline_inputs(self, prompt: str, rows: int = 1) -> dict[str, Any]:
        """The sources resized to the edit's R x R, as a list (the pipeline edits one prompt a call)."""
        return {"image": self._sources_of(prompt)}


# Qwen-Image-Edit's, but for the pipeline, the weights and the sources a prompt
SPEC = dataclasses.replace(
    qwenimage_edit.SPEC,
    name="qwenimage_edit_plus",
    adapter="solrl_engine.models.qwenimage_edit_plus:QwenImageEditPlusModel",
    pipeline="QwenImageEditPlusPipeline",
    default_path="Qwen/Qwen-Image-Edit-2509",
    images_per_prompt=None,  # one or several, as many on every line
)
