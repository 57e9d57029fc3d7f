"""Qwen-Image-Edit (image editing): `QwenImageEditPipeline`, Qwen-Image's 20B transformer, Qwen2.5-VL and VAE, for
Qwen/Qwen-Image-Edit. This family is QwenImageModel with a condition.

Each prompt is an instruction with its source image (a conditioned prompt set, solrl_engine/data: JSON lines
`{"prompt": ..., "image": PATH}`). The source enters twice, as the pipeline feeds it:
- through the text encoder: the pipeline's own `encode_prompt(instruction, image=source)` (its editing chat
  template, the source's vision tokens between the system prompt and the instruction, the first 64 tokens dropped),
  so a prompt's text states hold the source's vision tokens and are as long as the source makes them (about 1,200
  more at 1024 px). The negative prompt is encoded with the source too, so each prompt carries its own
  unconditional states (`Conditioning.negative_hidden`), which guidance contrasts against;
- through the VAE: its mode, normalised per channel ((z - mean) / std, as `_encode_vae_image`), packed 2x2 after the
  noisy latent's tokens, its own grid in `img_shapes` (RoPE places it as a second image); only the latent's tokens of
  the output are kept.
Both are cached with the prompt, each prompt at its own length (batches pad to their longest, with a mask).

Size: every source is resized to the edit's R x R (as FLUX.1 Kontext's sources are here), so one batch holds sources
of any size and aspect. The stock pipeline resizes the source to about 1024 x 1024 pixels at its own aspect whatever
the edit's size; for a square source at R = 1024 (the presets) that is the same call: the engine's sample is
`pipe(image=source resized to R x R, height=R, width=R)`'s for the seed. At another R the engine keeps the source at
R x R (its tokens scale with the edit's) where the pipeline would still use 1024 x 1024 (tests/test_qwenimage_edit.py
compares at 64 px with the pipeline's 1024 x 1024 area set to 64 x 64). R must be a multiple of 32 (the pipeline
rounds the source's sides to 32).

Guidance: as Qwen-Image's (module qwenimage): plain classifier-free guidance, without the stock pipeline's rescale
of each token's guided velocity to the conditional one's norm, against the negative prompt " " (the model card's)
encoded with the source. The explore copy, LoRA targets and repeated blocks are Qwen-Image's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from solrl_engine.data import probe_prompt, single_images
from solrl_engine.models import ModelSpec, model_spec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.qwenimage import QWEN_BLOCKS, QWEN_EXPLORE_RULE, QWEN_LORA_TARGETS, QwenImageModel
from solrl_engine.models.qwenimage import SPEC as QWEN_SPEC

NEGATIVE_PROMPT = " "  # Qwen/Qwen-Image-Edit's model card: true_cfg_scale 4.0 against negative_prompt=" "


class QwenImageEditModel(QwenImageModel):
    MODEL = "qwenimage_edit"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "QwenImageEditPipeline"
    WHAT = "Qwen-Image-Edit edits"
    # stand-in text length ("random"): at 1024 px the source's 1,225 vision tokens (Qwen2-VL's processor resizes it to
    # 980 px: 70 x 70 patches of 14 px, merged 2 x 2) and Qwen-Image's 128 for the instruction
    TEXT_TOKENS = 1225 + 128

    def __init__(self, pipe: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(pipe, *args, **kwargs)
        step = model_spec(self.MODEL).resolution_step  # what a config is checked against too, before any weights
        if self.resolution % step:
            raise ValueError(f"resolution={self.resolution}: {self.WHAT} at a multiple of {step} pixels (the "
                             f"pipeline rounds the source's sides to {step}): use "
                             f"{self.resolution // step * step or step}")  # fmt: skip

    @property
    def tokens_per_sample(self) -> int:
        """The transformer's image tokens: the latent's and as many of the source's (same size)."""
        return 2 * super().tokens_per_sample

    # --- prompts ------------------------------------------------------------------------------------

    @staticmethod
    def probe_prompt() -> str:
        return probe_prompt()

    def _sources_of(self, prompt: str) -> list[Any]:
        """The prompt's sources (here its one source) resized to the edit's R x R."""
        r = self.resolution
        return [self.pipe.image_processor.resize(im, r, r) for im in single_images([prompt], self.WHAT)]

    def _seen(self, sources: list[Any]) -> Any:  # noqa: ANN401 - PIL images
        """What the pipeline hands its text encoder's processor: the source itself."""
        return sources[0]

    def _encode(self, prompts: list[str]) -> Conditioning:
        """Each prompt and the negative through the pipeline's encode_prompt with what it shows of the prompt's
        sources, one prompt at a time (as `pipe()` encodes it: no padding inside the encoder), and the sources'
        latents stacked along the channels ([B, n x 16, R/8, R/8])."""
        rows, latents = [], []
        for prompt in prompts:
            sources = self._sources_of(prompt)
            seen = self._seen(sources)
            pos, pos_mask = self._text(str(prompt), seen)
            neg, neg_mask = self._text(NEGATIVE_PROMPT, seen)
            rows.append(Conditioning(pos, None, pos_mask, negative_hidden=neg, negative_mask=neg_mask))
            latents.append(self._encode_sources(sources).flatten(0, 1).unsqueeze(0))
        text = Conditioning.cat(rows)
        text.image = torch.cat(latents)
        return text

    def _text(self, text: str, source: Any) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN401 - a PIL image
        hidden, _ = self.pipe.encode_prompt([text], image=source, device=self.device_)
        return hidden.to(self.dtype), torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Qwen-Image's cut (a batch to its longest prompt, no mask where none is padded), and the same for the
        negatives."""
        cond = super().encode_prompts(prompts)
        if cond.negative_mask is None:
            return cond
        n = int(cond.negative_mask.sum(1).max())
        mask = cond.negative_mask[:, :n]
        return dataclasses.replace(cond, negative_hidden=cond.negative_hidden[:, :n],
                                   negative_mask=None if bool(mask.all()) else mask)  # fmt: skip

    def _encode_negative(self) -> Conditioning:
        """Never contrasted against: each prompt carries its negative, encoded with its source (`_encode`)."""
        return Conditioning(torch.zeros(1, 1, int(self.transformer.config.joint_attention_dim), dtype=self.dtype))

    def _standin_encode(self, prompts: list[str]) -> Conditioning:
        """Stand-in text states ("random") for the prompt and the empty negative, and random source latents."""
        text, neg = super()._standin_encode(prompts), super()._standin_encode([""] * len(prompts))
        g = torch.Generator().manual_seed(0)
        side = self.latent_shape[1]
        src = torch.randn(len(prompts), self.latent_shape[0], side, side, generator=g)
        return Conditioning(text.hidden, None, text.mask, src.to(text.hidden.device, self.dtype), None, neg.hidden,
                            neg.mask)  # fmt: skip

    def pipeline_inputs(self, prompt: str, rows: int = 1) -> dict[str, Any]:
        """The source resized to the edit's R x R (see the module docstring for R other than 1024), once per row:
        the pipeline's processor reads one image per prompt text."""
        return {"image": self._sources_of(prompt) * rows}

    @torch.no_grad()
    def _encode_sources(self, images: list[Any]) -> torch.Tensor:
        """[n, 16, R/8, R/8]: each source preprocessed as the pipeline does, one frame through the VAE, its mode
        normalised per channel."""
        proc, vae, r = self.pipe.image_processor, self.pipe.vae, self.resolution
        pixels = torch.cat([proc.preprocess(im, r, r) for im in images]).unsqueeze(2)
        z = vae.encode(pixels.to(self.device_, vae.dtype)).latent_dist.mode()
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(view).to(z.device, z.dtype)
        return ((z - mean) / std)[:, :, 0].to(self.dtype)

    # --- the transformer ----------------------------------------------------------------------------

    def _image_tokens(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The latent's tokens, then each source's in order, each with its own grid."""
        if cond.image is None:
            raise ValueError(f"{self.WHAT} need the sources' latents in their conditioning (a conditioned prompt "
                             "encoded by this model)")  # fmt: skip
        tokens, shapes = super()._image_tokens(x, cond)
        b, c = x.shape[:2]
        src = cond.image.to(x.dtype)
        _, cn, hs, ws = src.shape
        packed = [self.pipeline_latents(s) for s in src.view(b, cn // c, c, hs, ws).unbind(1)]
        return torch.cat([tokens, *packed], 1), shapes + [(1, hs // 2, ws // 2)] * len(packed)

SPEC = ModelSpec(
    name="qwenimage_edit",
    adapter="solrl_engine.models.qwenimage_edit:QwenImageEditModel",
    pipeline="QwenImageEditPipeline",
    default_path="Qwen/Qwen-Image-Edit",
    resolution=1024,
    lora_targets=QWEN_LORA_TARGETS,
    explore_rule=QWEN_EXPLORE_RULE,
    explore_rule_by_format={},  # Qwen-Image's (module qwenimage)
    guidance="cfg",  # plain CFG against " " encoded with each source: the pipeline's true CFG without its rescale
    guidance_scale=4.0,
    repeated_blocks=QWEN_BLOCKS,
    producers=QWEN_SPEC.producers,
    producer_blocks=QWEN_SPEC.producer_blocks,
    conditioned=True,
    resolution_step=32,  # the pipeline rounds the sources' sides to 32
    text_encoder_params_b={"Qwen2.5-VL-7B": 8.29},
    vae_params_b=0.127,
)
