"""The tiny pipelines of tests/tiny_pipelines.py load back through `DiffusionPipeline.from_pretrained`
as the real classes, encode with the pipeline's own `encode_prompt`, and draw finite images of the
documented size, so the engine's tests exercise the path a user's real weights take."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import (
    CLIP_TOKENS,
    LATENT_SHAPES,
    MAX_SEQUENCE_LENGTH,
    SIZES,
    VAE_FACTOR,
    build_clip_reward,
    build_flux,
    build_sana,
    build_sd3,
)

BUILDERS = {"sd3": build_sd3, "flux": build_flux, "sana": build_sana}
CLASSES = {
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel", "AutoencoderKL", "FlowMatchEulerDiscreteScheduler"),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", "AutoencoderKL", "FlowMatchEulerDiscreteScheduler"),
    "sana": ("SanaPipeline", "SanaTransformer2DModel", "AutoencoderDC", "DPMSolverMultistepScheduler"),
}
PROMPT = "a red apple on the table"


def _load(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The saved pipeline as a user loads it: the generic entry point picks the class from model_index.json."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _encode(name: str, pipe: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(text states, pooled or mask) from the pipeline's own encode_prompt."""
    n = MAX_SEQUENCE_LENGTH[name]
    if name == "sd3":
        hidden, _, pooled, _ = pipe.encode_prompt(PROMPT, None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=n)  # fmt: skip
        return hidden, pooled
    if name == "flux":
        hidden, pooled, text_ids = pipe.encode_prompt(PROMPT, None, max_sequence_length=n)
        assert text_ids.shape == (n, 3)
        return hidden, pooled
    hidden, mask, _, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, max_sequence_length=n, **kw)
    return hidden, mask


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_tiny_pipeline_loads_encodes_and_draws(name, tmp_path):
    path = BUILDERS[name](tmp_path / name)
    pipe = _load(path)
    want_pipe, want_net, want_vae, want_sched = CLASSES[name]
    assert type(pipe).__name__ == want_pipe and type(pipe.transformer).__name__ == want_net
    assert type(pipe.vae).__name__ == want_vae and type(pipe.scheduler).__name__ == want_sched
    assert pipe.vae_scale_factor == VAE_FACTOR[name]
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert sum(p.numel() for m in modules for p in m.parameters()) < 1_000_000  # tiny: a few hundred thousand

    n = MAX_SEQUENCE_LENGTH[name]
    hidden, extra = _encode(name, pipe)
    assert torch.isfinite(hidden).all()
    if name == "sd3":  # CLIP-L + CLIP-G states padded to T5's width, then T5's tokens; pooled CLIP-L | CLIP-G
        assert hidden.shape == (1, CLIP_TOKENS + n, pipe.transformer.config.joint_attention_dim)
        assert extra.shape == (1, pipe.transformer.config.pooled_projection_dim)
    elif name == "flux":
        assert hidden.shape == (1, n, pipe.transformer.config.joint_attention_dim)
        assert extra.shape == (1, pipe.transformer.config.pooled_projection_dim)
    else:  # Gemma states and their mask; <bos> then the prompt, right-padded
        assert hidden.shape == (1, n, pipe.transformer.config.caption_channels)
        assert extra.shape == (1, n) and extra[0, 0] == 1 and extra[0, -1] == 0
        # with the complex human instruction __call__ uses: <bos> + the last n - 1 tokens
        instruction = inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
        long, _ = _encode(name, pipe, complex_human_instruction=instruction)
        assert long.shape == hidden.shape and not torch.allclose(long, hidden)

    kw = {"use_resolution_binning": False} if name == "sana" else {}
    size = SIZES[name]
    out = pipe(PROMPT, num_inference_steps=2, height=size, width=size, output_type="pt", max_sequence_length=n,
               generator=torch.Generator().manual_seed(0), **kw).images  # fmt: skip
    assert out.shape == (1, 3, size, size) and torch.isfinite(out).all()
    assert out.min() >= 0 and out.max() <= 1 and out.std() > 0
    latents = pipe(PROMPT, num_inference_steps=2, height=size, width=size, output_type="latent", max_sequence_length=n,
                   generator=torch.Generator().manual_seed(0), **kw).images  # fmt: skip
    if name == "flux":  # packed 2x2: (H/16 * W/16) tokens of 4 * channels
        c, h, w = LATENT_SHAPES[name]
        assert latents.shape == (1, (h // 2) * (w // 2), 4 * c)
    else:
        assert latents.shape == (1, *LATENT_SHAPES[name])


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_tiny_pipeline_loads_in_bfloat16(name, tmp_path):
    """The engine loads with torch_dtype=bfloat16 by default: the saved fp32 weights must cast and encode."""
    pipe = _load(BUILDERS[name](tmp_path / name), torch.bfloat16)
    assert next(pipe.transformer.parameters()).dtype == torch.bfloat16
    hidden, _ = _encode(name, pipe)
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden).all()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builds_are_deterministic_and_small(name, tmp_path):
    """Same seed, same bytes: tests comparing two loads of a build may rely on it."""

    def digest(path: Path) -> dict[str, str]:
        return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in path.rglob("*")
                if f.is_file()}  # fmt: skip

    a, b = BUILDERS[name](tmp_path / "a"), BUILDERS[name](tmp_path / "b")
    assert digest(a) == digest(b)
    assert digest(BUILDERS[name](tmp_path / "c", seed=1)) != digest(a)
    assert sum(f.stat().st_size for f in a.rglob("*") if f.is_file()) < 8 * 2**20


def test_tokenizers_round_trip_and_keep_their_special_tokens(tmp_path):
    """The hand-built tokenizers survive save/load with their specials (CLIP bos/eos, T5 eos, Gemma bos)."""
    sd3 = _load(build_sd3(tmp_path / "sd3"))
    sana = _load(build_sana(tmp_path / "sana"))
    text = "A red apple, on the TABLE!"
    clip = sd3.tokenizer(text).input_ids
    assert clip[0] == sd3.tokenizer.bos_token_id and clip[-1] == sd3.tokenizer.eos_token_id
    assert sd3.tokenizer.decode(clip, skip_special_tokens=True).replace(" ,", ",").replace(" !", "!") == text.lower()
    t5 = sd3.tokenizer_3(text).input_ids
    assert t5[-1] == sd3.tokenizer_3.eos_token_id and sd3.tokenizer_3.unk_token_id not in t5
    assert sd3.tokenizer_3.decode(t5, skip_special_tokens=True) == text
    assert sd3.tokenizer_3.model_max_length == MAX_SEQUENCE_LENGTH["sd3"]
    gemma = sana.tokenizer(text + "\nnaïve").input_ids  # the newline and the ï go through byte fallback
    assert gemma[0] == sana.tokenizer.bos_token_id and sana.tokenizer.unk_token_id not in gemma
    assert sana.tokenizer.decode(gemma, skip_special_tokens=True) == text + "\nnaïve"


def test_clip_reward_loads_with_the_transformers_classes(tmp_path):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    path = build_clip_reward(tmp_path / "clip")
    model, proc = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    inputs = proc(text=[PROMPT, "a blue car"], images=[Image.new("RGB", (48, 40), (200, 30, 30))], return_tensors="pt",
                  padding=True)  # fmt: skip
    size = model.config.vision_config.image_size
    assert inputs["pixel_values"].shape == (1, 3, size, size)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        txt = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    txt = txt.pooler_output
    assert img.shape == (1, model.config.projection_dim) and txt.shape == (2, model.config.projection_dim)
    assert torch.isfinite(img).all() and torch.isfinite(txt).all() and not torch.allclose(txt[0], txt[1])
