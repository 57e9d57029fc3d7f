"""Wan (text-to-video): `WanPipeline` with the UMT5 text encoder and the Wan VAE, for Wan2.1-T2V-1.3B and -14B,
Wan2.2-TI2V-5B (its own 48-channel VAE, 16x spatial) and Wan2.2-T2V-A14B (two 14B experts switched at a boundary
timestep, sampled and trained as one module: models/experts.py), as diffusers ships them.

A clip of F frames at H x W is a latent of [C, (F-1)/4 + 1, H/s, W/s] (s = 8, 16 for the 5B); a seed draws
that latent exactly as `pipe(latents=...)` takes it (and as the pipeline itself draws it from a list of seeded
CPU generators), so previews, regenerations and the stock pipeline agree. Prompts are encoded as `pipe(prompt)`
encodes them (512 UMT5 tokens, zeros after the end of the prompt, no mask), the transformer predicts the flow
velocity noise - x0 at an integer timestep floor(1000 sigma), and the stock sampler is UniPC (the solver
`unipc`). `decode` gives videos [B, F, 3, H, W] in [0, 1].

The explore copy quantizes every linear inside the repeated blocks (self-attention, cross-attention, FFN):
they run over the video tokens (tens of thousands per clip at 480p and 81 frames), except the cross-attention's
key/value projections over the 512 text tokens; the time and text embedders, the output projection and the
3-D patch embedding stay in BF16 (the recipe's default skips). Attention itself is never quantized, which is
why a video forward gains less from it than an image one (docs/video.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.experts import two_experts
from solrl_engine.models.pipeline import PipelineFlowModel
from solrl_engine.nn.producers import modulate

WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # both attentions of every block
# the blocks, of the one transformer or of both experts (models/experts.py names them as the pipeline does)
WAN_EXPLORE_RULE: dict[str, Any] = {"include": ("blocks.*", "transformer.blocks.*", "transformer_2.blocks.*")}


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        temb: torch.Tensor, rotary_emb: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """diffusers' WanTransformerBlock.forward for an explore copy whose norms are producers (nn.producers): norm1's
    and norm3's FP32 norm, modulation and cast to the activations' dtype go through `modulate`, so they carry the
    codes of the self-attention projections and of the FFN's first linear. A per-token modulation (a 4-D temb:
    Wan2.2-TI2V) keeps the stock expression."""
    if temb.ndim == 4:
        mods = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (m.squeeze(2) for m in mods)
    else:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()).chunk(6, dim=1)  # fmt: skip
    dtype = hidden_states.dtype
    y = modulate(self.norm1, hidden_states, scale_msa, shift_msa, dtype, fp32_norm=True)
    attn_output = self.attn1(y, None, None, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
    normed = self.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + self.attn2(normed, encoder_hidden_states, None, None)
    ff_output = self.ffn(modulate(self.norm3, hidden_states, c_scale_msa, c_shift_msa, dtype, fp32_norm=True))
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


# each block's norm1 and norm3 (modulated inline: fused_block_forward) and its FFN's GELU module (the first linear
# and the activation) feed these linears (named from the producer's parent); both experts' blocks
WAN_PRODUCERS = {f"{root}blocks.*.{name}": takers for root in ("", "transformer.", "transformer_2.")
                 for name, takers in (("norm1", ("attn1.to_q", "attn1.to_k", "attn1.to_v")),
                                      ("norm3", ("ffn.net.0.proj",)), ("ffn.net.0", ("2",)))}  # fmt: skip
TEMPORAL_FACTOR = 4  # frames per latent frame after the first (the Wan VAE's, fixed in its code)

# published transformer configs (diffusers' conversion of the official Wan configs); all patch (1, 2, 2), heads of
# 128, text width 4096, frequency embedding 256
WAN_CONFIGS: dict[str, dict[str, Any]] = {
    "wan2.1-1.3b": dict(num_layers=30, num_attention_heads=12, ffn_dim=8960, in_channels=16, out_channels=16),
    "wan2.1-14b": dict(num_layers=40, num_attention_heads=40, ffn_dim=13824, in_channels=16, out_channels=16),
    "wan2.2-5b": dict(num_layers=30, num_attention_heads=24, ffn_dim=14336, in_channels=48, out_channels=48),
}
_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)  # fmt: skip


class WanModel(PipelineFlowModel):
    MODEL = "wan"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "WanPipeline"
    TRANSFORMER_CLASS = "WanTransformer3DModel"
    DEFAULT_RESOLUTION = 480  # the height; Wan2.1's 480p is 480 x 832
    DEFAULT_WIDTH = 832
    DEFAULT_FRAMES = 81
    TEXT_TOKENS = 512  # what WanPipeline.__call__ encodes (its encode_prompt alone defaults to 226)
    MAX_SEQUENCE_LENGTH = 512
    RANDOM_VAE_FACTOR = 8
    # model_path="random+vae" (the GPU session's video trainer stage): Wan2.1's VAE, whose published config is
    # AutoencoderKLWan's defaults (base_dim 96, z_dim 16, its latents' means and deviations), random weights
    RANDOM_VAE_CONFIG: ClassVar[tuple[str, dict[str, Any]] | None] = ("AutoencoderKLWan", {})
    FULL_CONFIG: ClassVar[dict[str, Any]] = {**_COMMON, **WAN_CONFIGS["wan2.1-1.3b"]}
    # the benchmarks' names (models.ARCH_ALIASES) of the published transformers this adapter builds with random
    # weights, beside FULL_CONFIG's 1.3B
    ALIAS_CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {k: {**_COMMON, **v} for k, v in WAN_CONFIGS.items()}
    # the hub ids of those transformers, for the memory plan of a config whose weights are not on this machine
    HUB_CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ALIAS_CONFIGS["wan2.1-1.3b"],
        "Wan-AI/Wan2.1-T2V-14B-Diffusers": ALIAS_CONFIGS["wan2.1-14b"],
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": ALIAS_CONFIGS["wan2.2-5b"],
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": ALIAS_CONFIGS["wan2.1-14b"],  # each of its two experts
    }
    # the published two-expert pipelines' boundary_ratio (their model_index.json), for the memory plan of a config
    # whose weights are not on this machine
    HUB_EXPERTS: ClassVar[dict[str, float]] = {"Wan-AI/Wan2.2-T2V-A14B-Diffusers": 0.875}

    def __init__(self, pipe: Any, *args: Any, frames: int | None = None, width: int | None = None,
                 lora_experts: str = "both", **kwargs: Any) -> None:  # fmt: skip
        """`frames` (4k + 1) and `width` (None: 81 and 832, Wan2.1's 480p default; `resolution` is the height);
        `lora_experts`: which experts of a two-expert pipeline (Wan2.2-A14B) carry the trained LoRA (both, high,
        low)."""
        self.lora_experts = lora_experts
        self.frames = frames or self.DEFAULT_FRAMES
        self.width = width
        super().__init__(pipe, *args, **kwargs)
        if width is None:
            self.width = self.DEFAULT_WIDTH if self.resolution == self.DEFAULT_RESOLUTION else self.resolution
            self.latent_shape = self._latent_shape()

    def _denoiser(self, pipe: Any) -> nn.Module:
        """Wan2.2-A14B's two experts, switched at its boundary timestep as the stock pipeline switches them, as one
        module (models/experts.py); the one transformer otherwise."""
        return two_experts(pipe, self.lora_experts) or pipe.transformer

    @staticmethod
    def random_vae_factor(arch: dict[str, Any]) -> int:
        """The VAE a published transformer comes with: Wan2.2-TI2V-5B's 48 latent channels are its 16x VAE's."""
        return 16 if arch.get("in_channels") == 48 else 8

    @classmethod
    def pipeline_resolution(cls, pipe: Any) -> int:
        """A stock WanPipeline has no default size of its own: its __call__ draws 480 x 832."""
        return cls.DEFAULT_RESOLUTION

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)

    @property
    def vae_factor(self) -> int:
        """Pixels per latent cell: the VAE's spatial factor (8, or 16 for Wan2.2-TI2V-5B)."""
        return int(getattr(self.pipe, "vae_scale_factor_spatial", None) or self.pipe.vae_scale_factor)

    def _shift_override(self, shift: float) -> dict[str, Any]:
        return {"flow_shift": shift}

    def _latent_shape(self) -> tuple[int, ...]:
        f, patch = self.vae_factor, int(self.transformer.config.patch_size[-1])  # the transformer's spatial patch
        width = self.width or self.resolution
        for name, px in (("resolution (the height)", self.resolution), ("width", width)):
            if px % (f * patch):
                raise ValueError(f"{type(self).__name__}: {name} {px} is not a multiple of {f * patch} (the VAE's "
                                 f"{f} x the transformer's patch {patch}); pick a multiple")  # fmt: skip
        if (self.frames - 1) % TEMPORAL_FACTOR:
            raise ValueError(f"{type(self).__name__}: frames = {self.frames}: the Wan VAE takes 4k + 1 frames (e.g. "
                             "9, 33, 81, 121)")  # fmt: skip
        t = (self.frames - 1) // TEMPORAL_FACTOR + 1
        return (int(self.transformer.config.in_channels), t, self.resolution // f, width // f)

    def _standin_dims(self) -> tuple[int, int | None]:
        return int(self.transformer.config.text_dim), None

    def _encode(self, prompts: list[str]) -> Conditioning:
        hidden, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device_,
                                            max_sequence_length=self.max_sequence_length)  # fmt: skip
        return Conditioning(hidden.to(self.dtype))

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        # a [B] timestep: Wan2.2-TI2V's per-token timesteps (expand_timesteps) are all equal for text-to-video,
        # and give the same output at a fraction of the memory
        return net(hidden_states=x, timestep=self.model_timestep(t), encoder_hidden_states=cond.hidden.to(x.dtype),
                   return_dict=False)[0]  # fmt: skip

    def _decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Un-normalised per channel (the Wan VAE has latent means and deviations, no scaling factor), decoded
        frame by frame by the VAE: [B, F, 3, H, W] in [-1, 1]."""
        vae = self.pipe.vae
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(x.device, vae.dtype)
        std = torch.tensor(vae.config.latents_std).view(view).to(x.device, vae.dtype)
        video = vae.decode(x.to(vae.dtype) * std + mean, return_dict=False)[0]
        return video.transpose(1, 2)

    def _standin_decode(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        proj = (torch.randn(3, x.shape[1], generator=g) * 0.3).to(x.device)
        rgb = torch.einsum("oc,bcthw->btohw", proj, x.float())
        b, t = rgb.shape[:2]
        return torch.sigmoid(F.adaptive_avg_pool2d(rgb.flatten(0, 1), 32)).view(b, t, 3, 32, 32)


SPEC = ModelSpec(
    name="wan",
    adapter="solrl_engine.models.wan:WanModel",
    pipeline="WanPipeline",
    default_path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    resolution=480,
    lora_targets=WAN_LORA_TARGETS,
    explore_rule=WAN_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=5.0,
    repeated_blocks=("WanTransformerBlock",),
    producers=WAN_PRODUCERS,
    producer_blocks={"WanTransformerBlock": fused_block_forward},
    video=True,
    two_experts=True,
    # UMT5-XXL's encoder and the Wan2.1 VAE, counted on the meta device from their published configs
    # (bench/memory.py; Wan2.2-TI2V-5B's own VAE is 0.705B)
    text_encoder_params_b={"UMT5-XXL encoder": 5.68},
    vae_params_b=0.127,
)
