"""FLUX.2 [klein] (MMDiT with single-stream blocks): `Flux2KleinPipeline` with a Qwen3 text encoder and FLUX.2's
32-channel VAE, for black-forest-labs/FLUX.2-klein-base-4B (the undistilled model, guidance 4.0 over 50 steps; the
9B and the 4-step distilled variants load the same way).

Prompts are encoded as `pipe(prompt)` encodes them: Qwen3's chat template (thinking off), padded to 512 tokens, the
hidden states of layers 9, 18 and 27 side by side (3 x the encoder's width a token); no mask reaches the
transformer, which attends to the padding as the pipeline's does. The transformer takes text ids (0, 0, 0, l) and
image ids (0, h, w, 0), built on the device here.

Latents: the pipeline draws its noise already patched, [128, H/16, W/16] (the VAE's 32 channels, 2x2 cells
folded into channels), and packs it into one token per cell; a seed here is that tensor, and the forward packs and
unpacks it. The transformer takes the flow time (the pipeline's timestep / 1000) and predicts the velocity. The
schedule is the pipeline's: sigmas linspace(1, 1/N) under FLUX.2's empirical shift mu of the token count and the
step count. Decoding undoes the VAE's batch-norm statistics, unpatches the 2x2 cells and decodes.

Guidance: the base models' classifier-free guidance against the empty prompt, as the engine's (`pipe(prompt,
guidance_scale=g)` is the engine's g). A distilled pipeline (`is_distilled`) ignores guidance; run it at 1.0.

The explore copy quantizes the per-token linears of the double- and single-stream blocks: both streams' attention
projections and MLPs, each single block's fused qkv-MLP projection and its output. The modulations (shared by all
blocks, one vector per image), the embedders, `norm_out` and `proj_out` stay in BF16.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.pipeline import JOINT_ATTENTION_LORA_TARGETS, PackedLatentFlowModel
from solrl_engine.nn.producers import gate, modulate

FLUX2_LORA_TARGETS = (*JOINT_ATTENTION_LORA_TARGETS, "attn.to_qkv_mlp_proj")
FLUX2_EXPLORE_RULE: dict[str, Any] = {"include": ("transformer_blocks.*", "single_transformer_blocks.*")}


def _split(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, ...]]:
    """diffusers' Flux2Modulation.split: `sets` (shift, scale, gate) triples of [B, 1, dim]."""
    parts = torch.chunk(mod.unsqueeze(1) if mod.ndim == 2 else mod, 3 * sets, dim=-1)
    return [parts[3 * i : 3 * i + 3] for i in range(sets)]


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        temb_mod_img: torch.Tensor, temb_mod_txt: torch.Tensor,
                        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                        joint_attention_kwargs: dict[str, Any] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """diffusers' Flux2TransformerBlock.forward for an explore copy whose norms are producers (nn.producers): its
    four norms, modulated inline, go through `modulate`, so they carry the codes of the joint attention's
    projections and of each stream's first FFN linear."""
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = _split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _split(temb_mod_txt, 2)
    attn_output, context_attn_output = self.attn(
        hidden_states=modulate(self.norm1, hidden_states, scale_msa, shift_msa),
        encoder_hidden_states=modulate(self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa),
        image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))  # fmt: skip
    hidden_states = hidden_states + gate_msa * attn_output
    hidden_states = hidden_states + gate_mlp * self.ff(modulate(self.norm2, hidden_states, scale_mlp, shift_mlp))
    encoder_hidden_states = encoder_hidden_states + c_gate_msa * context_attn_output
    y = modulate(self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp * self.ff_context(y)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def fused_single_block_forward(self: nn.Module, hidden_states: torch.Tensor,
                               encoder_hidden_states: torch.Tensor | None, temb_mod: torch.Tensor,
                               image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                               joint_attention_kwargs: dict[str, Any] | None = None, split_hidden_states: bool = False,
                               text_seq_len: int | None = None) -> Any:  # fmt: skip
    """diffusers' Flux2SingleTransformerBlock.forward with its norm and modulation through `modulate`: the codes of
    the parallel block's fused QKV and MLP-in projection."""
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    mod_shift, mod_scale, mod_gate = _split(temb_mod, 1)[0]
    attn_output = self.attn(hidden_states=modulate(self.norm, hidden_states, mod_scale, mod_shift),
                            image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))  # fmt: skip
    hidden_states = hidden_states + mod_gate * attn_output
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def fused_ff_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' Flux2FeedForward.forward with its SwiGLU through `gate`: the activation and the codes of
    `linear_out` (3x the hidden size a row, a double block's widest quantize) in one op."""
    return self.linear_out(gate(self.act_fn, self.linear_in(x), dim=-1, gate_first=True))


def fused_parallel_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                                     attention_mask: torch.Tensor | None = None,
                                     image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                                     **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """diffusers' Flux2ParallelSelfAttention with its stock processor (Flux2ParallelSelfAttnProcessor), restated so
    the MLP's SwiGLU and its join after the attention's output go through `gate` with that output as the prefix:
    the activation, the join and the codes of `to_out` (the widest quantize of a single block) in one op. Another
    processor (a KV-cached one), or extra keyword arguments, run the stock forward."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttnProcessor

    proc = self.processor
    if type(proc) is not Flux2ParallelSelfAttnProcessor or kwargs:
        return super(type(self), self).forward(hidden_states, attention_mask, image_rotary_emb, **kwargs)
    hidden_states = self.to_qkv_mlp_proj(hidden_states)
    qkv, mlp_hidden_states = torch.split(
        hidden_states, [3 * self.inner_dim, self.mlp_hidden_dim * self.mlp_mult_factor], dim=-1)  # fmt: skip
    query, key, value = (t.unflatten(-1, (self.heads, -1)) for t in qkv.chunk(3, dim=-1))
    query, key = self.norm_q(query), self.norm_k(key)
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask,
                                          backend=proc._attention_backend, parallel_config=proc._parallel_config)
    hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
    return self.to_out(gate(self.mlp_act_fn, mlp_hidden_states, dim=-1, gate_first=True, prefix=hidden_states))


class Flux2KleinModel(PackedLatentFlowModel):
    MODEL = "flux2"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "Flux2KleinPipeline"
    TRANSFORMER_CLASS = "Flux2Transformer2DModel"
    DEFAULT_RESOLUTION = 1024  # the pipeline's default size (default_sample_size 128 x the VAE's 8)
    MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline.__call__'s default
    TEXT_TOKENS = 512
    RANDOM_VAE_FACTOR = 8
    # FLUX.2-klein-base-4B's transformer (Black Forest Labs' Klein4BParams in diffusers' names): 5 double- and 20
    # single-stream blocks, 24 heads of 128, text width 7680 (3 x Qwen3-4B's 2560)
    FULL_CONFIG: ClassVar[dict[str, Any]] = dict(
        patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False,
    )  # fmt: skip

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)

    @property
    def tokens_per_sample(self) -> int:
        """One token per latent cell (the cells are patched already)."""
        return math.prod(self.latent_shape[1:])

    def _latent_shape(self) -> tuple[int, ...]:
        side = self.resolution // self.vae_factor
        return (int(self.transformer.config.in_channels), side, side)

    def _timestep_kwargs(self, steps: int, sched: Any) -> dict[str, Any]:
        import numpy as np
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        flow = getattr(sched.config, "use_flow_sigmas", False)
        kw: dict[str, Any] = {"sigmas": None if flow else np.linspace(1.0, 1 / steps, steps)}
        kw["mu"] = compute_empirical_mu(image_seq_len=self.tokens_per_sample, num_steps=steps)
        if flow:
            kw["num_inference_steps"] = steps
        return kw

    def pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the pipeline's `latents=` takes the patched [B, 128, H/16, W/16] and packs it itself

    def _standin_dims(self) -> tuple[int, int | None]:
        return int(self.transformer.config.joint_attention_dim), None

    def _encode(self, prompts: list[str]) -> Conditioning:
        hidden, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device_,
                                            max_sequence_length=self.max_sequence_length)  # fmt: skip
        return Conditioning(hidden.to(self.dtype))

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = x.reshape(b, c, h * w).permute(0, 2, 1)  # the pipeline's _pack_latents
        img_ids = torch.zeros(h, w, 4, device=x.device, dtype=torch.long)
        img_ids[..., 1] = torch.arange(h, device=x.device)[:, None]
        img_ids[..., 2] = torch.arange(w, device=x.device)[None, :]
        txt_ids = torch.zeros(cond.hidden.shape[1], 4, device=x.device, dtype=torch.long)
        txt_ids[:, 3] = torch.arange(cond.hidden.shape[1], device=x.device)
        out = net(
            hidden_states=tokens,
            timestep=self.model_timestep(t, 1000.0).to(x.dtype) / 1000,  # the pipeline's, in the latents' dtype
            guidance=None,
            encoder_hidden_states=cond.hidden.to(x.dtype),
            txt_ids=txt_ids,
            img_ids=img_ids.reshape(-1, 4),
            return_dict=False,
        )[0]
        return out[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    def _decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """The VAE's batch-norm statistics undone, the 2x2 cells unpatched, decoded: [B, 3, H, W] in [-1, 1]."""
        vae = self.pipe.vae
        z = x.to(vae.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = z * std + mean
        b, c, h, w = z.shape
        z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, 2 * h, 2 * w)
        return vae.decode(z, return_dict=False)[0]


SPEC = ModelSpec(
    name="flux2",
    adapter="solrl_engine.models.flux2:Flux2KleinModel",
    pipeline="Flux2KleinPipeline",
    default_path="black-forest-labs/FLUX.2-klein-base-4B",
    resolution=1024,
    lora_targets=FLUX2_LORA_TARGETS,
    explore_rule=FLUX2_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=4.0,
    repeated_blocks=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
    # every norm modulates inline, every SwiGLU is applied inline: the fused forwards above make them producers in
    # an 8-bit explore copy
    producers={
        "transformer_blocks.*.norm1": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "transformer_blocks.*.norm1_context": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        "transformer_blocks.*.norm2": ("ff.linear_in",),
        "transformer_blocks.*.norm2_context": ("ff_context.linear_in",),
        "single_transformer_blocks.*.norm": ("attn.to_qkv_mlp_proj",),
        # the SwiGLUs: each FFN's, and the single block's MLP joined after its attention's output
        "transformer_blocks.*.ff.act_fn": ("linear_out",),
        "transformer_blocks.*.ff_context.act_fn": ("linear_out",),
        "single_transformer_blocks.*.attn.mlp_act_fn": ("to_out",),
    },
    producer_blocks={"Flux2TransformerBlock": fused_block_forward,
                     "Flux2SingleTransformerBlock": fused_single_block_forward,
                     "Flux2FeedForward": fused_ff_forward,
                     "Flux2ParallelSelfAttention": fused_parallel_attention_forward},
    text_encoder_params_b={"Qwen3-4B": 4.02},
    vae_params_b=0.084,
)
