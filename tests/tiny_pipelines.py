"""Test support: tiny random-weight pipelines of the real diffusers classes, built offline and saved
with save_pretrained, so the engine loads them through `DiffusionPipeline.from_pretrained` exactly
as it loads a user's SD3.5 / FLUX.1 / SANA weights.

Each pipeline keeps its family's real structure at toy widths: the same component classes and
model_index.json, the same text-encoder wiring (SD3: CLIP-L + CLIP-G with projections + T5, the CLIP
states zero-padded to the T5 width; FLUX: CLIP-L pooled + T5 tokens; SANA: Gemma-2 with an attention
mask), the real latent channel counts (16 / 16 / 32), the real VAE factors (8 / 8 / 32), the real
VAE scaling/shift factors and the real schedulers. Widths differ between encoders on purpose, so a
swapped dimension fails loudly instead of passing by coincidence.

Sizes (`SIZES`, `VAE_FACTOR`, `LATENT_SHAPES`): SD3, FLUX and Qwen-Image draw 64 px (8x8 latents of 16
channels; FLUX and Qwen-Image pack them 2x2 into 16 tokens of 64 features), SANA draws 128 px (DC-AE
factor 32: 4x4 latents of 32 channels).

Text: CLIP keeps its 77 positions (SD3 / FLUX pad CLIP to `tokenizer.model_max_length`). The T5
tokenizers say `model_max_length = MAX_SEQUENCE_LENGTH[...]` (32); the pipelines still pad T5 to
their own `max_sequence_length` argument (defaults 256 for SD3, 512 for FLUX), which works too
(T5 has relative positions) but is slower, so tests pass `max_sequence_length=MAX_SEQUENCE_LENGTH`.
SANA's `__call__` prepends its long `complex_human_instruction` (about 1.6k tokens with this
character-level vocabulary) and counts it with an untruncated encode, so the Gemma tokenizer keeps
the encoder's 8192 positions as its `model_max_length`; the prompt budget is `max_sequence_length`.

Tokenizers are built with the `tokenizers` library through transformers' own classes, no files
downloaded: CLIP a byte-level BPE over the 256 bytes and their </w> forms (tests/tiny_clip.py), T5
a Unigram model, Gemma a BPE with byte fallback, Qwen2 a byte-level BPE whose merges spell Qwen-Image's
system prompt in the 34 tokens the real tokenizer gives it. transformers 5 saves them as `CLIPTokenizer`,
`T5Tokenizer`, `GemmaTokenizer` and `Qwen2Tokenizer` in model_index.json (the real repos say
...TokenizerFast); both load under `DiffusionPipeline.from_pretrained`.
"""

from __future__ import annotations

import contextlib
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_clip import build_clip_reward, clip_tokenizer

# image (video: frame) side in pixels
SIZES = {"sd3": 64, "flux": 64, "sana": 128, "wan": 64, "qwenimage": 64, "sana_video": 64, "z_image": 64, "flux2": 64}
# pixels per latent cell (FLUX and Qwen-Image pack 2x2 cells on top)
VAE_FACTOR = {"sd3": 8, "flux": 8, "sana": 32, "wan": 8, "qwenimage": 8, "sana_video": 8, "z_image": 8, "flux2": 16}
LATENT_CHANNELS = {"sd3": 16, "flux": 16, "sana": 32, "wan": 16, "qwenimage": 16, "sana_video": 16, "z_image": 16,
                   "flux2": 128}  # FLUX.2: the VAE's 32 channels with 2x2 cells folded in
LATENT_SHAPES = {k: (LATENT_CHANNELS[k], SIZES[k] // VAE_FACTOR[k], SIZES[k] // VAE_FACTOR[k]) for k in SIZES}
WAN_FRAMES = 9  # frames per tiny clip: 3 latent frames (the first, then 4 per latent frame)
LATENT_SHAPES["wan"] = LATENT_SHAPES["sana_video"] = (16, 3, 8, 8)
# T5 / Gemma / UMT5 tokens (max_sequence_length)
MAX_SEQUENCE_LENGTH = {"sd3": 32, "flux": 32, "sana": 32, "wan": 32, "sana_video": 32, "z_image": 32, "flux2": 32}
CLIP_TOKENS = 77  # CLIP's positions and tokenizer length, as the real CLIP-L / CLIP-G

__all__ = [
    "CLIP_TOKENS",
    "LATENT_CHANNELS",
    "LATENT_SHAPES",
    "MAX_SEQUENCE_LENGTH",
    "SIZES",
    "VAE_FACTOR",
    "build_clip_reward",
    "build_flux",
    "build_flux2",
    "build_flux_kontext",
    "build_qwenimage",
    "build_qwenimage_edit",
    "qwen_vl_processor",
    "build_sana",
    "build_sana_video",
    "build_sd3",
    "build_wan",
    "build_wan_i2v",
    "build_z_image",
]

_WORDS = ("a", "an", "the", "of", "on", "in", "with", "and", "red", "blue", "green", "apple", "car", "cat", "dog",
          "cup", "photo", "image", "prompt", "user")  # fmt: skip


def _t5(d_model: int, max_length: int, umt5: bool = False) -> tuple[Any, Any]:
    """A T5 encoder (gated-GELU FFN and relative positions, as T5 v1.1-XXL; `umt5`: the UMT5 classes Wan uses)
    and a Unigram T5Tokenizer: <pad>=0, </s>=1, <unk>=2 as T5's sentencepiece model, every printable ASCII
    character (so prompts rarely fall to <unk>), whole-word pieces that win on score, and 4 sentinel extra ids."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer, UMT5Config, UMT5EncoderModel

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [(c, -6.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + w, -2.0) for w in _WORDS] + [("ing", -3.0), ("ed", -3.0), ("er", -3.0)]
    tok = T5Tokenizer(vocab=pieces, extra_ids=4, model_max_length=max_length)
    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    cfg = config_cls(vocab_size=len(tok), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
                     feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                     relative_attention_max_distance=32, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     decoder_start_token_id=tok.pad_token_id)  # fmt: skip
    return model_cls(cfg).eval(), tok


def _clip_text(hidden: int, projection: bool, act: str = "quick_gelu") -> tuple[Any, Any]:
    """A CLIP text encoder (with or without the projection head) and its byte-level BPE tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok = clip_tokenizer(CLIP_TOKENS)
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=CLIP_TOKENS, projection_dim=hidden,
                         hidden_act=act, **ids)  # fmt: skip
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(cfg).eval(), tok


def _vae_kl(latent_channels: int, scaling: float, shift: float) -> Any:
    """An AutoencoderKL with 4 blocks (3 downsamples: factor 8) and no quant convs, as SD3's and FLUX's."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, sample_size=64,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4,
        scaling_factor=scaling, shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip


def _save(pipe: Any, path: str | Path) -> Path:
    path = Path(path)
    pipe.save_pretrained(path)
    return path


def build_sd3(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny StableDiffusion3Pipeline (SD3.5-Large layout) into `path`.

    CLIP-L (16 wide) + CLIP-G (32 wide), both with projections: pooled 16 + 32 = 48; their penultimate
    states concatenated (48) and zero-padded to T5's 64, then T5's 32 tokens appended: 77 + 32 = 109
    text tokens of 64 features. MMDiT with 2 joint blocks, 2 heads of 16, qk RMSNorm, patch 2 over
    16 x 8 x 8 latents; VAE factors 1.5305 / 0.0609 and FlowMatchEuler shift 3, as SD3.5.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    te1, tok1 = _clip_text(16, projection=True)
    te2, tok2 = _clip_text(32, projection=True, act="gelu")
    te3, tok3 = _t5(64, MAX_SEQUENCE_LENGTH["sd3"])
    side = SIZES["sd3"] // VAE_FACTOR["sd3"]  # pos_embed_max_size 2 * side patches: up to 4 * 64 = 256 px
    transformer = SD3Transformer2DModel(
        sample_size=side, patch_size=2, in_channels=LATENT_CHANNELS["sd3"], out_channels=LATENT_CHANNELS["sd3"],
        num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
        caption_projection_dim=32, pooled_projection_dim=16 + 32, pos_embed_max_size=2 * side, qk_norm="rms_norm",
    )  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae_kl(LATENT_CHANNELS["sd3"], 1.5305, 0.0609), text_encoder=te1, tokenizer=tok1,
        text_encoder_2=te2, tokenizer_2=tok2, text_encoder_3=te3, tokenizer_3=tok3,
    )  # fmt: skip
    return _save(pipe, path)


def build_flux(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny FluxPipeline (FLUX.1-dev layout) into `path`.

    CLIP-L (16 wide, no projection: FLUX pools `pooler_output`) + T5 (32 wide, 32 tokens). 2 double-
    and 2 single-stream blocks, 2 heads of 16 with RoPE axes (4, 6, 6), distilled guidance embedding;
    16 latent channels packed 2x2 into 64 features; VAE factors 0.3611 / 0.1159 and the dynamic-shift
    FlowMatchEuler scheduler of FLUX.1-dev (mu from the image token count, 256 -> 0.5, 4096 -> 1.15).
    """
    from diffusers import FluxPipeline

    return _save(FluxPipeline(**_flux_parts(seed)), path)


def build_flux_kontext(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny FluxKontextPipeline (FLUX.1-Kontext-dev layout: FLUX.1-dev's parts, build_flux's) into `path`."""
    from diffusers import FluxKontextPipeline

    return _save(FluxKontextPipeline(**_flux_parts(seed)), path)


def _flux_parts(seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    torch.manual_seed(seed)
    te1, tok1 = _clip_text(16, projection=False)
    te2, tok2 = _t5(32, MAX_SEQUENCE_LENGTH["flux"])
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS["flux"], num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip
    return dict(
        scheduler=scheduler, vae=_vae_kl(LATENT_CHANNELS["flux"], 0.3611, 0.1159), text_encoder=te1,
        tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2, transformer=transformer,
    )  # fmt: skip


def _gemma(hidden: int) -> tuple[Any, Any]:
    """A Gemma-2 encoder (grouped KV heads, alternating sliding/global layers, logit soft-capping)
    and a GemmaTokenizer: BPE over single characters with a few merges and byte fallback for the
    rest (newlines and non-ASCII become <0x..> pieces), ids <pad>=0 <eos>=1 <bos>=2 <unk>=3
    <mask>=4 as Gemma's. It prepends <bos> as Gemma's does (transformers 5's GemmaTokenizer adds
    none unless `add_bos_token=True` is passed, whatever its docstring says)."""
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for c in "\u2581" + string.ascii_letters + string.digits + string.punctuation:
        vocab[c] = len(vocab)
    merges = [("\u2581", "a"), ("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("r", "e"), ("e", "d"), ("i", "n")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=8192, add_bos_token=True)  # False unless told
    cfg = Gemma2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                       max_position_embeddings=8192, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)  # fmt: skip
    return Gemma2Model(cfg).eval(), tok


def _dc_ae(latent_channels: int) -> Any:
    """An AutoencoderDC with SANA's DC-AE layout at toy width: 6 stages (5 downsamples: factor 32),
    ResBlocks then EfficientViT (linear attention) blocks, strided-conv down / interpolate up,
    batch-norm/ReLU then RMSNorm/SiLU in the decoder, scaling factor 0.41407."""
    from diffusers import AutoencoderDC

    res, vit = ("ResBlock",) * 3, ("EfficientViTBlock",) * 3
    return AutoencoderDC(
        in_channels=3, latent_channels=latent_channels, attention_head_dim=8, encoder_block_types=res + vit,
        decoder_block_types=res + vit, encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
        decoder_block_out_channels=(8, 8, 16, 16, 32, 32), encoder_layers_per_block=(1,) * 6,
        decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 3 + ((5,),) * 3,
        decoder_qkv_multiscales=((),) * 3 + ((5,),) * 3, upsample_block_type="interpolate",
        downsample_block_type="Conv", decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3,
        decoder_act_fns=("relu",) * 3 + ("silu",) * 3, scaling_factor=0.41407,
    ).eval()  # fmt: skip


def build_sana(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny SanaPipeline (SANA-1600M-1024px layout) into `path`.

    Gemma-2 (48 wide) states with their mask; a SANA transformer of 2 blocks, 2 heads of 16 (linear
    self-attention, cross-attention 2 x 16) whose FFN is GLUMBConv (1x1 convolutions around a
    depthwise 3x3; inner width 32 so they pass the quantizer's min_dim), patch 1 over 32 x 4 x 4
    latents; the 32x DC-AE; and the scheduler SANA ships with: DPMSolverMultistepScheduler
    (DPM-Solver++ 2M) on flow sigmas, flow_prediction, flow_shift 3.

    `SanaPipeline.__call__` bins the size to its aspect-ratio table unless `use_resolution_binning=
    False`, and prepends `complex_human_instruction` unless that is None; `encode_prompt` defaults
    to None.
    """
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    torch.manual_seed(seed)
    te, tok = _gemma(48)
    transformer = SanaTransformer2DModel(
        in_channels=LATENT_CHANNELS["sana"], out_channels=LATENT_CHANNELS["sana"], num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
        cross_attention_dim=32, caption_channels=48, mlp_ratio=2.5, sample_size=SIZES["sana"] // VAE_FACTOR["sana"],
        patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6,
    )  # fmt: skip
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    pipe = SanaPipeline(tokenizer=tok, text_encoder=te, vae=_dc_ae(LATENT_CHANNELS["sana"]), transformer=transformer,
                        scheduler=scheduler)  # fmt: skip
    return _save(pipe, path)


def _wan_vae(seed: int) -> Any:
    """The Wan2.1 VAE's layout at toy width (x8 spatial, x4 temporal, causal 3-D convolutions) with non-trivial
    per-channel latent means and deviations, so a decode that skips them differs."""
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(seed)
    mean = (torch.randn(16, generator=g) * 0.5).tolist()
    std = (torch.rand(16, generator=g) + 0.5).tolist()
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, latents_mean=mean,
                            latents_std=std, temperal_downsample=[False, True, True]).eval()  # fmt: skip


def build_wan(path: str | Path, seed: int = 0, two_experts: bool = False) -> Path:
    """Save a tiny WanPipeline (Wan2.1-T2V layout; `two_experts`: Wan2.2-T2V-A14B's, a second transformer of its own
    random weights switched in at boundary_ratio 0.875) into `path`.

    A UMT5 encoder (32 wide); a Wan transformer of 2 blocks, 2 heads of 16 (rope splits 8 / 4 / 4 over time,
    height, width), FFN 64, patch (1, 2, 2) over 16 x 3 x 8 x 8 latents (64 px, 9 frames: 48 tokens); the Wan
    VAE (x8 spatial, x4 temporal, causal 3-D convolutions) with non-trivial per-channel latent means and
    deviations, so a decode that skips them differs; and the scheduler Wan ships with: UniPC (bh2, order 2) on
    flow sigmas, flow_prediction, flow_shift 3.
    """
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    te, tok = _t5(32, MAX_SEQUENCE_LENGTH["wan"], umt5=True)
    vae = _wan_vae(seed + 1)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64,
                                        num_layers=2, rope_max_seq_len=32)  # fmt: skip
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    experts = {}
    if two_experts:  # Wan2.2-A14B's layout: a low-noise expert of the same architecture, switched at 0.875 x 1000
        experts = dict(transformer_2=WanTransformer3DModel.from_config(transformer.config), boundary_ratio=0.875)
    pipe = WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer, scheduler=scheduler,
                       **experts)  # fmt: skip
    return _save(pipe, path)


def build_sana_video(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny SanaVideoPipeline (SANA-Video 2B 480p layout) into `path`.

    Gemma-2 (48 wide) states with their mask; a SANA-Video transformer of 2 blocks, 2 heads of 16 (linear
    self-attention with Wan's 3-D rope, cross-attention 2 x 16, RMS q/k norms), GLUMBTempConv FFN x3 (1x1
    convolutions around a depthwise 3x3, then a temporal (3, 1) convolution), patch (1, 2, 2) over 16 x 3 x 8 x 8
    latents (64 px, 9 frames: 48 tokens); the Wan2.1 VAE as in build_wan; and the scheduler SANA-Video ships
    with: DPMSolverMultistepScheduler (DPM-Solver++ 2M) on flow sigmas, flow_prediction, flow_shift 8. Its
    sample_size is the published 30 (the pipeline's resolution binning takes 30 or 22 only).
    """
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline, SanaVideoTransformer3DModel

    torch.manual_seed(seed)
    te, tok = _gemma(48)
    transformer = SanaVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=48,
        mlp_ratio=3.0, sample_size=30, patch_size=(1, 2, 2), norm_elementwise_affine=False, norm_eps=1e-6,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    scheduler = DPMSolverMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    pipe = SanaVideoPipeline(tokenizer=tok, text_encoder=te, vae=_wan_vae(seed + 1), transformer=transformer,
                             scheduler=scheduler)  # fmt: skip
    return _save(pipe, path)


def build_wan_i2v(path: str | Path, seed: int = 0, two_experts: bool = False) -> Path:
    """Save a tiny WanImageToVideoPipeline (Wan2.1-I2V-14B layout) into `path`: build_wan's UMT5, VAE and UniPC;
    a CLIP vision tower (16 wide, 32 px, patch 8: 17 tokens) with its image processor; a Wan transformer of 2
    blocks taking 36 channels (16 noisy, 4 mask, 16 condition) with an image cross-attention from the CLIP width.
    `two_experts`: Wan2.2-I2V-A14B's layout instead, no CLIP tower and no image cross-attention, two transformers
    of their own random weights switched at boundary_ratio 0.9."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    te, tok = _t5(32, MAX_SEQUENCE_LENGTH["wan"], umt5=True)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=32, patch_size=8,
                                                     projection_dim=16)).eval()  # fmt: skip
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                        in_channels=36, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64,
                                        num_layers=2, rope_max_seq_len=32,
                                        **({} if two_experts else dict(image_dim=16, added_kv_proj_dim=32)))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    parts: dict = dict(image_processor=processor, image_encoder=image_encoder)
    if two_experts:
        parts = dict(transformer_2=WanTransformer3DModel.from_config(transformer.config), boundary_ratio=0.9)
    pipe = WanImageToVideoPipeline(tokenizer=tok, text_encoder=te, vae=_wan_vae(seed + 1), scheduler=scheduler,
                                   transformer=transformer, **parts)  # fmt: skip
    return _save(pipe, path)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet, which Qwen2's tokenizer uses: printable Latin-1 bytes stand for themselves, the
    others (space, newline, control bytes) for the characters from U+0100 on, in byte order (space -> "Ġ")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


# QwenImagePipeline's system prompt (its prompt_template_encode); the real tokenizer spells the template's prefix,
# "<|im_start|>system\n" + this + "<|im_end|>\n<|im_start|>user\n", in exactly the 34 tokens the pipeline drops
QWEN_SYSTEM = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
               "of the objects and background:")  # fmt: skip
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _qwen_tokenizer(system: str = QWEN_SYSTEM, specials: tuple[str, ...] = QWEN_SPECIALS) -> Any:
    """A Qwen2Tokenizer (byte-level BPE behind Qwen2's pre-tokenizer regex) over the 256 byte symbols, with merges
    that spell each word of the system prompt, the chat roles and a few prompt words as one token each, as the real
    151k-token vocabulary does; any other text falls back to shorter pieces down to single bytes (never <unk>).
    The special tokens (<|endoftext|> (pad), <|im_start|>, <|im_end|>, and the vision ones for an editing pipeline)
    come last, as in the real vocabulary."""
    from transformers import Qwen2Tokenizer

    byte = _byte_chars()
    words = ["system", "user", "assistant", system.split()[0]] + [" " + w for w in system.split()[1:]]
    words += [" " + w for w in _WORDS] + list(_WORDS)
    vocab = {byte[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys("".join(byte[b] for b in w.strip(",:").encode()) for w in words):
        for k in range(1, len(word)):  # left to right: the word's first k symbols, then the next one
            if word[: k + 1] not in vocab:
                vocab[word[: k + 1]] = len(vocab)
                merges.append((word[:k], word[k]))
    # the system prompt's pre-tokenizer pieces (" (", "color", ")," "'s") each one token too; a space-led word
    # whose letters merge first (" user": "user" is a word) gets the space joined last, as the real merges do
    for piece in re.findall(r"'s|[^\r\n\w]?[A-Za-z]+| ?[^\sA-Za-z0-9]+", system):
        sym = "".join(byte[b] for b in piece.encode())
        parts = [sym[0], sym[1:]] if piece[0] == " " and sym[1:] in vocab else [sym[0], *sym[1:]]
        for k in range(1, len(parts)):
            head = "".join(parts[:k])
            vocab.setdefault(head + parts[k], len(vocab))
            if (head, parts[k]) not in merges:
                merges.append((head, parts[k]))
    for special in specials:
        vocab[special] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=list(specials[1:]),
                          model_max_length=131072)  # fmt: skip


def _qwen_vl(hidden: int, tok: Any) -> Any:
    """A Qwen2.5-VL (the class Qwen-Image's text encoder is: Qwen2_5_VLForConditionalGeneration) with a 2-layer
    language model (grouped KV heads, multimodal RoPE sections 4/4/4 of its head width 24) and a 1-block vision
    tower (14 px patches merged 2x2, as the real one), which Qwen-Image never runs and Qwen-Image-Edit runs on the
    source; the pipelines read the language model's last hidden states. The vision token ids are the tokenizer's
    (an editing tokenizer has them)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    pad, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(t) for k, t in (("image", "<|image_pad|>"),
           ("video", "<|video_pad|>"), ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"))}
    ids = {k: v for k, v in ids.items() if v is not None and v != tok.unk_token_id}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [4, 4, 4]}, pad_token_id=pad, bos_token_id=pad,
                eos_token_id=eos)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                  fullatt_block_indexes=[0])  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                                **ids)).eval()  # fmt: skip


def build_qwenimage(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny QwenImagePipeline (Qwen/Qwen-Image layout) into `path`.

    Qwen2.5-VL (48 wide) with a byte-level Qwen2 tokenizer that splits the pipeline's chat template as the real one
    does (34 system-prompt tokens dropped, 5 assistant-suffix tokens kept after the prompt); a Qwen-Image
    transformer of 2 double-stream blocks, 2 heads of 16 (RoPE axes 4 / 6 / 6), text width 48, 16 latent channels
    packed 2x2 into 64 features; the Qwen-Image VAE (a causal 3-D VAE, x8 spatial, run on one frame) with
    non-trivial per-channel latent means and deviations, so a decode that skips them differs; and Qwen-Image's
    scheduler: FlowMatchEuler with the exponential dynamic shift (256 tokens -> 0.5, 8192 -> 0.9, shift 1) and
    shift_terminal 0.02.
    """
    from diffusers import QwenImagePipeline

    torch.manual_seed(seed)
    tok = _qwen_tokenizer()
    te = _qwen_vl(48, tok)
    pipe = QwenImagePipeline(text_encoder=te, tokenizer=tok, **_qwen_parts(seed))
    return _save(pipe, path)


def _qwen_parts(seed: int) -> dict[str, Any]:
    """Qwen-Image's VAE, transformer and scheduler (build_qwenimage's docstring)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    g = torch.Generator().manual_seed(seed + 1)
    channels = LATENT_CHANNELS["qwenimage"]
    mean = (torch.randn(channels, generator=g) * 0.5).tolist()
    std = (torch.rand(channels, generator=g) + 0.5).tolist()
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=channels, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=mean,
                                 latents_std=std).eval()  # fmt: skip
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * channels, out_channels=channels, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )  # fmt: skip
    return {"scheduler": scheduler, "vae": vae, "transformer": transformer}


# QwenImageEditPipeline's system prompt (its prompt_template_encode): the real tokenizer spells the template's prefix,
# "<|im_start|>system\n" + this + "<|im_end|>\n<|im_start|>user\n", in the 64 tokens the pipeline drops
QWEN_EDIT_SYSTEM = ("Describe the key features of the input image (color, shape, size, texture, objects, background), "
                    "then explain how the user's text instruction should alter or modify the image. Generate a new "
                    "image that meets the user's requirements while maintaining consistency with the original input "
                    "where appropriate.")  # fmt: skip
QWEN_VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@contextlib.contextmanager
def qwen_vl_processor() -> Iterator[None]:
    """Lets transformers build and load a `Qwen2VLProcessor` where torchvision is missing (this CPU machine: the
    torchvision wheel paired with torch 2.13 on the package index is a CUDA build, so it cannot import here).

    The processor has three parts; its class check for the video processor, and loading that part, need
    torchvision. Inside this block the check finds the real class it names (transformers 5.0: `BaseVideoProcessor`,
    5.24: `VideoProcessorMixin`) and loading gives a plain `BaseVideoProcessor`, which the editing pipelines never call
    (they send the processor text and images). The image
    processor (the PIL one transformers falls back to) and the tokenizer are the real ones, saved and loaded from
    disk. A machine with torchvision (any GPU user's) needs none of this: there the block changes nothing."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    import importlib

    import transformers.processing_utils as pu
    import transformers.video_processing_utils as vpu

    auto = importlib.import_module("transformers.models.auto.video_processing_auto").AutoVideoProcessor
    expected = pu.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"]  # 5.0: BaseVideoProcessor; 5.24: its mixin
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pu.transformers_module, expected, getattr(vpu, expected), raising=False)
        mp.setattr(auto, "from_pretrained", staticmethod(lambda *a, **k: vpu.BaseVideoProcessor()))
        yield


def build_qwenimage_edit(path: str | Path, seed: int = 0, plus: bool = False) -> Path:
    """Save a tiny QwenImageEditPipeline (Qwen/Qwen-Image-Edit layout; `plus`: a QwenImageEditPlusPipeline, the
    Qwen-Image-Edit-2509 layout, the same parts) into `path` (inside `qwen_vl_processor()`).

    build_qwenimage's parts with the editing chat template's vocabulary and the vision special tokens in the
    tokenizer; the Qwen2.5-VL vision tower reads the source (a 64 px source: 4 x 4 patches of 14 px, merged 2 x 2
    into 4 vision tokens); a Qwen2VLProcessor (the PIL image processor at its defaults, the tokenizer, and the
    stand-in video processor the pipeline never calls)."""
    import transformers
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    # the PIL image processor: its own class from transformers 5.x's later releases, the plain name before
    images = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor

    torch.manual_seed(seed)
    tok = _qwen_tokenizer(QWEN_EDIT_SYSTEM, QWEN_SPECIALS + QWEN_VISION_SPECIALS)
    te = _qwen_vl(48, tok)
    processor = Qwen2VLProcessor(image_processor=images(), tokenizer=tok, video_processor=BaseVideoProcessor())
    parts = _qwen_parts(seed)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls(text_encoder=te, tokenizer=tok, processor=processor, **parts)
    return _save(pipe, path)


def linear_rows(model: Any, prompt: str = "a cat") -> set[int]:
    """Token rows each nn.Linear of `model`'s transformer sees in one velocity call on one sample of `prompt` (an
    editor's: a conditioned prompt): what `tokens_per_sample` (the image tokens, sizing explore_precision=auto's probe
    and the memory plan's activations) must be one of."""
    seen: set[int] = set()
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.add(args[0].numel() // args[0].shape[-1]))
             for m in model.transformer.modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
    try:
        with torch.no_grad():
            model.velocity(torch.randn(1, *model.latent_shape), torch.tensor([0.5]), model.encode_prompts([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return seen


# Qwen3's chat template, cut to what ZImagePipeline uses: ChatML turns, the assistant's opening, and the empty think
# block the real template adds only when thinking is switched off (the pipeline switches it on: no block)
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_z_image(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ZImagePipeline (Tongyi-MAI/Z-Image layout) into `path`.

    A Qwen3 encoder (32 wide, 3 layers: the pipeline reads the second-to-last hidden states) with the byte-level
    Qwen2 tokenizer and a ChatML template; a Z-Image transformer 48 wide (SwiGLU 128, a multiple of 16 as the real
    10240 is) of 2 main layers and 2 + 2 refiners, 2 heads of 24 (RoPE axes 8 / 8 / 8), caption width 32, patch 2
    over 16 x 8 x 8 latents; FLUX.1's VAE layout (16 channels,
    scaling 0.3611, shift 0.1159); and a static-shift FlowMatchEuler scheduler (shift 6).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tok = _qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.pad_token = "<|endoftext|>"
    te = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                                pad_token_id=pad)).eval()  # fmt: skip
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=48, n_layers=2, n_refiner_layers=2, n_heads=2,
        n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 8, 8], axes_lens=[256, 64, 64],
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=6.0)
    pipe = ZImagePipeline(scheduler=scheduler, vae=_vae_kl(16, 0.3611, 0.1159), text_encoder=te, tokenizer=tok,
                          transformer=transformer)  # fmt: skip
    return _save(pipe, path)


def build_flux2(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny Flux2KleinPipeline (black-forest-labs/FLUX.2-klein-base-4B layout) into `path`.

    A Qwen3 causal LM 16 wide with 27 layers (the pipeline stacks the hidden states of layers 9, 18 and 27: text
    width 48) behind the byte-level Qwen2 tokenizer and a ChatML template; a FLUX.2 transformer of 1 double- and 2
    single-stream blocks, 2 heads of 16 (RoPE axes 4 x 4), patch 1 over 128 x 4 x 4 latents (64 px: the 32-channel
    VAE's cells folded 2x2); FLUX.2's VAE layout (32 channels, batch-norm statistics on the folded cells, set to
    non-trivial values so a decode that skips them differs); and FlowMatchEuler with the dynamic shift the pipeline
    drives by its empirical mu.
    """
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tok = _qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.pad_token = "<|endoftext|>"
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    te = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=1024, pad_token_id=pad)).eval()  # fmt: skip
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4,
                             latent_channels=32, sample_size=64).eval()  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    vae.bn.running_mean.copy_(torch.randn(128, generator=g) * 0.5)
    vae.bn.running_var.copy_(torch.rand(128, generator=g) + 0.5)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer)
    return _save(pipe, path)


class LazyPipes(dict):
    """Tiny pipelines by family name, each built under `root` on first use by `builders[name]` (a test module's
    fixture: a test that takes a few families builds those only)."""

    def __init__(self, root: Path, builders: dict) -> None:
        super().__init__()
        self.root, self.builders = root, builders

    def __missing__(self, name: str) -> Path:
        self[name] = self.builders[name](self.root / name)
        return self[name]

