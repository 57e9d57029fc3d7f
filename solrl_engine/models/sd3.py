"""Stable Diffusion 3 / 3.5 (MMDiT): `StableDiffusion3Pipeline` with two CLIP encoders and T5.

Defaults are the paper's SD3.5-Large setting: 1024 px, LoRA on the attention projections of both
streams, the explore copy quantizing the image-stream MLPs only (Sol-RL keeps every layer no wider
than 2432 in BF16, which on SD3.5-L leaves exactly `transformer_blocks.*.ff`; ff_context stays BF16).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.pipeline import JOINT_ATTENTION_LORA_TARGETS, PipelineFlowModel
from solrl_engine.nn.producers import modulate

SD3_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS
SD3_EXPLORE_RULE: dict[str, Any] = {"include": ("transformer_blocks.*.ff.*",)}


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        temb: torch.Tensor, joint_attention_kwargs: dict[str, Any] | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """diffusers' JointTransformerBlock.forward for an explore copy whose norms are producers (nn.producers): its
    adaLN norm1s are fused modules already; norm2 and norm2_context, modulated inline, go through `modulate`, so
    they carry the codes of each stream's first FFN linear. SD3.5-Medium's dual attention and a chunked FFN run the
    stock forward."""
    if self.use_dual_attention or self._chunk_size is not None:
        return super(type(self), self).forward(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
    kwargs = joint_attention_kwargs or {}
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    if self.context_pre_only:
        norm_context = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states,
                                                                                             emb=temb)  # fmt: skip
    attn_output, context_attn_output = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                                                 **kwargs)  # fmt: skip
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    ff_output = self.ff(modulate(self.norm2, hidden_states, scale_mlp[:, None], shift_mlp[:, None]))
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
    if self.context_pre_only:
        return None, hidden_states
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    y = modulate(self.norm2_context, encoder_hidden_states, c_scale_mlp[:, None], c_shift_mlp[:, None])
    return encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(y), hidden_states
SD3_BLOCKS = ("JointTransformerBlock", "SD3SingleTransformerBlock")  # the MMDiT's repeated blocks


class SD3Model(PipelineFlowModel):
    MODEL = "sd3"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "StableDiffusion3Pipeline"
    TRANSFORMER_CLASS = "SD3Transformer2DModel"
    DEFAULT_RESOLUTION = 1024
    TEXT_TOKENS = 333  # 77 CLIP + 256 T5 tokens, as the pipeline's default max_sequence_length
    RANDOM_VAE_FACTOR = 8
    FULL_CONFIG: ClassVar[dict[str, Any]] = dict(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
        pos_embed_max_size=192, qk_norm="rms_norm",
    )  # fmt: skip  (SD3.5-Large)
    RANDOM_VAE_CONFIG = ("AutoencoderKL", dict(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
        act_fn="silu", use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, scaling_factor=1.5305,
        shift_factor=0.0609))  # fmt: skip  (SD3.5-Large's vae/config.json)

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=3.0)

    def _latent_shape(self) -> tuple[int, ...]:
        side = self.resolution // self.vae_factor
        return (int(self.transformer.config.in_channels), side, side)

    def _standin_dims(self) -> tuple[int, int | None]:
        c = self.transformer.config
        return int(c.joint_attention_dim), int(c.pooled_projection_dim)

    def _encode(self, prompts: list[str]) -> Conditioning:
        hidden, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device_, do_classifier_free_guidance=False
        )
        return Conditioning(hidden.to(self.dtype), pooled.to(self.dtype))

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return net(
            hidden_states=x,
            timestep=self.model_timestep(t),
            encoder_hidden_states=cond.hidden.to(x.dtype),
            pooled_projections=cond.pooled.to(x.dtype),  # type: ignore[union-attr]
            return_dict=False,
        )[0]



SPEC = ModelSpec(
    name="sd3",
    adapter="solrl_engine.models.sd3:SD3Model",
    pipeline="StableDiffusion3Pipeline",
    default_path="stabilityai/stable-diffusion-3.5-large",
    resolution=1024,
    lora_targets=SD3_LORA_TARGETS,
    explore_rule=SD3_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=1.0,
    repeated_blocks=SD3_BLOCKS,
    # adaLN norms whose output only the joint attention's projections read (SD3.5-M's dual-attention norm1 is
    # another class: left as it is, said in the report)
    producers={
        "transformer_blocks.*.norm1": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "transformer_blocks.*.norm1_context": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        # modulated inline: fused_block_forward
        "transformer_blocks.*.norm2": ("ff.net.0.proj",),
        "transformer_blocks.*.norm2_context": ("ff_context.net.0.proj",),
        # each FFN's GELU module (its first linear and the activation) feeds its second linear (net.2)
        "transformer_blocks.*.ff.net.0": ("2",),
        "transformer_blocks.*.ff_context.net.0": ("2",),
    },
    producer_blocks={"JointTransformerBlock": fused_block_forward},
    text_encoder_params_b={"CLIP-L": 0.124, "CLIP-G": 0.695, "T5-XXL encoder": 4.76},  # published
    vae_params_b=0.084,
)
