"""SANA (linear-attention DiT): `SanaPipeline` with a Gemma-2 text encoder and the 32x DC-AE.

The text states come with an attention mask the transformer needs; prompts are encoded with the
pipeline's own complex human instruction (what `pipe(prompt)` uses), so regenerating through the
stock pipeline gives the same images; with guidance, the empty negative prompt is encoded without it,
as the pipeline encodes a negative prompt. SANA's FFN (GLUMBConv) is made of 1x1 convolutions: the
explore copy quantizes them as linears over channels, with the cross-attention key/value
projections (the paper's SANA rule; Sol-RL had to swap in a Linear-FFN SANA for this).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.pipeline import PipelineFlowModel
from solrl_engine.nn.producers import gate, modulate, relayout

SANA_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
SANA_EXPLORE_RULE: dict[str, Any] = {
    "include": ("transformer_blocks.*.attn2.to_k", "transformer_blocks.*.attn2.to_v", "transformer_blocks.*.ff.*")
}


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        encoder_hidden_states: torch.Tensor | None = None,
                        encoder_attention_mask: torch.Tensor | None = None, timestep: torch.Tensor | None = None,
                        height: int | None = None, width: int | None = None) -> torch.Tensor:  # fmt: skip
    """diffusers' SanaTransformerBlock.forward for an explore copy whose norms are producers (nn.producers): each
    norm, its modulation and the cast to the activations' dtype go through `modulate`, so norm1's output carries
    the codes of the self-attention projections and norm2's those of the FFN's first 1x1 convolution (handed over
    in its NCHW layout)."""
    b = hidden_states.shape[0]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        self.scale_shift_table[None] + timestep.reshape(b, 6, -1)).chunk(6, dim=1)  # fmt: skip
    attn_output = self.attn1(modulate(self.norm1, hidden_states, scale_msa, shift_msa, hidden_states.dtype))
    hidden_states = hidden_states + gate_msa * attn_output
    if self.attn2 is not None:
        attn_output = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 attention_mask=encoder_attention_mask)  # fmt: skip
        hidden_states = attn_output + hidden_states
    # (no cast after norm2: the stock block has none)
    y = modulate(self.norm2, hidden_states, scale_mlp, shift_mlp)
    ff_output = self.ff(relayout(y, lambda t: t.unflatten(1, (height, width)).permute(0, 3, 1, 2)))
    ff_output = ff_output.flatten(2, 3).permute(0, 2, 1)
    return hidden_states + gate_mlp * ff_output


def fused_glumbconv_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers' GLUMBConv.forward for an explore copy whose gate is a producer (nn.producers.gate): the gated
    depthwise output `hidden * silu(gate)` and the row-wise codes of its last 1x1 convolution (conv_point, SANA's
    widest quantize) in one op."""
    residual = hidden_states
    hidden_states = self.nonlinearity(self.conv_inverted(hidden_states))
    hidden_states = self.conv_point(gate(self.nonlinearity, self.conv_depth(hidden_states)))
    if self.norm_type == "rms_norm":  # move channel to the last dimension so we apply RMSnorm across channel dimension
        hidden_states = self.norm(hidden_states.movedim(1, -1)).movedim(-1, 1)
    return hidden_states + residual if self.residual_connection else hidden_states


class GemmaPrompts:
    """SANA's text side and transformer call, shared with SANA-Video (models/sana_video.py): prompts encoded by
    Gemma-2 after the pipeline's complex human instruction, with their mask; the empty negative prompt without it,
    as the pipelines encode a negative prompt; the transformer takes the mask beside the text states."""

    pipe: Any
    device_: torch.device
    dtype: torch.dtype
    transformer: nn.Module
    TEXT_TOKENS: ClassVar[int] = 300  # the pipelines' default max_sequence_length

    def _instruction(self) -> list[str] | None:
        """The complex human instruction the pipeline's __call__ uses by default."""
        param = inspect.signature(type(self.pipe).__call__).parameters.get("complex_human_instruction")
        return None if param is None else param.default

    def _encode(self, prompts: list[str]) -> Conditioning:
        hidden, mask, _, _ = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=self.device_, max_sequence_length=self._text_tokens(),
            complex_human_instruction=self._instruction(),
        )  # fmt: skip
        return Conditioning(hidden.to(self.dtype), None, mask)

    def _encode_negative(self) -> Conditioning:
        """The pipeline's negative prompt "" (its `encode_prompt` encodes a negative without the instruction)."""
        _, _, hidden, mask = self.pipe.encode_prompt(
            [""], do_classifier_free_guidance=True, negative_prompt="", device=self.device_,
            max_sequence_length=self._text_tokens(), complex_human_instruction=self._instruction(),
        )  # fmt: skip
        return Conditioning(hidden.to(self.dtype), None, mask)

    def _text_tokens(self) -> int:
        return int(self.max_sequence_length or self.TEXT_TOKENS)

    def _standin_dims(self) -> tuple[int, int | None]:
        return int(self.transformer.config.caption_channels), None

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        scale = float(getattr(self.transformer.config, "timestep_scale", 1.0))
        out = net(
            x,
            encoder_hidden_states=cond.hidden.to(x.dtype),
            encoder_attention_mask=cond.mask,
            timestep=self.model_timestep(t) * scale,
            return_dict=False,
        )[0]
        if out.shape[1] == 2 * x.shape[1]:  # learned sigma: the first half is the prediction
            out = out[:, : x.shape[1]]
        return out


class SanaModel(GemmaPrompts, PipelineFlowModel):
    MODEL = "sana"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "SanaPipeline"
    TRANSFORMER_CLASS = "SanaTransformer2DModel"
    DEFAULT_RESOLUTION = 1024
    RANDOM_VAE_FACTOR = 32
    FULL_CONFIG: ClassVar[dict[str, Any]] = dict(
        in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
        num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
        mlp_ratio=2.5, sample_size=32, patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6,
    )  # fmt: skip  (SANA-1.6B)
    RANDOM_VAE_CONFIG = ("AutoencoderDC", dict(
        in_channels=3, latent_channels=32, attention_head_dim=32,
        encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
        decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
        encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
        decoder_act_fns="silu", scaling_factor=0.41407,
    ))  # fmt: skip  (mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers, SANA's VAE)

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import DPMSolverMultistepScheduler

        return DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")

    def _shift_override(self, shift: float) -> dict[str, Any]:
        return {"flow_shift": shift}

    def _latent_shape(self) -> tuple[int, ...]:
        side = self.resolution // self.vae_factor
        return (int(self.transformer.config.in_channels), side, side)



SPEC = ModelSpec(
    name="sana",
    adapter="solrl_engine.models.sana:SanaModel",
    pipeline="SanaPipeline",
    default_path="Efficient-Large-Model/Sana_1600M_1024px_diffusers",
    resolution=1024,
    lora_targets=SANA_LORA_TARGETS,
    explore_rule=SANA_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=1.0,
    repeated_blocks=("SanaTransformerBlock",),
    # the blocks modulate their norms inline and the FFN gates its depthwise output inline: the fused forwards make
    # them producers in an 8-bit explore copy
    producers={"transformer_blocks.*.norm1": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
               "transformer_blocks.*.norm2": ("ff.conv_inverted",),
               "transformer_blocks.*.ff.nonlinearity": ("conv_point",)},
    producer_blocks={"SanaTransformerBlock": fused_block_forward, "GLUMBConv": fused_glumbconv_forward},
    text_encoder_params_b={"Gemma-2-2B": 2.61},  # published
    vae_params_b=0.312,
)
