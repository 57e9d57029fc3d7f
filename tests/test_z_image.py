"""Z-Image through the engine, on a tiny random-weight ZImagePipeline of the real classes (tests/tiny_pipelines.py)
saved and loaded as a user's weights are: a seed is the latent the stock pipeline draws, prompts are encoded as the
pipeline encodes them (each its own length), the engine's sample equals the stock pipeline's for the same seed with
and without guidance (the pipeline's g is the engine's g + 1), rollouts sample without captured graphs, the
explore copy quantizes the per-token linears, every family trains through `solrl train`, and the exported LoRA
loads into the stock pipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import LATENT_SHAPES, MAX_SEQUENCE_LENGTH, SIZES, build_clip_reward, build_z_image, linear_rows

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample, seeded_noise

SIZE, TOKENS = SIZES["z_image"], MAX_SEQUENCE_LENGTH["z_image"]
PROMPTS = ["a red apple", "a photo of a blue car on the table"]  # different lengths: different sequences
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_z_image(tmp_path_factory.mktemp("z_image") / "zi")


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("ziclip") / "clip")


def _stock(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The saved pipeline as a user loads it: the generic entry point picks the class from model_index.json."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model("z_image", path, "cpu", dtype, resolution=SIZE, max_sequence_length=TOKENS)


def _call(pipe: Any, prompts: list[str], seeds: list[int], steps: int, guidance: float) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return pipe(prompt=prompts, height=SIZE, width=SIZE, num_inference_steps=steps, guidance_scale=guidance,
                generator=gens, output_type="pt", max_sequence_length=TOKENS).images.float()  # fmt: skip


def test_the_tiny_pipeline_is_the_real_classes(zi):
    pipe = _stock(zi)
    names = {k: type(v).__name__ for k, v in pipe.components.items()}
    assert names == {"transformer": "ZImageTransformer2DModel", "vae": "AutoencoderKL", "text_encoder": "Qwen3Model",
                     "tokenizer": "Qwen2Tokenizer", "scheduler": "FlowMatchEulerDiscreteScheduler"}  # fmt: skip
    assert type(pipe).__name__ == "ZImagePipeline"


def test_prompts_are_encoded_as_the_pipeline_encodes_them(zi):
    """The pipeline hands the transformer each prompt's own tokens; the cache holds them padded with a mask."""
    m = _model(zi)
    theirs, _ = m.pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=TOKENS)
    cond = m.encode_prompts(PROMPTS)
    assert cond.hidden.shape == (2, TOKENS, 32) and cond.pooled is None
    lengths = cond.mask.sum(1).tolist()
    assert lengths == [len(e) for e in theirs] and lengths[0] != lengths[1]
    for i, e in enumerate(theirs):
        assert torch.equal(cond.hidden[i, : lengths[i]], e) and not cond.hidden[i, lengths[i] :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_sample_is_the_stock_pipelines_for_the_same_seed(zi, dtype):
    """Euler on the pipeline's sigmas, without guidance and at the model card's guidance 4 (the engine's 5 against
    the same empty prompt): the stock pipeline's images (FP32 to 1e-5; BF16 to its rounding)."""
    m = _model(zi, dtype)
    seeds, steps = [3, 11], 4
    pipe = _stock(zi, dtype)
    noise = pipe.prepare_latents(2, 16, SIZE, SIZE, torch.float32, "cpu", [torch.Generator().manual_seed(s)
                                                                          for s in seeds])  # fmt: skip
    assert torch.equal(noise, seeded_noise(seeds, m.latent_shape))  # a seed is the stock pipeline's latent
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for g in (0.0, 4.0):
        x = sample(m, m.encode_prompts(PROMPTS), seeds, steps, guidance_scale=g + 1, uncond=m.encode_unconditional(),
                   dtype=torch.float32)  # fmt: skip
        torch.testing.assert_close(m.decode(x), _call(pipe, PROMPTS, seeds, steps, g), atol=tol, rtol=0)
    if dtype == torch.float32:  # the engine's scale given to the pipeline as it is: another image
        off = _call(pipe, PROMPTS, seeds, steps, 5.0)
        assert (m.decode(x) - off).abs().max() > 100 * tol
    assert model_spec("z_image").guidance_scale == 5.0 and model_spec("z_image").pipeline_guidance_offset == 1.0


def test_rollouts_sample_without_captured_graphs_on_a_gpu(zi, caplog):
    """Each prompt's token count is read on the host in every forward: a captured graph would freeze it. On a CUDA
    device the rollouts sample Z-Image eagerly (and say why), a capturable family through its graphs; on a CPU both
    may compile (inductor breaks the graph at the host read)."""
    from solrl_engine.sampling.rollouts import compiled_sampling

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with caplog.at_level("INFO", logger="solrl_engine"):
        assert compiled_sampling(model_spec("z_image"), cuda, None) is False
    assert "z_image's forward reads values on the host" in caplog.text
    assert compiled_sampling(model_spec("z_image"), cuda, True) is False
    assert compiled_sampling(model_spec("sana_video"), cuda, None) is True
    assert compiled_sampling(model_spec("z_image"), cpu, True) is True and not compiled_sampling(model_spec("z_image"),
                                                                                                 cpu, None)  # fmt: skip
    lengths: list[list[int]] = []
    m = _model(zi)
    tolist = torch.Tensor.tolist
    try:  # the host read the reason is about: one per forward, the prompts' own lengths
        torch.Tensor.tolist = lambda self: (lengths.append(tolist(self)), tolist(self))[1]  # type: ignore[method-assign]
        m.velocity(torch.randn(2, *m.latent_shape), torch.tensor([0.5, 0.5]), m.encode_prompts(PROMPTS))
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    assert lengths and lengths[0] == m.encode_prompts(PROMPTS).mask.sum(1).tolist()


def test_the_explore_copy_quantizes_the_per_token_linears(zi):
    m = _model(zi)
    copy = ExploreCopy(m.transformer, "nvfp4", changes=model_spec("z_image").explore_rule)
    q = set(copy.report.quantized)
    for block in ("layers.0", "layers.1", "noise_refiner.0", "context_refiner.1"):
        assert {f"{block}.attention.to_q", f"{block}.attention.to_out.0", f"{block}.feed_forward.w2"} <= q
    assert not any("adaLN" in n or "embedder" in n or "final_layer" in n for n in q)
    names = [n for n, _ in m.transformer.named_modules()]
    for target in model_spec("z_image").lora_targets:
        hits = [n for n in names if n.endswith(target)]
        assert len(hits) == 6 and all(isinstance(m.transformer.get_submodule(n), torch.nn.Linear) for n in hits)


def _train_args(zi: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={zi}", f"resolution={SIZE}", f"reward_args=clipscore.model={clip}", f"n={n}", "k=2",
            "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2", "eval_prompt_count=2",
            "eval_seeds=1", "eval_every=2", "save_every=2", "rollout_batch_size=8", "train_batch_size=2",
            "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4",
            *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/z_image.py:z_image_{family}_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_exports_a_lora_the_stock_pipeline_loads(zi, clip, tmp_path, monkeypatch):
    """Two sol_rl iterations (guidance 5.0, the preset's) through the CLI; the exported adapter, loaded by
    ZImagePipeline.load_lora_weights, changes the stock pipeline's image, and the stock pipeline with it draws what
    the engine draws with the same adapter for the same seed."""
    from solrl_engine import hw
    from solrl_engine.cli import load_lora_into, main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train_args(zi, clip, out, "sol_rl", "save_every=1")) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    pipe = _stock(zi)
    before = _call(pipe, ["a red apple"], [5], 3, 4.0)
    pipe.load_lora_weights(str(out / "lora"))  # as a user loads it (the engine's load_lora checks a manifest first)
    after = _call(pipe, ["a red apple"], [5], 3, 4.0)
    assert (after - before).abs().max() > 1e-3  # the trained adapter changes the stock pipeline's image
    m = _model(zi)
    load_lora_into(m.transformer, str(out / "lora"))
    x = sample(m, m.encode_prompts(["a red apple"]), [5], 3, guidance_scale=5.0, uncond=m.encode_unconditional())
    torch.testing.assert_close(m.decode(x), after, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_the_saved_pipeline(family, zi, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)  # the compile family samples eagerly here
    out = tmp_path / family
    assert main(_train_args(zi, clip, out, family)) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert (out / "lora" / "pytorch_lora_weights.safetensors").exists()


def test_the_explorer_takes_a_stock_pipeline_and_regenerates_at_its_guidance(zi):
    """Other trainers' path: a stock ZImagePipeline wrapped as it is; the regeneration passes the pipeline's own
    guidance (the engine's 5.0 is its 4.0) and draws what the engine's full-precision sample draws."""
    from solrl_engine.explore import Explorer

    pipe = _stock(zi)
    ex = Explorer(pipe, lambda im, p: im.mean((1, 2, 3)), n=4, k=2, preview_steps=2, explore_precision="nvfp4",
                  resolution=SIZE, batch_size=4)  # fmt: skip
    assert ex.pipeline_guidance == 4.0
    sel = ex.select(PROMPTS)
    assert len(sel.seeds) == 2 and sel.noise.shape == (4, *LATENT_SHAPES["z_image"])
    regen = sel.regenerate(pipe, steps=2, max_sequence_length=TOKENS)
    assert regen.images.shape == (4, 3, SIZE, SIZE) and regen.rewards.shape == (2, 2)
    m = _model(zi)
    flat = [p for p, s in zip(PROMPTS, sel.seeds, strict=True) for _ in s]
    x = sample(m, m.encode_prompts(flat), [s for row in sel.seeds for s in row], 2, guidance_scale=5.0,
               uncond=m.encode_unconditional())  # fmt: skip
    torch.testing.assert_close(m.decode(x), regen.images, atol=1e-5, rtol=0)


def test_tokens_per_sample_are_the_image_tokens_the_layers_see(zi):
    m = _model(zi)
    _, h, w = m.latent_shape
    assert h * w // 4 == 16 and m.tokens_per_sample == 32  # padded to the transformer's multiple of 32
    assert m.tokens_per_sample in linear_rows(m)
