"""FLUX.1 (MMDiT with single-stream blocks): `FluxPipeline` with CLIP-L (pooled) and T5 (tokens).

Latents are kept unpacked ([16, H/8, W/8], the noise `FluxPipeline.prepare_latents` draws) and
packed 2x2 into 64-feature tokens inside the forward, with the pipeline's image ids; the distilled
guidance is an input of the transformer (3.5 by default), not classifier-free guidance; the
schedule is the pipeline's: sigmas linspace(1, 1/N) under the dynamic shift mu of the image's
token count. Defaults are the paper's FLUX.1-dev setting: 512 px, the explore copy quantizing
nearly every linear (all but the embedders, the adaLN modulations and the final projection).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.pipeline import JOINT_ATTENTION_LORA_TARGETS, PackedLatentFlowModel
from solrl_engine.nn.producers import activate_after, modulate

FLUX_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                        joint_attention_kwargs: dict[str, Any] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """diffusers' FluxTransformerBlock.forward for an explore copy whose norms are producers (nn.producers): its
    adaLN norm1s are fused modules already; norm2 and norm2_context, modulated inline, go through `modulate`, so
    they carry the codes of each stream's first FFN linear."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states,
                                                                                         emb=temb)  # fmt: skip
    outputs = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                        image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))  # fmt: skip
    attn_output, context_attn_output = outputs[:2]
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    ff_output = self.ff(modulate(self.norm2, hidden_states, scale_mlp[:, None], shift_mlp[:, None]))
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
    if len(outputs) == 3:  # an IP-Adapter's image attention
        hidden_states = hidden_states + outputs[2]
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    y = modulate(self.norm2_context, encoder_hidden_states, c_scale_mlp[:, None], c_shift_mlp[:, None])
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(y)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def fused_single_block_forward(self: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                               temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                               joint_attention_kwargs: dict[str, Any] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """diffusers' FluxSingleTransformerBlock.forward for an explore copy whose producers are fused (nn.producers):
    its output projection's input, the attention's output beside the MLP's GELU, is joined by `activate_after`, so
    the GELU, the join and the projection's codes are one op (the widest quantize of FLUX.1: 15,360 values a row)."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp = self.proj_mlp(norm_hidden_states)
    attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                            **(joint_attention_kwargs or {}))  # fmt: skip
    hidden_states = residual + gate.unsqueeze(1) * self.proj_out(activate_after(self.act_mlp, attn_output, mlp))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


class FluxModel(PackedLatentFlowModel):
    MODEL = "flux"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "FluxPipeline"
    TRANSFORMER_CLASS = "FluxTransformer2DModel"
    DEFAULT_RESOLUTION = 512
    TEXT_TOKENS = 512  # the pipeline's default T5 max_sequence_length
    RANDOM_VAE_FACTOR = 8
    FULL_CONFIG: ClassVar[dict[str, Any]] = dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )  # fmt: skip  (FLUX.1-dev)
    RANDOM_VAE_CONFIG = ("AutoencoderKL", dict(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
        act_fn="silu", use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, scaling_factor=0.3611,
        shift_factor=0.1159))  # fmt: skip  (FLUX.1-dev's vae/config.json)

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
            max_image_seq_len=4096,
        )  # fmt: skip

    def _standin_dims(self) -> tuple[int, int | None]:
        c = self.transformer.config
        return int(c.joint_attention_dim), int(c.pooled_projection_dim)

    def _encode(self, prompts: list[str]) -> Conditioning:
        hidden, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device_)
        return Conditioning(hidden.to(self.dtype), pooled.to(self.dtype))

    @classmethod
    def spec(cls) -> ModelSpec:
        """The family's ModelSpec (its default distilled guidance): FLUX.1's, or a subclass family's."""
        from solrl_engine.models import model_spec

        return model_spec(cls.MODEL)

    @staticmethod
    def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype, index: int = 0) -> torch.Tensor:
        """The pipeline's position ids of a packed [h/2 x w/2] grid: (index, row, column) per token."""
        ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
        ids[..., 0] = index
        ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
        ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
        return ids.reshape(-1, 3)

    def _image_tokens(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image tokens and their ids: the packed latents (a conditioned family appends its
        condition's; the output keeps the first h/2 x w/2 tokens)."""
        _, _, h, w = x.shape
        return self.pipeline_latents(x), self.image_ids(h, w, x.device, x.dtype)

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens, ids = self._image_tokens(x, cond)
        txt_ids = torch.zeros(cond.hidden.shape[1], 3, device=x.device, dtype=x.dtype)
        guidance = None
        if getattr(net.config if hasattr(net, "config") else self.transformer.config, "guidance_embeds", False):
            g = self.spec().guidance_scale if self.guidance_scale is None else self.guidance_scale
            guidance = torch.full((b,), float(g), device=x.device, dtype=torch.float32)
        out = net(
            hidden_states=tokens,
            timestep=self.model_timestep(t, 1000.0) / 1000,
            guidance=guidance,
            pooled_projections=cond.pooled.to(x.dtype),  # type: ignore[union-attr]
            encoder_hidden_states=cond.hidden.to(x.dtype),
            txt_ids=txt_ids,
            img_ids=ids,
            return_dict=False,
        )[0]
        return self.unpack(out[:, : (h // 2) * (w // 2)], x.shape)



SPEC = ModelSpec(
    name="flux",
    adapter="solrl_engine.models.flux:FluxModel",
    pipeline="FluxPipeline",
    default_path="black-forest-labs/FLUX.1-dev",
    resolution=512,
    lora_targets=FLUX_LORA_TARGETS,
    explore_rule={},  # every eligible linear; the recipe's defaults keep embedders, adaLN and proj_out
    guidance="embedded",
    guidance_scale=3.5,
    repeated_blocks=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    # adaLN-Zero norms whose output only the attention projections (and a single block's MLP) read
    producers={
        "transformer_blocks.*.norm1": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "transformer_blocks.*.norm1_context": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        "single_transformer_blocks.*.norm": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
        # modulated inline: fused_block_forward
        "transformer_blocks.*.norm2": ("ff.net.0.proj",),
        "transformer_blocks.*.norm2_context": ("ff_context.net.0.proj",),
        # each FFN's GELU module (its first linear and the activation) feeds its second linear (net.2)
        "transformer_blocks.*.ff.net.0": ("2",),
        "transformer_blocks.*.ff_context.net.0": ("2",),
        # a single block's MLP activation, joined after its attention's output, feeds its output projection
        "single_transformer_blocks.*.act_mlp": ("proj_out",),
    },
    producer_blocks={"FluxTransformerBlock": fused_block_forward,
                     "FluxSingleTransformerBlock": fused_single_block_forward},
    text_encoder_params_b={"CLIP-L": 0.123, "T5-XXL encoder": 4.76},  # published
    vae_params_b=0.084,
)
