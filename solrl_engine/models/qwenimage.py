"""Qwen-Image (20B MMDiT, double-stream blocks only): `QwenImagePipeline` with the Qwen2.5-VL-7B text encoder and
its own 16-channel VAE (a video-style 3-D VAE run on one frame).

Prompts are encoded as `pipe(prompt)` encodes them: the pipeline's chat template around the prompt, the last
hidden states of Qwen2.5-VL, the template's 34 system-prompt tokens dropped (what is left is the prompt and the
assistant suffix), at most `max_sequence_length` tokens (512, `__call__`'s default). The pipeline pads a batch
to its longest prompt and hands the transformer a mask; here each prompt is cached padded to
`max_sequence_length` and a batch is cut back to its own longest prompt, so a batch of equally long prompts has
no padding and no mask, as the pipeline has none for it. diffusers 0.37 and later mask padded text tokens out of
the joint attention, so a padded prompt gives what it gives alone; 0.35 and 0.36 attend to them (the stock
pipeline does the same with its batch) and take the text length for RoPE as `txt_seq_lens`, which the forward
passes there.

Latents are kept unpacked ([16, H/8, W/8]: the noise `QwenImagePipeline.prepare_latents` draws, one frame
dropped) and packed 2x2 into 64-feature tokens inside the forward, as FLUX.1's; the transformer takes the flow
time in [0, 1] (the pipeline divides its timesteps by 1000) and the image grid as `img_shapes`. The schedule is
the pipeline's: sigmas linspace(1, 1/N) under the dynamic shift mu of the image's token count (Qwen-Image's
scheduler: 256 tokens -> 0.5, 8192 -> 0.9, exponential, stretched to end at 0.02; one step, which that scheduler
cannot give, is [1, 0]). Decoding un-normalises with the VAE's per-channel `latents_mean` / `latents_std` and
decodes one frame.

Guidance: the stock pipeline runs true classifier-free guidance (`true_cfg_scale`, 4.0 in the model card, against
a negative prompt) and then rescales the guided velocity of every token to the norm of the conditional one. The
engine's "cfg" is plain classifier-free guidance against the empty prompt, v_u + g (v_c - v_u), without that
rescale: with guidance on, the engine's images are the stock pipeline's with that rescale taken out, not the
stock pipeline's (without guidance they are the stock pipeline's; both tested in tests/test_qwenimage.py).

The explore copy quantizes the per-token linears of the 60 blocks: the attention projections of both streams
(q, k, v, out; add_q/k/v, to_add_out) and both streams' MLPs, 13.6 of the transformer's 20.4B parameters.
Kept in BF16: the image and text input projections (`img_in`, `txt_in`) and the time embedder, which set every
token's starting point; each block's adaLN modulations (`img_mod`, `txt_mod`, 6.8B parameters) and `norm_out`,
which run once per step on one vector per image (no GEMM to speed up) and whose error shifts every token of a
stream at once; and the final `proj_out`. That is FLUX.1's rule in Qwen-Image's names (FLUX's embedders and
modulations carry names the recipe's default skips already match; these do not, hence the include patterns).
INT8 explores with the same rule: it already holds every per-token linear, and the wider "every eligible layer"
INT8 rule of the other families would only add the embedders and modulations.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning
from solrl_engine.models.pipeline import JOINT_ATTENTION_LORA_TARGETS, PackedLatentFlowModel
from solrl_engine.nn.producers import modulate

QWEN_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS
QWEN_EXPLORE_RULE: dict[str, Any] = {
    "include": ("transformer_blocks.*.attn.*", "transformer_blocks.*.img_mlp.*", "transformer_blocks.*.txt_mlp.*")
}
QWEN_BLOCKS = ("QwenImageTransformerBlock",)


def _modulated(norm: nn.Module, x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's `_modulate(norm(x), params)` without an index, through `modulate`: (y, gate)."""
    shift, scale, gate = params.chunk(3, dim=-1)
    return modulate(norm, x, scale.unsqueeze(1), shift.unsqueeze(1)), gate.unsqueeze(1)


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        encoder_hidden_states_mask: torch.Tensor, temb: torch.Tensor,
                        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                        joint_attention_kwargs: dict[str, Any] | None = None,
                        modulate_index: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """diffusers' QwenImageTransformerBlock.forward for an explore copy whose norms are producers (nn.producers):
    each stream's two norms and their modulation go through `modulate`, so they carry the codes of the joint
    attention's projections and of each MLP's first linear. A per-token modulation (`modulate_index`, the
    zero-conditioned edit models) runs the stock forward."""
    if modulate_index is not None:
        return super(type(self), self).forward(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                                               image_rotary_emb, joint_attention_kwargs, modulate_index)  # fmt: skip
    img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = self.txt_mod(torch.chunk(temb, 2, dim=0)[0] if self.zero_cond_t else temb).chunk(2, dim=-1)
    img, img_gate1 = _modulated(self.img_norm1, hidden_states, img_mod1)
    txt, txt_gate1 = _modulated(self.txt_norm1, encoder_hidden_states, txt_mod1)
    img_attn, txt_attn = self.attn(hidden_states=img, encoder_hidden_states=txt,
                                   encoder_hidden_states_mask=encoder_hidden_states_mask,
                                   image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))  # fmt: skip
    hidden_states = hidden_states + img_gate1 * img_attn
    encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn
    img, img_gate2 = _modulated(self.img_norm2, hidden_states, img_mod2)
    hidden_states = hidden_states + img_gate2 * self.img_mlp(img)
    txt, txt_gate2 = _modulated(self.txt_norm2, encoder_hidden_states, txt_mod2)
    encoder_hidden_states = encoder_hidden_states + txt_gate2 * self.txt_mlp(txt)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# each block's four norms (modulated inline: fused_block_forward) feed these linears
QWEN_PRODUCERS = {
    "transformer_blocks.*.img_norm1": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "transformer_blocks.*.txt_norm1": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "transformer_blocks.*.img_norm2": ("img_mlp.net.0.proj",),
    "transformer_blocks.*.txt_norm2": ("txt_mlp.net.0.proj",),
    # each MLP's GELU module (its first linear and the activation) feeds its second linear (net.2)
    "transformer_blocks.*.img_mlp.net.0": ("2",),
    "transformer_blocks.*.txt_mlp.net.0": ("2",),
}


class QwenImageModel(PackedLatentFlowModel):
    MODEL = "qwenimage"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "QwenImagePipeline"
    TRANSFORMER_CLASS = "QwenImageTransformer2DModel"
    DEFAULT_RESOLUTION = 1024  # the pipeline's default size (default_sample_size 128 x the VAE's 8)
    MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default
    TEXT_TOKENS = 128  # stand-in text length for "random": a batch's longest prompt, with the 5 suffix tokens
    RANDOM_VAE_FACTOR = 8
    # Qwen/Qwen-Image's transformer/config.json (diffusers' defaults for the class): 20,430,401,088 parameters
    FULL_CONFIG: ClassVar[dict[str, Any]] = dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
    )  # fmt: skip

    def __init__(self, pipe: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(pipe, *args, **kwargs)
        # diffusers 0.35 / 0.36: RoPE takes the text lengths (`txt_seq_lens`, deprecated from 0.37, which reads the
        # length off the text states as `max_txt_seq_len`) and the mask is not applied in attention
        rope = getattr(self.transformer, "pos_embed", None)
        params = inspect.signature(type(rope).forward).parameters if rope is not None else {}
        self._txt_seq_lens = "txt_seq_lens" in params and "max_txt_seq_len" not in params

    @staticmethod
    def default_scheduler() -> Any:
        """Qwen/Qwen-Image's scheduler_config.json."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        )  # fmt: skip

    def _standin_dims(self) -> tuple[int, int | None]:
        return int(self.transformer.config.joint_attention_dim), None

    def sigmas(self, steps: int, shift: float | None = None) -> torch.Tensor:
        """The pipeline's scheduler's sigmas; one step is [1, 0]. Qwen-Image's scheduler has no 1-step schedule: it
        stretches the sigmas so the last one lands on shift_terminal (0.02), which for the single sigma 1.0 divides
        zero by zero (the stock pipeline draws NaN at num_inference_steps=1). Every time shift keeps 1 at 1, so the
        one step goes from noise straight to the image (the engine's probes sample one step)."""
        if steps == 1 and self.pipe.scheduler.config.get("shift_terminal"):
            return torch.tensor([1.0, 0.0])
        return super().sigmas(steps, shift)

    # --- prompts ------------------------------------------------------------------------------------

    def _encode(self, prompts: list[str]) -> Conditioning:
        """The pipeline's own encode_prompt, each prompt zero-padded to `max_sequence_length` with its mask, so
        prompts of any length share one cache (encode_prompts cuts a batch back to its longest prompt)."""
        hidden, mask = self.pipe.encode_prompt(prompts, device=self.device_,
                                               max_sequence_length=self.max_sequence_length)  # fmt: skip
        b, n, d = hidden.shape
        if mask is None:  # every prompt as long as the longest: the pipeline drops the all-ones mask
            mask = torch.ones(b, n, dtype=torch.long, device=hidden.device)
        full = hidden.new_zeros(b, self.max_sequence_length, d)
        full[:, :n] = hidden
        keep = mask.new_zeros(b, self.max_sequence_length)
        keep[:, :n] = mask
        return Conditioning(full.to(self.dtype), None, keep)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Per-prompt conditioning (cached), cut to the batch's longest prompt as the pipeline pads a batch; no
        mask where no prompt of the batch is padded (the pipeline passes none then either)."""
        cond = super().encode_prompts(prompts)
        if cond.mask is None:  # (_encode and the stand-in always give one)
            return cond
        n = int(cond.mask.sum(1).max())
        mask = cond.mask[:, :n]
        return dataclasses.replace(cond, hidden=cond.hidden[:, :n], mask=None if bool(mask.all()) else mask)

    # --- the transformer ----------------------------------------------------------------------------

    def _forward(self, net: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        b, c, h, w = x.shape
        extra: dict[str, Any] = {}
        if self._txt_seq_lens:
            extra["txt_seq_lens"] = [cond.hidden.shape[1]] * b
        tokens, shapes = self._image_tokens(x, cond)
        out = net(
            hidden_states=tokens,
            # the pipeline's timestep: 1000 sigma in the latents' dtype, then / 1000 (the model scales it back)
            timestep=self.model_timestep(t, 1000.0).to(x.dtype) / 1000,
            encoder_hidden_states=cond.hidden.to(x.dtype),
            encoder_hidden_states_mask=cond.mask,
            img_shapes=[shapes] * b,
            return_dict=False,
            **extra,
        )[0]
        return self.unpack(out[:, : (h // 2) * (w // 2)], x.shape)  # the latent's tokens (an edit's come first)

    def _image_tokens(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The packed image tokens the transformer reads and the grid of each image among them (`img_shapes`, which
        places their RoPE): the latent's alone here; an edit appends its source's (Qwen-Image-Edit)."""
        _, _, h, w = x.shape
        return self.pipeline_latents(x), [(1, h // 2, w // 2)]

    def _decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Un-normalised per channel as the pipeline does it (x / (1 / std) + mean, in the VAE's dtype), decoded as
        a one-frame video: [B, 3, H, W] in [-1, 1]."""
        vae = self.pipe.vae
        view = (1, vae.config.z_dim, 1, 1, 1)
        z = x.to(vae.dtype).unsqueeze(2)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(x.device, vae.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(x.device, vae.dtype)
        return vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]


SPEC = ModelSpec(
    name="qwenimage",
    adapter="solrl_engine.models.qwenimage:QwenImageModel",
    pipeline="QwenImagePipeline",
    default_path="Qwen/Qwen-Image",
    resolution=1024,
    lora_targets=QWEN_LORA_TARGETS,
    explore_rule=QWEN_EXPLORE_RULE,
    explore_rule_by_format={},  # INT8 too: the rule already holds every per-token linear (module docstring)
    guidance="cfg",  # plain CFG against "": the pipeline's true CFG without its norm rescale (module docstring)
    guidance_scale=4.0,
    repeated_blocks=QWEN_BLOCKS,
    producers=QWEN_PRODUCERS,
    producer_blocks={"QwenImageTransformerBlock": fused_block_forward},
    # the whole Qwen2.5-VL-7B (vision tower and LM head included) and the VAE, as published and as counted on
    # the meta device (bench/memory.py)
    text_encoder_params_b={"Qwen2.5-VL-7B": 8.29},
    vae_params_b=0.127,
)
