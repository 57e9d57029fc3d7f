"""SANA-Video (text-to-video, linear-attention DiT): `SanaVideoPipeline` with SANA's Gemma-2 text side and the
Wan2.1 VAE, for SANA-Video 2B at 480p as diffusers ships it.

What it shares is taken from the two families it joins: prompts, their mask, the empty negative prompt and the
transformer call are SANA's (models/sana.py: Gemma-2 after the pipeline's complex human instruction, the negative
without it); the clip layout, the seeds and the decode are Wan's (models/wan.py: a clip of F = 4k + 1 frames at
H x W is a latent [16, (F - 1)/4 + 1, H/8, W/8], drawn by a seed as `pipe(latents=...)` takes it, decoded through
the Wan VAE's per-channel means and deviations to [B, F, 3, H, W]). The stock sampler is DPM-Solver++ 2M on flow
sigmas with shift 8 (the solver `dpm2` on the scheduler's own sigmas), the transformer sees floor(1000 sigma), and
guidance is classifier-free at 6.0 against the empty prompt.

The pipeline also accepts SANA's DC-AE and LTX-2's video VAE; SANA-Video is published with the Wan VAE, and only
that one is decoded here (another is refused at load, naming it).

The explore copy takes SANA's rule: the cross-attention key/value projections and the FFN's 1x1 convolutions
(GLUMBTempConv's inverted and point convolutions, quantized as linears over channels); the linear self-attention's
projections stay in BF16, as the paper keeps SANA's. Its depthwise and temporal convolutions are not linears over
channels and stay in BF16 too. On real weights `solrl fidelity --search` measures a wider rule (docs/video.md).
Its norms are modulated per frame (no producer), but its FFN's gate is one, as SANA's: the point convolution's
codes come with the gated depthwise output (`fused_ffn_forward`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from solrl_engine.models import ModelSpec
from solrl_engine.models.sana import SANA_EXPLORE_RULE, SANA_LORA_TARGETS, GemmaPrompts
from solrl_engine.models.wan import WanModel
from solrl_engine.nn.producers import gate

# the published 480p transformer (diffusers' conversion of SANA_Video_2B_480p: 20 blocks of 20 heads x 112,
# GLUMBTempConv FFN x3, patch (1, 2, 2) over the Wan VAE's 8x cells)
SANA_VIDEO_2B: dict[str, Any] = dict(
    in_channels=16, out_channels=16, num_attention_heads=20, attention_head_dim=112, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    mlp_ratio=3.0, attention_bias=False, sample_size=30, patch_size=(1, 2, 2), norm_elementwise_affine=False,
    norm_eps=1e-6, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)  # fmt: skip


def fused_ffn_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers' GLUMBTempConv.forward for an explore copy whose gate is a producer (nn.producers.gate, as SANA's
    GLUMBConv): the gated depthwise output and the row-wise codes of the point convolution in one op; the temporal
    aggregation after it as the stock module computes it."""
    residual = hidden_states
    batch_size, num_frames, height, width, num_channels = hidden_states.shape
    hidden_states = hidden_states.view(batch_size * num_frames, height, width, num_channels).permute(0, 3, 1, 2)
    hidden_states = self.nonlinearity(self.conv_inverted(hidden_states))
    hidden_states = self.conv_point(gate(self.nonlinearity, self.conv_depth(hidden_states)))
    temporal = hidden_states.view(batch_size, num_frames, num_channels, height * width).permute(0, 2, 1, 3)
    hidden_states = temporal + self.conv_temp(temporal)
    hidden_states = hidden_states.permute(0, 2, 3, 1).view(batch_size, num_frames, height, width, num_channels)
    if self.norm_type == "rms_norm":  # move channel to the last dimension so we apply RMSnorm across channel dimension
        hidden_states = self.norm(hidden_states.movedim(1, -1)).movedim(-1, 1)
    return hidden_states + residual if self.residual_connection else hidden_states


class SanaVideoModel(GemmaPrompts, WanModel):
    MODEL = "sana_video"  # its name in solrl_engine.models.MODELS (the config key `model`)
    PIPELINE_CLASS = "SanaVideoPipeline"
    TRANSFORMER_CLASS = "SanaVideoTransformer3DModel"
    TEXT_TOKENS = 300  # SanaVideoPipeline's max_sequence_length
    MAX_SEQUENCE_LENGTH = 300
    FULL_CONFIG: ClassVar[dict[str, Any]] = SANA_VIDEO_2B
    ALIAS_CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {"sana-video-2b": SANA_VIDEO_2B}
    HUB_CONFIGS: ClassVar[dict[str, dict[str, Any]]] = {
        "Efficient-Large-Model/SANA-Video_2B_480p_diffusers": SANA_VIDEO_2B
    }

    def __init__(self, pipe: Any, *args: Any, **kwargs: Any) -> None:
        vae = getattr(pipe, "vae", None)
        if vae is not None and type(vae).__name__ != "AutoencoderKLWan":
            raise ValueError(
                f"this SanaVideoPipeline decodes with a {type(vae).__name__}; the engine decodes SANA-Video through "
                "the Wan2.1 VAE (AutoencoderKLWan) it is published with. Load the published pipeline "
                "(Efficient-Large-Model/SANA-Video_2B_480p_diffusers) or swap its vae for the Wan2.1 one"
            )
        super().__init__(pipe, *args, **kwargs)

    @staticmethod
    def random_vae_factor(arch: dict[str, Any]) -> int:
        return 8  # the Wan2.1 VAE's

    @staticmethod
    def default_scheduler() -> Any:
        from diffusers import DPMSolverMultistepScheduler

        return DPMSolverMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")


SPEC = ModelSpec(
    name="sana_video",
    adapter="solrl_engine.models.sana_video:SanaVideoModel",
    pipeline="SanaVideoPipeline",
    default_path="Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
    resolution=480,
    lora_targets=SANA_LORA_TARGETS,
    explore_rule=SANA_EXPLORE_RULE,
    guidance="cfg",
    guidance_scale=6.0,
    repeated_blocks=("SanaVideoTransformerBlock",),
    # the FFN gates its depthwise output inline: its fused forward makes the gate a producer in an 8-bit copy
    producers={"transformer_blocks.*.ff.nonlinearity": ("conv_point",)},
    producer_blocks={"GLUMBTempConv": fused_ffn_forward},
    video=True,
    # Gemma-2-2B (SANA's) and the Wan2.1 VAE (Wan's), as published
    text_encoder_params_b={"Gemma-2-2B": 2.61},
    vae_params_b=0.127,
)
