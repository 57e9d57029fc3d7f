"""FLUX.2 [klein] through the engine, on a tiny random-weight Flux2KleinPipeline of the real classes
(tests/tiny_pipelines.py) saved and loaded as a user's weights are: a seed is the patched latent the stock pipeline
draws, prompts are encoded as the pipeline encodes them, the engine's sample equals the stock pipeline's for the
same seed with and without guidance, the explore copy quantizes the blocks' per-token linears, every family trains
through `solrl train`, and the exported LoRA loads into the stock pipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import LATENT_SHAPES, MAX_SEQUENCE_LENGTH, SIZES, build_clip_reward, build_flux2, linear_rows

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample, seeded_noise

SIZE, TOKENS = SIZES["flux2"], MAX_SEQUENCE_LENGTH["flux2"]
PROMPTS = ["a red apple", "a photo of a blue car on the table"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def f2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux2(tmp_path_factory.mktemp("flux2") / "f2")


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("f2clip") / "clip")


def _stock(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The saved pipeline as a user loads it: the generic entry point picks the class from model_index.json."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model("flux2", path, "cpu", dtype, resolution=SIZE, max_sequence_length=TOKENS)


def _call(pipe: Any, prompts: list[str], seeds: list[int], steps: int, guidance: float) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return pipe(prompt=prompts, height=SIZE, width=SIZE, num_inference_steps=steps, guidance_scale=guidance,
                generator=gens, output_type="pt", max_sequence_length=TOKENS).images.float()  # fmt: skip


def test_the_tiny_pipeline_is_the_real_classes(f2):
    pipe = _stock(f2)
    names = {k: type(v).__name__ for k, v in pipe.components.items()}
    assert names == {"transformer": "Flux2Transformer2DModel", "vae": "AutoencoderKLFlux2",
                     "text_encoder": "Qwen3ForCausalLM", "tokenizer": "Qwen2Tokenizer",
                     "scheduler": "FlowMatchEulerDiscreteScheduler"}  # fmt: skip
    assert type(pipe).__name__ == "Flux2KleinPipeline" and not pipe.config.is_distilled


def test_prompts_are_encoded_as_the_pipeline_encodes_them(f2):
    m = _model(f2)
    theirs, _ = m.pipe.encode_prompt(list(PROMPTS), max_sequence_length=TOKENS)
    cond = m.encode_prompts(PROMPTS)
    assert cond.hidden.shape == (2, TOKENS, 48) and cond.pooled is None and cond.mask is None
    assert torch.equal(cond.hidden, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_sample_is_the_stock_pipelines_for_the_same_seed(f2, dtype):
    """Euler on the pipeline's sigmas under its empirical shift, without guidance and at the documented 4.0: the
    stock pipeline's images (FP32 to 1e-5; BF16, where the pipeline keeps its latents in BF16, to its rounding)."""
    m = _model(f2, dtype)
    seeds, steps = [3, 11], 4
    pipe = _stock(f2, dtype)
    packed, _ = pipe.prepare_latents(2, 32, SIZE, SIZE, torch.float32, "cpu", [torch.Generator().manual_seed(s)
                                                                              for s in seeds])  # fmt: skip
    noise = seeded_noise(seeds, m.latent_shape)
    assert torch.equal(packed, noise.flatten(2).transpose(1, 2))  # a seed is the stock pipeline's latent, packed
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # BF16 measured: max 0.027 (no guidance), 0.045 (4.0)
    for g in (1.0, 4.0):
        x = sample(m, m.encode_prompts(PROMPTS), seeds, steps, guidance_scale=g, uncond=m.encode_unconditional(),
                   dtype=torch.float32)  # fmt: skip
        torch.testing.assert_close(m.decode(x), _call(pipe, PROMPTS, seeds, steps, g), atol=tol, rtol=0)
    if dtype == torch.float32:  # a decode that skipped the VAE's batch-norm statistics would differ
        vae = m.pipe.vae
        mean, var = vae.bn.running_mean.clone(), vae.bn.running_var.clone()
        try:
            vae.bn.running_mean.zero_()
            vae.bn.running_var.fill_(1.0 - vae.config.batch_norm_eps)
            assert (m.decode(x) - _call(pipe, PROMPTS, seeds, steps, 4.0)).abs().max() > 100 * tol
        finally:
            vae.bn.running_mean.copy_(mean)
            vae.bn.running_var.copy_(var)


def test_the_explore_copy_quantizes_the_per_token_linears(f2):
    m = _model(f2)
    copy = ExploreCopy(m.transformer, "nvfp4", changes=model_spec("flux2").explore_rule)
    q = set(copy.report.quantized)
    double = {"attn.to_q", "attn.add_k_proj", "ff.linear_in", "ff_context.linear_out"}
    single = {"attn.to_qkv_mlp_proj", "attn.to_out"}
    assert {f"transformer_blocks.0.{n}" for n in double} | {f"single_transformer_blocks.1.{n}" for n in single} <= q
    assert all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in q)
    names = [n for n, _ in m.transformer.named_modules()]
    for target in model_spec("flux2").lora_targets:
        hits = [n for n in names if n.endswith(target)]
        assert hits and all(isinstance(m.transformer.get_submodule(n), torch.nn.Linear) for n in hits), target
    blocks = {type(b).__name__ for b in [*m.transformer.transformer_blocks, *m.transformer.single_transformer_blocks]}
    assert blocks == set(model_spec("flux2").repeated_blocks) == set(type(m.transformer)._repeated_blocks)


def _train_args(f2: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={f2}", f"resolution={SIZE}", f"reward_args=clipscore.model={clip}", f"n={n}", "k=2",
            "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2", "eval_prompt_count=2",
            "eval_seeds=1", "eval_every=2", "save_every=2", "rollout_batch_size=8", "train_batch_size=2",
            "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4",
            *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/flux2.py:flux2_klein_{family}_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_exports_a_lora_the_stock_pipeline_loads(f2, clip, tmp_path, monkeypatch):
    """Two sol_rl iterations (guidance 4.0, the preset's) through the CLI; the exported adapter, loaded by
    Flux2KleinPipeline.load_lora_weights, changes the stock pipeline's image, and the stock pipeline with it draws what
    the engine draws with the same adapter for the same seed."""
    from solrl_engine import hw
    from solrl_engine.cli import load_lora_into, main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train_args(f2, clip, out, "sol_rl", "save_every=1")) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    pipe = _stock(f2)
    before = _call(pipe, ["a red apple"], [5], 3, 4.0)
    pipe.load_lora_weights(str(out / "lora"))  # as a user loads it (the engine's load_lora checks a manifest first)
    after = _call(pipe, ["a red apple"], [5], 3, 4.0)
    assert (after - before).abs().max() > 1e-3  # the trained adapter changes the stock pipeline's image
    m = _model(f2)
    load_lora_into(m.transformer, str(out / "lora"))
    x = sample(m, m.encode_prompts(["a red apple"]), [5], 3, guidance_scale=4.0, uncond=m.encode_unconditional())
    torch.testing.assert_close(m.decode(x), after, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_the_saved_pipeline(family, f2, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)  # the compile family samples eagerly here
    out = tmp_path / family
    assert main(_train_args(f2, clip, out, family)) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert (out / "lora" / "pytorch_lora_weights.safetensors").exists()


def test_the_explorer_takes_a_stock_pipeline_and_regenerates_what_the_engine_draws(f2):
    """Other trainers' path: a stock Flux2KleinPipeline wrapped as it is; the selected seeds' noise is the
    pipeline's `latents=` layout, and its regeneration at the model's guidance is the engine's sample."""
    from solrl_engine.explore import Explorer

    pipe = _stock(f2)
    ex = Explorer(pipe, lambda im, p: im.mean((1, 2, 3)), n=4, k=2, preview_steps=2, explore_precision="nvfp4",
                  resolution=SIZE, batch_size=4)  # fmt: skip
    assert ex.pipeline_guidance == 4.0
    sel = ex.select(PROMPTS)
    assert len(sel.seeds) == 2 and sel.noise.shape == (4, *LATENT_SHAPES["flux2"])
    regen = sel.regenerate(pipe, steps=2, max_sequence_length=TOKENS)
    assert regen.images.shape == (4, 3, SIZE, SIZE) and regen.rewards.shape == (2, 2)
    m = _model(f2)
    flat = [p for p, s in zip(PROMPTS, sel.seeds, strict=True) for _ in s]
    x = sample(m, m.encode_prompts(flat), [s for row in sel.seeds for s in row], 2, guidance_scale=4.0,
               uncond=m.encode_unconditional())  # fmt: skip
    torch.testing.assert_close(m.decode(x), regen.images, atol=1e-5, rtol=0)


def test_tokens_per_sample_are_the_image_tokens_the_layers_see(f2):
    m = _model(f2)
    _, h, w = m.latent_shape
    assert m.tokens_per_sample == h * w and m.tokens_per_sample in linear_rows(m)
