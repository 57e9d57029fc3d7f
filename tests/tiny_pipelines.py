"""Test support: tiny random-weight pipelines of the real diffusers classes, built offline and saved
with save_pretrained, so the engine loads them through `DiffusionPipeline.from_pretrained` exactly
as it loads a user's SD3.5 / FLUX.1 / SANA weights.

Sizes: SD3 and FLUX at 64 px (VAE factor 8: 8x8 latents; FLUX packs them 2x2 into 16 tokens of
64 features), SANA at 128 px (DC-AE factor 32: 4x4 latents). Text: CLIP tokenizers are byte-level
BPE over the 256 bytes and their </w> forms, T5 a Unigram model, Gemma a byte-fallback BPE, all built
with the `tokenizers` library through transformers' classes. Every module is a few thousand to a
few hundred thousand parameters; a 2-step generation takes well under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_clip import _bytes_to_unicode, build_clip_reward, clip_tokenizer

SIZES = {"sd3": 64, "flux": 64, "sana": 128}

__all__ = ["SIZES", "build_clip_reward", "build_flux", "build_sana", "build_sd3"]


def _t5():  # noqa: ANN202 - (T5EncoderModel, T5Tokenizer)
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += [("\u2581" + w, -1.0) for w in ("a", "red", "blue", "apple", "car", "the", "on", "of")]
    tok = T5Tokenizer(vocab=pieces, extra_ids=4)
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0)  # fmt: skip
    return T5EncoderModel(cfg).eval(), tok


def _clip_text(hidden: int, projection: bool):  # noqa: ANN202 - (CLIP text model, CLIPTokenizer)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok = clip_tokenizer()
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden, **ids)  # fmt: skip
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(cfg).eval(), tok


def _vae_kl(latent_channels: int, scaling: float, shift: float):  # noqa: ANN202
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4,
        scaling_factor=scaling, shift_factor=shift,
    ).eval()  # fmt: skip  (4 blocks: a factor of 8, as SD3's and FLUX's VAEs)


def _save(pipe: object, path: str | Path) -> Path:
    path = Path(path)
    pipe.save_pretrained(path)  # type: ignore[attr-defined]
    return path


def build_sd3(path: str | Path, seed: int = 0) -> Path:
    """StableDiffusion3Pipeline: CLIP-L + CLIP-G (with projections) + T5, SD3's VAE factors, shift 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    te1, tok1 = _clip_text(16, projection=True)
    te2, tok2 = _clip_text(16, projection=True)
    te3, tok3 = _t5()
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=8, qk_norm="rms_norm",
    )  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae_kl(4, 1.5305, 0.0609), text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2,
        text_encoder_3=te3, tokenizer_3=tok3,
    )  # fmt: skip
    return _save(pipe, path)


def build_flux(path: str | Path, seed: int = 0) -> Path:
    """FluxPipeline: CLIP-L (pooled) + T5 (tokens), 16 latent channels packed 2x2, distilled guidance,
    the dynamic-shift scheduler of FLUX.1-dev."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    te1, tok1 = _clip_text(16, projection=False)
    te2, tok2 = _t5()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip
    pipe = FluxPipeline(
        scheduler=scheduler, vae=_vae_kl(16, 0.3611, 0.1159), text_encoder=te1, tokenizer=tok1,
        text_encoder_2=te2, tokenizer_2=tok2, transformer=transformer,
    )  # fmt: skip
    return _save(pipe, path)


def _gemma():  # noqa: ANN202 - (Gemma2Model, GemmaTokenizer)
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate(special)}
    for b in range(256):  # byte fallback pieces
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in sorted(set(_bytes_to_unicode().values()) | set("abcdefghijklmnopqrstuvwxyz \u2581")):
        vocab.setdefault(c, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=[])
    cfg = Gemma2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    return Gemma2Model(cfg).eval(), tok


def build_sana(path: str | Path, seed: int = 0) -> Path:
    """SanaPipeline: Gemma-2 text encoder, the 32x DC-AE, a SANA transformer whose FFN is GLUMBConv
    (1x1 convolutions; width 32 so they pass the quantizer's min_dim), the DPM-Solver++ flow
    scheduler SANA ships with (flow_shift 3)."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    torch.manual_seed(seed)
    te, tok = _gemma()
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=8, encoder_block_types="ResBlock",
        decoder_block_types="ResBlock", encoder_block_out_channels=(8, 8, 8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8, 8, 8), encoder_layers_per_block=(1, 1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1, 1), encoder_qkv_multiscales=((),) * 6,
        decoder_qkv_multiscales=((),) * 6, scaling_factor=0.41407,
    ).eval()  # fmt: skip  (6 blocks: a factor of 32, as SANA's DC-AE)
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32,
        mlp_ratio=2.5, sample_size=4, patch_size=1,
    )  # fmt: skip
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    pipe = SanaPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer, scheduler=scheduler)
    return _save(pipe, path)
