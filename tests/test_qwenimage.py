"""Qwen-Image through the engine, on a tiny random-weight QwenImagePipeline of the real classes
(tests/tiny_pipelines.py) saved and loaded as a user's weights are: a seed is the latent the stock pipeline
draws, prompts are encoded as the pipeline encodes them, the engine's sample equals the stock pipeline's for the
same seed (without guidance; with it, the engine's plain CFG equals the pipeline's true CFG with its norm rescale
taken out), the explore copy quantizes the blocks' per-token linears and keeps the embedders and modulations, and
`solrl train` trains it and exports a LoRA the stock pipeline loads."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import LATENT_SHAPES, QWEN_SYSTEM, SIZES, build_clip_reward, build_qwenimage, linear_rows

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample, seeded_noise

SIZE = SIZES["qwenimage"]
PROMPTS = ["a red apple", "a photo of a blue car on the table"]  # different lengths: the batch is padded
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwenimage(tmp_path_factory.mktemp("qwen") / "qwen")


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("qwenclip") / "clip")


def _stock(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The saved pipeline as a user loads it: the generic entry point picks the class from model_index.json."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model("qwenimage", path, "cpu", dtype, resolution=SIZE)


def test_the_tiny_pipeline_is_the_real_classes_small_and_deterministic(qwen, tmp_path):
    pipe = _stock(qwen)
    names = {k: type(v).__name__ for k, v in pipe.components.items()}
    assert names == {"transformer": "QwenImageTransformer2DModel", "vae": "AutoencoderKLQwenImage",
                     "text_encoder": "Qwen2_5_VLForConditionalGeneration", "tokenizer": "Qwen2Tokenizer",
                     "scheduler": "FlowMatchEulerDiscreteScheduler"}  # fmt: skip
    assert type(pipe).__name__ == "QwenImagePipeline" and pipe.vae_scale_factor == 8
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert sum(p.numel() for m in modules for p in m.parameters()) < 1_000_000
    # the template's prefix is the 34 tokens the pipeline drops, as with the real tokenizer; the prompt follows
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert QWEN_SYSTEM in prefix and len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    ids = pipe.tokenizer(pipe.prompt_template_encode.format("a red apple, naïve\n")).input_ids
    assert pipe.tokenizer.decode(ids) == pipe.prompt_template_encode.format("a red apple, naïve\n")

    def digest(path: Path) -> dict[str, str]:
        return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in path.rglob("*")
                if f.is_file()}  # fmt: skip

    a, b = digest(build_qwenimage(tmp_path / "a")), digest(build_qwenimage(tmp_path / "b"))
    assert a == b and digest(build_qwenimage(tmp_path / "c", seed=1)) != a
    assert sum(f.stat().st_size for f in (tmp_path / "a").rglob("*") if f.is_file()) < 8 * 2**20


def test_prompts_are_encoded_as_the_pipeline_encodes_them(qwen):
    """The pipeline's template, its dropped system prefix and its batch padding with a mask; a batch of one prompt
    (or of equally long ones) has no padding and no mask, as the pipeline passes none; a cached prompt comes back
    as the text encoder gives it alone."""
    m = _model(qwen)
    pipe = m.pipe
    cond = m.encode_prompts(PROMPTS)
    hidden, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    assert cond.pooled is None and torch.equal(cond.hidden, hidden) and torch.equal(cond.mask, mask)
    n = [len(pipe.tokenizer(p).input_ids) + 5 for p in PROMPTS]  # the prompt, then <|im_end|>\n<|im_start|>assistant\n
    assert mask.sum(1).tolist() == n and cond.hidden.shape == (2, max(n), 48)
    for p in PROMPTS:
        alone = m.encode_prompts([p])  # from the cache: cut to its own length
        want, ones = pipe.encode_prompt([p], device="cpu")
        assert alone.mask is None and (ones is None or bool(ones.all()))  # diffusers < 0.37 returns the ones
        torch.testing.assert_close(alone.hidden, want, atol=1e-6, rtol=0)  # in a padded batch vs alone
    same = m.encode_prompts([PROMPTS[0], PROMPTS[0]])
    assert same.mask is None and same.hidden.shape[1] == n[0]
    short = load_model("qwenimage", qwen, "cpu", torch.float32, resolution=SIZE, max_sequence_length=4)
    assert short.encode_prompts(PROMPTS).hidden.shape[1] == 4  # max_sequence_length cuts, as the pipeline's does
    assert torch.equal(short.encode_prompts(PROMPTS).hidden, pipe.encode_prompt(PROMPTS, max_sequence_length=4)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_sample_is_the_stock_pipelines_for_the_same_seed(qwen, dtype):
    """Without guidance: the seed's latent is the one the pipeline draws from a seeded CPU generator, our schedule is
    its scheduler's (dynamic shift, terminal stretch), and our Euler steps over our forward give its latents and
    its decoded images (FP32 to float rounding; BF16 to BF16 rounding)."""
    m = _model(qwen, dtype)
    pipe = _stock(qwen, dtype)
    seeds, steps = [3, 11], 4
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    noise = pipe.prepare_latents(2, 16, SIZE, SIZE, torch.float32, "cpu", gens)
    assert m.latent_shape == LATENT_SHAPES["qwenimage"] and m.vae_factor == 16 and not m.integer_timesteps
    assert torch.equal(noise, m.pipeline_latents(seeded_noise(seeds, m.latent_shape)))
    x = sample(m, m.encode_prompts(PROMPTS), seeds, steps, solver="euler", dtype=dtype)  # latents kept in `dtype`
    kw = dict(height=SIZE, width=SIZE, num_inference_steps=steps, true_cfg_scale=1.0)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    latents = pipe(prompt=PROMPTS, generator=gens, output_type="latent", **kw).images
    torch.testing.assert_close(m.sigmas(steps), pipe.scheduler.sigmas.float(), atol=1e-6, rtol=0)
    assert m.sigmas(steps)[-2] == pytest.approx(0.02)  # stretched to Qwen-Image's shift_terminal
    assert m.sigmas(1).tolist() == [1.0, 0.0]  # where the stock scheduler's stretch gives NaN
    # FP32: equal here (0.0 measured); BF16: 0.023 measured on latents up to 3.6 and 0.022 on the images, the
    # pipeline's scheduler rounding dt * v to BF16 where our sampler keeps the update in FP32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(m.pipeline_latents(x).float(), latents.float(), atol=tol, rtol=0)
    images = pipe(prompt=PROMPTS, latents=m.pipeline_latents(seeded_noise(seeds, m.latent_shape)).to(dtype),
                  output_type="pt", **kw).images  # fmt: skip
    torch.testing.assert_close(m.decode(x), images.float(), atol=tol, rtol=0)
    other = m.decode(sample(m, m.encode_prompts(PROMPTS), [4, 12], steps, solver="euler", dtype=dtype))
    assert (other - images.float()).abs().max() > 10 * tol  # other seeds: other images


def test_guidance_is_the_pipelines_true_cfg_without_its_rescale(qwen, monkeypatch):
    """The engine's CFG (the model's default 4.0 against the empty prompt) equals the stock pipeline's true CFG with
    negative_prompt="" once the pipeline's rescale of each token's guided velocity to the conditional velocity's
    norm is switched off (torch.norm made to return ones during the call); with the rescale, the images differ."""
    m = _model(qwen)
    pipe = m.pipe
    g, seeds, steps = model_spec("qwenimage").guidance_scale, [5, 6], 3
    x = sample(m, m.encode_prompts(PROMPTS), seeds, steps, guidance_scale=g, uncond=m.encode_prompts([""]))
    kw = dict(prompt=PROMPTS, negative_prompt=["", ""], true_cfg_scale=g, height=SIZE, width=SIZE,
              num_inference_steps=steps, output_type="latent")  # fmt: skip

    def latents() -> torch.Tensor:
        return pipe(latents=m.pipeline_latents(seeded_noise(seeds, m.latent_shape)), **kw).images

    stock = latents()
    calls: list[int] = []
    norm = torch.norm

    def ones(t: torch.Tensor, *args: Any, dim: int | None = None, keepdim: bool = False, **k: Any) -> torch.Tensor:
        if dim == -1 and keepdim:  # the pipeline's per-token norms
            calls.append(1)
            return torch.ones_like(t[..., :1])
        return norm(t, *args, dim=dim, keepdim=keepdim, **k)

    monkeypatch.setattr(torch, "norm", ones)
    plain = latents()
    monkeypatch.undo()
    assert len(calls) == 2 * steps  # the rescale was reached (and neutralised) at every step
    torch.testing.assert_close(m.pipeline_latents(x), plain, atol=1e-5, rtol=0)
    assert (stock - plain).abs().max() > 5e-3  # the rescale is a real difference (0.023 measured on latents up to 3.8)


def test_the_explore_copy_quantizes_the_block_linears_and_keeps_embedders_and_modulations(qwen):
    from solrl_engine.explore.plan import ExploreSettings, explore_rule

    m = _model(qwen)
    spec = model_spec("qwenimage")
    copy = ExploreCopy(m.transformer, "nvfp4", changes=spec.explore_rule)
    q, skipped = set(copy.report.quantized), copy.report.skipped
    per_block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                 "txt_mlp.net.2"]  # fmt: skip
    assert q == {f"transformer_blocks.{i}.{n}" for i in range(2) for n in per_block}
    for name in ("img_in", "txt_in", "transformer_blocks.0.img_mod.1", "transformer_blocks.1.txt_mod.1"):
        assert "not matched by include patterns" in skipped[name], (name, skipped[name])
    for name, pattern in (("time_text_embed.timestep_embedder.linear_1", "*embed*"),
                          ("norm_out.linear", "*norm_out*"), ("proj_out", "proj_out")):  # fmt: skip
        assert f"matches skip pattern {pattern!r}" in skipped[name], (name, skipped[name])
    for fmt in ("nvfp4", "fp8", "int8"):  # the same rule in every explore format
        assert explore_rule(ExploreSettings(), spec, fmt) == spec.explore_rule
    # the published transformer on the meta device: 13.6B of its 20.4B parameters are in the quantized layers
    import diffusers

    from solrl_engine.nn import plan_quantization
    from solrl_engine.quant import get_recipe

    adapter = spec.adapter_object()
    with torch.device("meta"):
        net = getattr(diffusers, adapter.TRANSFORMER_CLASS)(**adapter.FULL_CONFIG)
    rep = plan_quantization(net, get_recipe("nvfp4").with_(**spec.explore_rule))
    quantized = sum(d.in_features * d.out_features for d in rep.layers if d.quantized)
    assert len(rep.quantized) == 60 * 12 and 13.5e9 < quantized < 13.7e9


def test_lora_targets_and_repeated_blocks_are_the_transformers(qwen):
    m = _model(qwen)
    spec = model_spec("qwenimage")
    names = [n for n, _ in m.transformer.named_modules()]
    for target in spec.lora_targets:
        hits = [n for n in names if n.endswith(target)]
        assert len(hits) == 2 and all(isinstance(m.transformer.get_submodule(n), torch.nn.Linear) for n in hits)
    blocks = {type(b).__name__ for b in m.transformer.transformer_blocks}
    assert blocks == set(spec.repeated_blocks) == set(type(m.transformer)._repeated_blocks)


def _train_args(qwen: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={qwen}", f"resolution={SIZE}", f"reward_args=clipscore.model={clip}", f"n={n}", "k=2",
            "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2", "eval_prompt_count=2",
            "eval_seeds=1", "eval_every=2", "save_every=2", "rollout_batch_size=8", "train_batch_size=2",
            "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4",
            *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/qwenimage.py:qwenimage_{family}_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_exports_a_lora_the_stock_pipeline_loads(qwen, clip, tmp_path, monkeypatch):
    """Two sol_rl iterations (guidance 4.0, the preset's) through the CLI; the exported adapter, loaded by
    QwenImagePipeline.load_lora_weights, changes the stock pipeline's image, and the stock pipeline with it draws
    what the engine draws with the same adapter for the same seed."""
    from solrl_engine import hw
    from solrl_engine.cli import load_lora_into, main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train_args(qwen, clip, out, "sol_rl", "save_every=1")) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    quant = (out / "quantization.txt").read_text()
    assert quant.startswith("quantize_model[nvfp4]: 24 of 34 Linear layers quantized"), quant[:200]
    pipe = _stock(qwen)
    kw = dict(height=SIZE, width=SIZE, num_inference_steps=3, true_cfg_scale=1.0, output_type="pt")
    before = pipe(prompt=["a red apple"], generator=torch.Generator().manual_seed(5), **kw).images
    pipe.load_lora_weights(str(out / "lora"))  # as a user loads it (the engine's load_lora checks a manifest first)
    after = pipe(prompt=["a red apple"], generator=torch.Generator().manual_seed(5), **kw).images
    assert (after - before).abs().max() > 1e-3  # the trained adapter changes the stock pipeline's image
    scaling = {v for mod in pipe.transformer.modules() if hasattr(mod, "scaling") for v in mod.scaling.values()}
    assert scaling == {2.0}  # alpha / rank = 8 / 4 travelled with the weights
    m = _model(qwen)
    load_lora_into(m.transformer, str(out / "lora"))
    x = sample(m, m.encode_prompts(["a red apple"]), [5], 3)
    torch.testing.assert_close(m.decode(x), after, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_the_saved_pipeline(family, qwen, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)  # the compile family samples eagerly here
    out = tmp_path / family
    assert main(_train_args(qwen, clip, out, family)) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert (out / "lora" / "pytorch_lora_weights.safetensors").exists()


def test_the_explorer_takes_a_stock_qwen_pipeline(qwen):
    """Other trainers' path: a stock QwenImagePipeline wrapped as it is, previews in NVFP4, the selected seeds'
    noise in the pipeline's packed layout, regenerated through the stock pipeline."""
    from solrl_engine.explore import Explorer

    pipe = _stock(qwen)
    ex = Explorer(pipe, lambda im, p: im.mean((1, 2, 3)), n=4, k=2, preview_steps=2, explore_precision="nvfp4",
                  resolution=SIZE, guidance_scale=1.0, batch_size=4)  # fmt: skip
    sel = ex.select(PROMPTS)
    assert len(sel.seeds) == 2 and sel.noise.shape == (4, 16, 64)  # 4 x 4 tokens of 2 x 2 x 16 features
    regen = sel.regenerate(pipe, steps=2, true_cfg_scale=1.0)
    assert regen.images.shape == (4, 3, SIZE, SIZE) and regen.rewards.shape == (2, 2)
    assert ex.copy is not None and len(ex.copy.report.quantized) == 24


def test_weights_loaded_as_another_family_name_the_family_that_fits(qwen: Path) -> None:
    """model=flux on Qwen-Image weights: the error names the model family whose pipeline they are."""
    with pytest.raises(ValueError, match="holds a QwenImagePipeline, not a FluxPipeline: set model=qwenimage"):
        load_model("flux", str(qwen))


def test_tokens_per_sample_are_the_packed_tokens_the_layers_see(qwen):
    """Qwen-Image packs 2x2 latent cells into a token (as FLUX): explore_precision=auto's probe rows
    (Rollouts.forward_rows) per image, one of the row counts its linear layers see (hooks)."""
    m = _model(qwen)
    _, h, w = m.latent_shape
    assert m.tokens_per_sample == h * w // 4 and m.tokens_per_sample in linear_rows(m)
