"""Z-Image (6B single-stream DiT): `ZImagePipeline` with the Qwen3-4B text encoder and FLUX.1's 16-channel VAE, for
Tongyi-MAI/Z-Image (the base model; Z-Image-Turbo, its 8-step distillation, loads the same way).

Prompts are encoded as `pipe(prompt)` encodes them: Qwen3's chat template around the prompt (thinking on, so no
empty think block), the encoder's second-to-last hidden states, only the prompt's own tokens (the pipeline hands
the transformer one tensor per prompt, as long as that prompt). Here each prompt is cached padded to
`max_sequence_length` with its mask, and the forward cuts every row back to its own length: the transformer pads a
caption to a multiple of 32 itself and places the image's positions after it, so a prompt's length is part of
the model's input. That length is read on the host in every forward, which a captured CUDA graph would freeze:
the spec says `capturable=False`, and rollouts sample without graphs.

Latents are [16, H/8, W/8], the noise the pipeline draws; the transformer patches them 2x2 itself and takes a
list of [16, 1, H/8, W/8] (one frame). It takes t' = 1 - sigma (the pipeline's (1000 - 1000 sigma) / 1000) and
predicts x0 - noise: the velocity here is its negative. The schedule is the pipeline's: sigmas linspace(1, 1/N)
under the scheduler's shift (static for the published models, the dynamic one where a scheduler asks for it).

Guidance: the pipeline guides as v_c + g (v_c - v_u) against the empty prompt through the same template, which is
the engine's classifier-free guidance at s = g + 1 (`pipeline_guidance_offset`): the model card's guidance 4.0
is 5.0 here. Its optional `cfg_normalization` (off in the model card's call) and `cfg_truncation` (1.0: off) are
not reproduced.

The explore copy quantizes the per-token linears of the 30 main layers and of both refiners (attention q, k, v,
out and the SwiGLU w1, w2, w3); kept in BF16: the adaLN modulations (one vector per image per block), the time and
caption embedders, the patch embedder and the final layer. In an 8-bit copy each modulated block's two RMS norms
(times their scale) write the codes of the attention's q, k, v and of the FFN's w1, w3, and each FFN's gate those
of w2 (`fused_block_forward`, `fused_ffn_forward`; nn.producers).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.pipeline import PackedLatentFlowModel
from solrl_engine.nn.producers import gate, scaled_rms

Z_IMAGE_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
Z_IMAGE_EXPLORE_RULE: dict[str, Any] = {
    "include": ("layers.*.attention.*", "layers.*.feed_forward.*", "noise_refiner.*.attention.*",
                "noise_refiner.*.feed_forward.*", "context_refiner.*.attention.*", "context_refiner.*.feed_forward.*")
}  # fmt: skip


def fused_block_forward(self: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor, freqs_cis: torch.Tensor,
                        adaln_input: torch.Tensor | None = None, noise_mask: torch.Tensor | None = None,
                        adaln_noisy: torch.Tensor | None = None, adaln_clean: torch.Tensor | None = None
                        ) -> torch.Tensor:  # fmt: skip
    """diffusers' ZImageTransformerBlock.forward for an explore copy whose norms are producers (nn.producers): with
    one modulation per sample, each RMS norm times its scale goes through `scaled_rms`, so it carries the codes of
    the attention's q, k, v and of the FFN's w1, w3. A per-token modulation (`noise_mask`) or an unmodulated block
    (the context refiner) runs the stock forward."""
    if not self.modulation or noise_mask is not None:
        return super(type(self), self).forward(x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy,
                                               adaln_clean)  # fmt: skip
    scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
    gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
    scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
    attn_out = self.attention(scaled_rms(self.attention_norm1, x, scale_msa), attention_mask=attn_mask,
                              freqs_cis=freqs_cis)  # fmt: skip
    x = x + gate_msa * self.attention_norm2(attn_out)
    return x + gate_mlp * self.ffn_norm2(self.feed_forward(scaled_rms(self.ffn_norm1, x, scale_mlp)))


def fused_ffn_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' Z-Image FeedForward.forward, w2(silu(w1(x)) * w3(x)), with the gate through `gate`: the product
    and the codes of w2 (8/3 of the hidden size a row, the widest quantize Z-Image has) in one op."""
    return self.w2(gate(self, self.w1(x), dim=-1, gate_first=True, second=self.w3(x)))


class ZImageModel(PackedLatentFlowModel):
    MODEL = "z_image"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "ZImagePipeline"
    TRANSFORMER_CLASS = "ZImageTransformer2DModel"
    DEFAULT_RESOLUTION = 1024  # the pipeline's default size
    MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default
    TEXT_TOKENS = 128  # stand-in text length for "random"
    RANDOM_VAE_FACTOR = 8
    # Tongyi-MAI/Z-Image's transformer: the class's defaults, 6,154,908,736 parameters
    FULL_CONFIG: ClassVar[dict[str, Any]] = dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
        n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512],
    )  # fmt: skip

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=6.0)  # the base model's static shift (Turbo's: 3.0)

    @classmethod
    def pipeline_resolution(cls, pipe: Any) -> int:
        """A stock ZImagePipeline draws 1024 x 1024 unless told."""
        return cls.DEFAULT_RESOLUTION

    def _latent_shape(self) -> tuple[int, ...]:
        side = 2 * (self.resolution // self.vae_factor)  # the VAE's cells; the transformer patches 2x2 itself
        return (int(self.transformer.config.in_channels), side, side)

    @property
    def tokens_per_sample(self) -> int:
        """The image's 2x2 patches padded to the transformer's multiple of 32: the rows the noise refiner's linears
        see per image (the main layers see the prompt's tokens beside them)."""
        return -(-super().tokens_per_sample // 32) * 32

    def pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the pipeline's latents are ours: no packing outside the transformer

    def _standin_dims(self) -> tuple[int, int | None]:
        return int(self.transformer.config.cap_feat_dim), None

    def _encode(self, prompts: list[str]) -> Conditioning:
        embeds, _ = self.pipe.encode_prompt(list(prompts), device=self.device_, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)  # fmt: skip
        width = int(embeds[0].shape[-1])
        hidden = torch.zeros(len(embeds), self.max_sequence_length, width, dtype=self.dtype, device=self.device_)
        mask = torch.zeros(len(embeds), self.max_sequence_length, dtype=torch.long, device=self.device_)
        for i, e in enumerate(embeds):
            hidden[i, : len(e)] = e.to(self.dtype)
            mask[i, : len(e)] = 1
        return Conditioning(hidden, None, mask)

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        # on the host: the reason this model is not capturable (the stand-in conditioning of "random", which the
        # memory plan runs on fake tensors, is unpadded: every row is as long as the tensor)
        lengths = [cond.hidden.shape[1]] * len(x) if self.random else cond.mask.sum(1).tolist()
        captions = [h[:n] for h, n in zip(cond.hidden.to(x.dtype), lengths, strict=True)]
        timestep = (1000 - self.model_timestep(t)) / 1000  # the pipeline's t' = 1 - sigma, computed as it does
        out = net(list(x.unsqueeze(2).unbind(0)), timestep, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)  # it predicts x0 - noise


SPEC = ModelSpec(
    name="z_image",
    adapter="solrl_engine.models.z_image:ZImageModel",
    pipeline="ZImagePipeline",
    default_path="Tongyi-MAI/Z-Image",
    resolution=1024,
    lora_targets=Z_IMAGE_LORA_TARGETS,
    explore_rule=Z_IMAGE_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=5.0,  # the model card's guidance_scale 4.0, in the engine's convention (pipeline + 1)
    pipeline_guidance_offset=1.0,
    capturable=False,
    repeated_blocks=("ZImageTransformerBlock",),
    # the modulated blocks' RMS norms (times their scale) and every FFN's gate: producers in an 8-bit explore copy
    # (the context refiner's blocks are unmodulated: their norms stay as they are)
    producers={"layers.*.attention_norm1": ("attention.to_q", "attention.to_k", "attention.to_v"),
               "layers.*.ffn_norm1": ("feed_forward.w1", "feed_forward.w3"),
               "noise_refiner.*.attention_norm1": ("attention.to_q", "attention.to_k", "attention.to_v"),
               "noise_refiner.*.ffn_norm1": ("feed_forward.w1", "feed_forward.w3"),
               "*.*.feed_forward": ("feed_forward.w2",)},
    producer_blocks={"ZImageTransformerBlock": fused_block_forward, "FeedForward": fused_ffn_forward},
    text_encoder_params_b={"Qwen3-4B": 4.02},  # published
    vae_params_b=0.084,  # FLUX.1's VAE
)
