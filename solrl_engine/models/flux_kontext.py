"""FLUX.1 Kontext (image editing): `FluxKontextPipeline`, FLUX.1's transformer, text encoders, VAE and schedule (this
family is FluxModel with a condition), for black-forest-labs/FLUX.1-Kontext-dev.

Each prompt is an instruction with its source image (a conditioned prompt set, solrl_engine/data: JSON lines
`{"prompt": ..., "image": PATH}`). The source is resized to the run's resolution (R x R, the size of the edit) with
the pipeline's image processor, encoded by the VAE's mode as the pipeline encodes it ((z - shift) x scale), and
cached with the prompt's text states. In the forward its packed tokens follow the noisy latent's, with position
ids whose first coordinate is 1, and only the latent's tokens of the output are kept: the engine's sample is
`pipe(image=source resized to R x R, height=R, width=R, max_area=R * R, _auto_resize=False)`'s for the seed (at
R = 1024, max_area is the pipeline's default). The pipeline's default instead picks one of Kontext's preferred
resolutions for the source; here a set's sources may be any size and any aspect, each resized to R x R.

Guidance is FLUX.1-dev's distilled guidance, an input of the transformer, 2.5 by default as the pipeline's; the
explore copy, LoRA targets and repeated blocks are FLUX.1's.
"""

from __future__ import annotations

from typing import Any

import torch

from solrl_engine.data import probe_prompt, single_images
from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.flux import FLUX_LORA_TARGETS, FluxModel
from solrl_engine.models.flux import SPEC as FLUX_SPEC


class FluxKontextModel(FluxModel):
    MODEL = "flux_kontext"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "FluxKontextPipeline"
    DEFAULT_RESOLUTION = 1024  # the pipeline's default size

    def _encode(self, prompts: list[str]) -> Conditioning:
        text = super()._encode(prompts)
        sources = single_images(prompts, "FLUX.1 Kontext edits")
        return Conditioning(text.hidden, text.pooled, None, self._encode_sources(sources))

    @property
    def tokens_per_sample(self) -> int:
        """The transformer's image tokens: the latent's and as many of the source's (resized to the edit's size)."""
        return 2 * super().tokens_per_sample

    @staticmethod
    def probe_prompt() -> str:
        return probe_prompt()

    def _standin_encode(self, prompts: list[str]) -> Conditioning:
        """The stand-in text states of "random" and a stand-in source the size of the edit (random latents)."""
        text = super()._standin_encode(prompts)
        g = torch.Generator().manual_seed(0)
        side = self.resolution // self.pipe.vae_scale_factor
        src = torch.randn(len(prompts), int(self.transformer.config.in_channels) // 4, side, side, generator=g)
        return Conditioning(text.hidden, text.pooled, text.mask, src.to(self.device_, self.dtype))

    def pipeline_inputs(self, prompt: str, rows: int = 1) -> dict[str, Any]:
        """The source resized to the edit's R x R, kept at that size by the pipeline (see the module docstring)."""
        r = self.resolution
        source = self.pipe.image_processor.resize(single_images([prompt], "FLUX.1 Kontext edits")[0], r, r)
        return {"image": source, "max_area": r * r, "_auto_resize": False}

    def _encode_negative(self) -> Conditioning:
        return super()._encode([""])  # (unused: the guidance is distilled, no negative pass)

    @torch.no_grad()
    def _encode_sources(self, images: list) -> torch.Tensor:  # noqa: ANN001 - PIL images
        """[B, 16, R/8, R/8]: each source resized to R x R and preprocessed as the pipeline does, the VAE's mode,
        shifted and scaled."""
        proc, vae, r = self.pipe.image_processor, self.pipe.vae, self.resolution
        pixels = torch.cat([proc.preprocess(proc.resize(im, r, r), r, r) for im in images])
        z = vae.encode(pixels.to(self.device_, vae.dtype)).latent_dist.mode()
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).to(self.dtype)

    def _image_tokens(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        if cond.image is None:
            raise ValueError("FLUX.1 Kontext needs the source image's latents in its conditioning (a conditioned "
                             "prompt encoded by this model)")  # fmt: skip
        tokens, ids = super()._image_tokens(x, cond)
        src = cond.image.to(x.dtype)
        _, _, hs, ws = src.shape
        src_ids = self.image_ids(hs, ws, x.device, x.dtype, index=1)
        return torch.cat([tokens, self.pipeline_latents(src)], 1), torch.cat([ids, src_ids])


SPEC = ModelSpec(
    name="flux_kontext",
    adapter="solrl_engine.models.flux_kontext:FluxKontextModel",
    pipeline="FluxKontextPipeline",
    default_path="black-forest-labs/FLUX.1-Kontext-dev",
    resolution=1024,
    lora_targets=FLUX_LORA_TARGETS,
    explore_rule={},  # FLUX.1's: every eligible linear; the recipe's defaults keep embedders, adaLN and proj_out
    guidance="embedded",
    guidance_scale=2.5,
    repeated_blocks=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    producers=FLUX_SPEC.producers,  # FLUX.1's blocks: the same producers
    producer_blocks=FLUX_SPEC.producer_blocks,
    conditioned=True,
    text_encoder_params_b={"CLIP-L": 0.123, "T5-XXL encoder": 4.76},
    vae_params_b=0.084,
)
