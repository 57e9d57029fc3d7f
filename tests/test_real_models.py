"""Real pipelines end to end: tiny random-weight SD3 / FLUX / SANA pipelines of the real diffusers
classes (tests/tiny_pipelines.py), saved with save_pretrained and loaded through the same
`from_pretrained` code a user's weights go through; `solrl train` on each for two sol_rl
iterations with a tiny CLIPModel as the clipscore reward; the exported LoRA loaded into the stock
pipeline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from cpu_branches import BRANCHES, assert_close, force_cpu_bf16
from tiny_pipelines import SIZES, build_clip_reward, build_flux, build_sana, build_sd3, linear_rows

from solrl_engine.cli import load_lora_into, main
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.nn import plan_quantization
from solrl_engine.quant import get_recipe
from solrl_engine.rl.export import load_lora

BUILDERS = {"sd3": build_sd3, "flux": build_flux, "sana": build_sana}
PRESET = {"sd3": "configs/sd3.py:sd3_sol_rl_clipscore", "flux": "configs/flux1.py:flux1_sol_rl_clipscore",
          "sana": "configs/sana.py:sana_sol_rl_clipscore"}  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipes")
    out = {name: build(root / name) for name, build in BUILDERS.items()}
    out["clip"] = build_clip_reward(root / "clip")
    return out


def _tiny_run(name: str, pipes: dict[str, Path], out: Path, family: str = "sol_rl") -> list[str]:
    return [
        f"model_path={pipes[name]}", f"resolution={SIZES[name]}", f"reward_args=clipscore.model={pipes['clip']}",
        f"family={family}", "n=4", "k=2", "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2",
        "eval_prompt_count=2", "eval_seeds=1", "eval_every=2", "save_every=1", "rollout_batch_size=8",
        "train_batch_size=4", "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu",
        "decode_batch_size=3",
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_solrl_train_on_a_saved_pipeline_and_load_its_lora_into_the_stock_pipeline(name, pipes, tmp_path):
    out = tmp_path / "run"
    args = ["train", str(ROOT / PRESET[name]), "--output", str(out)]
    for s in _tiny_run(name, pipes, out):
        args += ["--set", s]
    assert main(args) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2]
    assert all(r["proxy_spearman"] is not None and r["loss"] == r["loss"] for r in recs)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    # the explore copy quantized exactly the layers the family's NVFP4 rule names: the report's count, its
    # per-layer lines and an independent plan of the saved transformer agree, and the count is not zero
    quant = (out / "quantization.txt").read_text()
    head = re.match(r"quantize_model\[nvfp4\]: (\d+) of (\d+) Linear layers quantized", quant)
    assert head, quant[:300]
    done = int(head[1])
    assert done == sum(line.startswith("  quantized ") for line in quant.splitlines())
    base = load_model(name, pipes[name], "cpu", torch.float32, resolution=SIZES[name])
    want = plan_quantization(base.transformer, get_recipe("nvfp4").with_(**model_spec(name).explore_rule))
    assert done == len(want.quantized) > 0
    for d in ("lora", "lora_ema"):
        assert (out / d / "pytorch_lora_weights.safetensors").exists()

    import diffusers

    spec = model_spec(name)
    pipe = getattr(diffusers, spec.pipeline).from_pretrained(pipes[name], torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kw = {"use_resolution_binning": False} if name == "sana" else {}

    def images() -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return pipe("a red apple", num_inference_steps=2, height=SIZES[name], width=SIZES[name], generator=g,
                    output_type="pt", guidance_scale=1.0, **kw).images  # fmt: skip

    before = images()
    load_lora(pipe, out / "lora")  # pipe.load_lora_weights, after the adapter is checked against its manifest
    after = images()
    assert before.shape == after.shape and torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-4  # the trained adapter changes what the stock pipeline draws
    scaling = {v for m in pipe.transformer.modules() if hasattr(m, "scaling") for v in m.scaling.values()}
    assert scaling == {2.0}  # alpha / rank = 8 / 4 travelled with the weights


@pytest.mark.parametrize("branch", BRANCHES)
def test_exported_lora_reproduces_the_policy_in_the_stock_transformer(pipes, tmp_path, monkeypatch, branch):
    """The exported EMA adapter, loaded by diffusers into the base model at the policy's dtype, gives
    the trainer's EMA velocity (exactly in FP32; to BF16 rounding where the CPU picks BF16)."""
    from solrl_engine.rl.config import load_config
    from solrl_engine.rl.trainer import Trainer

    dtype = force_cpu_bf16(monkeypatch, branch == "bf16")
    cfg = load_config(str(ROOT / PRESET["sd3"]), _tiny_run("sd3", pipes, tmp_path) + [f"output={tmp_path}"])
    tr = Trainer(cfg, progress=False)
    assert tr.rollouts.dtype == dtype
    tr.step()
    tr.export()
    x = torch.randn(2, *tr.model.latent_shape)  # FP32 latents, no autocast: cast to the model's dtype
    cond = tr.model.encode_prompts(["a red apple", "a blue cup"])
    t = torch.tensor([0.7, 0.3])
    with torch.no_grad(), tr.adapters.ema_weights():
        want = tr.model.velocity(x, t, cond)
    fresh = load_model("sd3", pipes["sd3"], dtype=dtype, resolution=SIZES["sd3"])
    load_lora_into(fresh.transformer, str(tmp_path / "lora_ema"))  # what `solrl eval --lora` does
    with torch.no_grad():
        got = fresh.velocity(x, t, cond)
        plain = load_model("sd3", pipes["sd3"], dtype=dtype, resolution=SIZES["sd3"]).velocity(x, t, cond)
    assert got.dtype == want.dtype == dtype
    assert (want - plain).abs().max() > 1e-5  # the adapter is not a no-op ...
    assert_close(got, want, dtype)  # ... and it survives export and reload


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_bf16_pipeline_model_takes_fp32_latents_outside_autocast(name, pipes):
    """FlowModel.velocity casts its latents to the transformer's dtype, as the stock pipelines do: a
    BF16 model called with FP32 latents and no autocast (a user's own code) computes in BF16 instead
    of failing in the patch embedding (SD3, SANA: a conv) or the input projection (FLUX: a linear)."""
    f32 = load_model(name, pipes[name], dtype=torch.float32, resolution=SIZES[name])
    b16 = load_model(name, pipes[name], dtype=torch.bfloat16, resolution=SIZES[name])
    torch.manual_seed(0)
    x, t = torch.randn(2, *b16.latent_shape), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        cond = f32.encode_prompts(["a red apple", "a blue cup"])  # FP32 conditioning too
        want = f32.velocity(x, t, cond)
        got = b16.velocity(x, t, cond)
        assert got.dtype == torch.bfloat16 and torch.equal(got, b16.velocity(x.bfloat16(), t, cond.to(torch.bfloat16)))
    # BF16 rounding only: under 1% for SD3 and SANA on these random weights, 4-6% for FLUX (5.8% with
    # diffusers 0.35.2, 3.7% with 0.42); a different computation would be off by about 100%
    assert (got.float() - want).norm() / want.norm() < 0.1


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_explore_copy_quantizes_the_family_rule(name, pipes):
    model = load_model(name, pipes[name], dtype=torch.float32, resolution=SIZES[name])
    spec = model_spec(name)
    ex = ExploreCopy(model.transformer, "nvfp4", changes=spec.explore_rule)
    q = ex.report.quantized
    assert q, ex.report
    if name == "sd3":
        assert all(n.startswith("transformer_blocks.") and ".ff." in n for n in q)
    if name == "sana":
        assert any(n.endswith("ff.conv_inverted") for n in q) and any(n.endswith("ff.conv_point") for n in q)
        assert any(n.endswith("attn2.to_k") for n in q) and not any(".attn1." in n for n in q)
    if name == "flux":
        assert any(n.startswith("single_transformer_blocks.") and n.endswith("proj_out") for n in q)
        assert not any(n.endswith("norm.linear") or n == "proj_out" for n in q)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_model_follows_the_pipeline_schedule_latents_and_decode(name, pipes):
    """Our sampler with the pipeline's scheduler sigmas equals the stock pipeline's output: Euler for
    SD3 / FLUX's FlowMatchEuler, and for SANA both its native DPM-Solver++ 2M and a swapped-in Euler."""
    import diffusers

    from solrl_engine.sampling import sample

    model = load_model(name, pipes[name], dtype=torch.float32, resolution=SIZES[name])
    pipe = model.pipe
    steps = 3
    cond = model.encode_prompts(["a red apple"])
    kw = {"use_resolution_binning": False} if name == "sana" else {}

    def stock() -> torch.Tensor:
        g = torch.Generator().manual_seed(7)
        return pipe("a red apple", num_inference_steps=steps, height=SIZES[name], width=SIZES[name], generator=g,
                    output_type="pt", guidance_scale=1.0 if name != "flux" else 3.5, **kw).images.float()  # fmt: skip

    solver = "dpm2" if name == "sana" else "euler"
    ours = model.decode(sample(model, cond, [7], steps, solver=solver))
    torch.testing.assert_close(ours, stock(), rtol=1e-4, atol=1e-4)
    if name == "sana":
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
        ours = model.decode(sample(model, cond, [7], steps, solver="euler"))
        torch.testing.assert_close(ours, stock(), rtol=1e-4, atol=1e-4)


def test_sanas_guidance_contrasts_against_the_pipelines_negative_prompt(pipes):
    """SanaPipeline encodes its negative prompt "" without the complex human instruction it puts before every
    prompt: with guidance on, the engine's unconditional states are those, and its sample is the stock pipeline's.
    (Against "" encoded with the instruction, the image differs: the check can fail.)"""
    from solrl_engine.sampling import sample

    model = load_model("sana", pipes["sana"], dtype=torch.float32, resolution=SIZES["sana"])
    cond, g = model.encode_prompts(["a red apple"]), 4.5
    g7 = torch.Generator().manual_seed(7)
    stock = model.pipe("a red apple", num_inference_steps=3, height=SIZES["sana"], width=SIZES["sana"], generator=g7,
                       output_type="pt", guidance_scale=g, use_resolution_binning=False).images.float()  # fmt: skip
    ours = model.decode(sample(model, cond, [7], 3, solver="dpm2", guidance_scale=g,
                               uncond=model.encode_unconditional()))  # fmt: skip
    torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-4)
    wrong = model.decode(sample(model, cond, [7], 3, solver="dpm2", guidance_scale=g,
                                uncond=model.encode_prompts([""])))  # fmt: skip
    assert (wrong - stock).abs().max() > 1e-2


def test_missing_model_path_fails_with_the_path_and_no_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", str(ROOT / PRESET["sd3"]), "--output", str(tmp_path / "o"),
              "--set", f"model_path={tmp_path / 'nope'}"])  # fmt: skip
    assert str(tmp_path / "nope") in str(e.value) and "does not exist" in str(e.value)


def test_solrl_eval_and_sample_with_a_trained_lora_and_tensorboard_logs(pipes, tmp_path, capsys):
    out = tmp_path / "run"
    sets = _tiny_run("sana", pipes, out) + ["log_with=tensorboard", "iterations=1", "eval_every=1"]
    args = ["train", str(ROOT / PRESET["sana"]), "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # scalars and the eval grid
    common = [f"--set={s}" for s in _tiny_run("sana", pipes, out)]
    ev = tmp_path / "eval"
    assert main(["eval", str(ROOT / PRESET["sana"]), "--lora", str(out / "lora_ema"), "--prompts", "sample/test",
                 "--max-prompts", "3", "--seeds", "2", "--output", str(ev), *common]) == 0  # fmt: skip
    res = json.loads((ev / "eval.json").read_text())
    assert res["n"] == 6 and res["reward_stderr"] >= 0 and (ev / "grid.png").exists()
    assert len((ev / "samples.jsonl").read_text().splitlines()) == 6
    base = tmp_path / "base"
    assert main(["eval", str(ROOT / PRESET["sana"]), "--prompts", "sample/test", "--max-prompts", "3",
                 "--seeds", "2", "--output", str(base), *common]) == 0  # fmt: skip
    assert json.loads((base / "eval.json").read_text())["reward_mean"] != res["reward_mean"]  # the LoRA is used
    grid = tmp_path / "g.png"
    assert main(["sample", "--config", str(ROOT / PRESET["sana"]), *common, "--lora", str(out / "lora"),
                 "--prompt", "a red apple", "--seeds", "0-1", "--out", str(grid)]) == 0  # fmt: skip
    assert grid.exists()
    with pytest.raises(SystemExit, match="pytorch_lora_weights"):
        main(["eval", str(ROOT / PRESET["sana"]), "--lora", str(tmp_path), *common])


def test_a_missing_reward_weight_fails_before_the_model_loads(pipes, tmp_path):
    args = ["train", str(ROOT / PRESET["sd3"]), "--output", str(tmp_path / "o")]
    for s in _tiny_run("sd3", pipes, tmp_path) + [f"reward_args=clipscore.model={tmp_path / 'no-clip'}"]:
        args += ["--set", s]
    with pytest.raises(SystemExit, match="no-clip"):
        main(args)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_tokens_per_sample_are_the_image_tokens_the_layers_see(pipes, name):
    """explore_precision=auto times its layers at the rollouts' token rows (Rollouts.forward_rows): the count
    must be one the transformer's linear layers really see per sample (FLUX packs 2x2 latent cells into
    one token; SD3 patches 2x2; SANA's patch is 1), measured by hooks, not restated."""
    m = load_model(name, pipes[name], "cpu", torch.float32, resolution=SIZES[name])
    seen = linear_rows(m)
    c, h, w = m.latent_shape
    assert m.tokens_per_sample in seen and m.tokens_per_sample == {"sana": h * w, "sd3": h * w // 4,
                                                                   "flux": h * w // 4}[name], (name, seen)  # fmt: skip
