"""Wan image-to-video: `WanImageToVideoPipeline`, for Wan2.1-I2V-14B (480p and 720p) as diffusers ships it: Wan's
text side, clip layout, schedule and decode (models/wan.py), and a first frame per prompt.

Each prompt is a conditioned one (solrl_engine/data: JSON lines `{"prompt": ..., "image": PATH}`), its image the
clip's first frame. As the pipeline does it, the image is resized to the clip's H x W by the pipeline's video
processor, followed by F - 1 black frames, encoded by the VAE's mode and normalised per channel, and a mask marks
the first latent frame as given: [4 + 16, T, H/8, W/8] condition channels, concatenated to the noisy latent's 16
in every forward (the transformer takes 36). The image also goes through the pipeline's CLIP vision encoder (its
penultimate hidden states) into the transformer's image cross-attention, where the model has one (`image_dim`).
Both are cached with the prompt's text states (`Conditioning.image`, `image_states`), and classifier-free
guidance keeps them in the unconditional pass, as the pipeline's does. For a seed and an image the engine's clip
is `pipe(image=..., prompt=..., height=H, width=W, num_frames=F)`'s.

Wan2.2-I2V-A14B's two experts (`transformer_2`, `boundary_ratio`) are switched as the pipeline switches them, as
for text-to-video (models/experts.py). Not wired: Wan2.2-TI2V-5B's `expand_timesteps` mode, which writes the first
frame into the latent and gives it its own timestep, and a last frame (`last_image`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.data import probe_prompt, single_images
from solrl_engine.models.base import Conditioning
from solrl_engine.models.wan import _COMMON, WanModel
from solrl_engine.models.wan import SPEC as WAN_SPEC

# Wan2.1-I2V-14B's transformer (diffusers' conversion of the official config): the T2V 14B's blocks, 36 input
# channels (16 noisy + 4 mask + 16 condition) and a CLIP ViT-H image cross-attention (1280 -> 5120)
WAN_I2V_14B: dict[str, Any] = {**_COMMON, "num_layers": 40, "num_attention_heads": 40, "ffn_dim": 13824,
                               "in_channels": 36, "out_channels": 16, "image_dim": 1280,
                               "added_kv_proj_dim": 5120}  # fmt: skip


class WanI2VModel(WanModel):
    MODEL = "wan_i2v"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "WanImageToVideoPipeline"
    FULL_CONFIG: ClassVar[dict[str, Any]] = WAN_I2V_14B
    ALIAS_CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {"wan2.1-i2v-14b": WAN_I2V_14B}
    HUB_CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": WAN_I2V_14B,
        "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": WAN_I2V_14B,
        # each of Wan2.2-I2V-A14B's two experts: the same blocks without the CLIP image cross-attention
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {**WAN_I2V_14B, "image_dim": None, "added_kv_proj_dim": None},
    }
    HUB_EXPERTS: ClassVar[dict[str, float]] = {"Wan-AI/Wan2.2-I2V-A14B-Diffusers": 0.9}
    CLIP_TOKENS = 257  # CLIP ViT-H/14's tokens at 224 px: the stand-in image states of "random"

    def __init__(self, pipe: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(getattr(pipe, "config", None), "expand_timesteps", False):
            raise ValueError(
                "this WanImageToVideoPipeline writes the first frame into the latent (expand_timesteps: "
                "Wan2.2-TI2V-5B's image-to-video mode), which the engine does not sample yet; use a Wan2.1-I2V "
                "pipeline, or Wan2.2-TI2V-5B for text-to-video (model=wan)"
            )
        super().__init__(pipe, *args, **kwargs)

    def _latent_shape(self) -> tuple[int, ...]:
        """The noisy latent only: the transformer's output channels (its input adds the condition's 20)."""
        shape = super()._latent_shape()
        return (int(self.transformer.config.out_channels), *shape[1:])

    @staticmethod
    def probe_prompt() -> str:
        return probe_prompt()

    def _encode_negative(self) -> Conditioning:
        """The empty prompt's text alone: guidance adds each row's image condition to it (Conditioning.against)."""
        return super()._encode([""])

    def _encode(self, prompts: list[str]) -> Conditioning:
        text = super()._encode(prompts)
        frames = single_images(prompts, "image-to-video starts each clip from")
        states = None
        if self.transformer.config.image_dim is not None:
            states = torch.cat([self.pipe.encode_image(im, self.device_) for im in frames]).to(self.dtype)
        return Conditioning(text.hidden, None, None, torch.cat([self._condition(im) for im in frames]), states)

    @torch.no_grad()
    def _condition(self, image: Any) -> torch.Tensor:
        """[1, 20, T, H/8, W/8]: the first-frame mask (4 channels: the VAE's temporal factor) and the VAE's
        normalised latents of the image followed by black frames, as the pipeline's prepare_latents makes them."""
        vae, (_, t, h, w) = self.pipe.vae, self.latent_shape
        height, width = self.resolution, self.width or self.resolution
        px = self.pipe.video_processor.preprocess(image, height=height, width=width).to(self.device_, torch.float32)
        video = torch.cat([px.unsqueeze(2), px.new_zeros(1, 3, self.frames - 1, height, width)], dim=2)
        z = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(z.device)
        z = (z - mean) * inv_std
        factor = self.pipe.vae_scale_factor_temporal
        mask = torch.zeros(1, factor, t, h, w, device=z.device)
        mask[:, :, 0] = 1  # the first latent frame (the first `factor` mask channels of the pipeline's layout) given
        return torch.cat([mask, z], dim=1).to(self.dtype)

    def _standin_encode(self, prompts: list[str]) -> Conditioning:
        """The stand-in text states of "random", a stand-in condition and CLIP states of the published sizes."""
        text = super()._standin_encode(prompts)
        g = torch.Generator().manual_seed(0)
        c = int(self.transformer.config.in_channels) - self.latent_shape[0]
        cond = torch.randn(len(prompts), c, *self.latent_shape[1:], generator=g).to(self.device_, self.dtype)
        dim = self.transformer.config.image_dim
        states = None if dim is None else torch.randn(len(prompts), self.CLIP_TOKENS, int(dim), generator=g)
        return Conditioning(text.hidden, None, None, cond, None if states is None else states.to(self.device_,
                                                                                               self.dtype))  # fmt: skip

    def pipeline_inputs(self, prompt: str, rows: int = 1) -> dict[str, Any]:
        """The clip's first frame, which the pipeline resizes to the clip's size as the engine does."""
        return {"image": single_images([prompt], "Wan image-to-video starts")[0]}

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        if cond.image is None:
            raise ValueError("Wan image-to-video needs its first frame's condition in the conditioning (a conditioned "
                             "prompt encoded by this model)")  # fmt: skip
        states = None if cond.image_states is None else cond.image_states.to(x.dtype)
        return net(hidden_states=torch.cat([x, cond.image.to(x.dtype)], dim=1), timestep=self.model_timestep(t),
                   encoder_hidden_states=cond.hidden.to(x.dtype), encoder_hidden_states_image=states,
                   return_dict=False)[0]  # fmt: skip


# Wan's spec (its LoRA targets, explore rule, guidance, blocks, two experts) with its own pipeline and encoders
SPEC = dataclasses.replace(
    WAN_SPEC,
    name="wan_i2v",
    adapter="solrl_engine.models.wan_i2v:WanI2VModel",
    pipeline="WanImageToVideoPipeline",
    default_path="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
    conditioned=True,
    # UMT5-XXL's encoder and the CLIP ViT-H/14 vision tower (open_clip's, as the pipeline ships it), the Wan2.1 VAE
    text_encoder_params_b={"UMT5-XXL encoder": 5.68, "CLIP ViT-H/14 vision": 0.63},
)
