"""The kernel benchmark script runs end to end (tiny CPU sizes) and writes its JSON record."""

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_bench_writes_json(tmp_path, dtype):
    mod = load_bench("kernels")
    argv = ["--device", "cpu", "--shapes", "32x64", "--dtype", dtype, "--reps", "60", "--out", str(tmp_path)]
    path = mod.main(argv + ["--gemms", "16x32x64"])
    rec = json.loads(path.read_text())
    assert rec["info"]["device"] == "cpu" and rec["info"]["torch"]
    r = rec["results"][0]
    assert r["shape"] == [32, 64]
    for op in ("copy", "nvfp4_quantize_static_amax", "nvfp4_fake_quantize_static_amax", "fp8_quantize_rowwise"):
        assert r[op]["median_ms"] > 0 and r[op]["ratio_to_copy"] > 0
    assert r["nvfp4_quantize_static_amax"]["backend"] == "reference"
    g = rec["gemms"][0]
    assert g["gemm"] == [16, 32, 64] and g["bf16_mm"]["ratio_to_bf16"] == 1.0
    assert g["nvfp4_linear_w4a4"]["median_ms"] > 0 and g["nvfp4_linear_backend"] == "reference"
    assert "te_nvfp4_linear" in g["notes"]


def test_e2e_bench_runs_every_family_and_writes_ratios(tmp_path, monkeypatch):
    from solrl_engine import hw

    # the compiled CPU sampler has its own tests (test_cpu_runtime.py); a cold inductor compile here would
    # cost a minute, so the `compile` family samples eagerly (the fallback without a C++ compiler)
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    mod = load_bench("e2e")
    argv = ["--model", "tiny", "--iterations", "1", "--warmup", "0", "--n", "4", "--k", "2", "--prompts", "1"]
    path = mod.main(argv + ["--explore-precision", "nvfp4", "--out", str(tmp_path)])
    rec = json.loads(path.read_text())
    assert set(rec["results"]) == {"naive_scaling", "compile", "naive_quant", "sol_rl"}
    for r in rec["results"].values():
        assert r["time_total_s"] >= r["time_explore_s"] > 0
    sol = rec["results"]["sol_rl"]
    assert sol["time_regen_s"] > 0 and sol["explore_recipe"] == "nvfp4+rht128+4o6"  # the tiny preset's recipe
    assert rec["ratios"]["compile"]["rollout_speedup_vs_compile"] == 1.0
    assert rec["configs"]["sol_rl"]["n"] == 4


def test_sass_counter_compiles_the_gemms_for_sm90a(tmp_path):
    """The static SASS proxy (bench/sass.py) compiles every GEMM config for sm_90a on a CPU."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("this Triton wheel ships no nvdisasm")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compilation, own process
    cmd = [sys.executable, str(ROOT / "bench" / "sass.py"), "--out", str(tmp_path)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    rec = json.loads(next(tmp_path.glob("*-sm90a-sass.json")).read_text())
    kinds = {r["kernel"] for r in rec["rows"]}
    assert kinds == {"w4a4", "w4a16_bf16", "w4a16_fp16"}
    assert all(r["loop_instructions"] > 0 for r in rec["rows"])


def test_reward_terms_averages_each_term_over_the_prompts_it_applies_to():
    mod = load_bench("reward_terms")
    from solrl_engine.evaluation import generate
    from solrl_engine.models.tiny import load_tiny
    from solrl_engine.rewards import shapes

    prompts = ["a green triangle", "a red circle to the left of a blue square", "a purple square above a red circle"]
    out, rewards = mod.terms(None, prompts, 2, 2)
    ps = [p for p in prompts for _ in range(2)]
    d = shapes.score(generate(load_tiny(), ps, [0, 1] * 3, 2), ps, details=True)
    assert torch.allclose(rewards, d["reward"])
    assert out["images"] == 6 and out["two_object_images"] == 4 and out["relation_images"] == 4
    # the second object's terms and the relation only over the four two-object images, not the empty slot
    assert out["presence"] == pytest.approx([d["presence"][:, 0].mean().item(), d["presence"][2:, 1].mean().item()])
    assert out["relation"] == pytest.approx(d["relation"][2:].mean().item())
    assert out["clutter"] == pytest.approx(d["clutter"].mean().item())


def test_quickstart_sweep_summarizes_a_run_and_plots_recorded_rows(tmp_path):
    qs = load_bench("quickstart_sweep")
    assert qs.parse_row("lr:lr=3e-3| iterations=40") == ("lr", ["lr=3e-3", "iterations=40"])
    assert qs.parse_row("base:") == ("base", [])
    with pytest.raises(SystemExit, match="NAME:SET"):
        qs.parse_row(":lr=1")
    run = tmp_path / "run"
    run.mkdir()
    times = {"time_explore_s": 2.0, "time_regen_s": 1.0, "time_train_s": 1.0, "time_total_s": 4.0}
    recs = [{"iter": 1, "reward_mean": 0.3, "proxy_spearman": 0.8, **times},
            {"iter": 2, "reward_mean": 0.4, "proxy_spearman": 0.6, **times, "time_total_s": 6.0,
             "heldout_reward": 0.35, "heldout_stderr": 0.02, "heldout_gain": 0.05, "heldout_gain_stderr": 0.01,
             "train_prompt_reward": 0.31}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(json.dumps({
        "heldout_reward_start": 0.3, "heldout_reward_final": 0.35, "heldout_gain_final": 0.05,
        "heldout_gain_stderr_final": 0.01, "explore_recipe": "policy (float32)"}))  # fmt: skip
    s = qs.summarize(run)
    assert s["heldout"] == [{"iter": 2, "reward": 0.35, "stderr": 0.02, "gain": 0.05, "gain_stderr": 0.01,
                             "train_prompt_reward": 0.31, "train_time_s": 10.0}]  # fmt: skip
    assert s["s_per_iter"]["time_total_s"] == 5.0 and s["proxy_spearman_mean"] == pytest.approx(0.7)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": {"ok": {"sets": [], **s}, "failed": {"sets": ["lr=9"], "error": "boom"}}}))
    png = qs.main(["--plot", str(tmp_path / "gains.png"), "--from", str(sweep)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({"rows": {"failed": {"sets": [], "error": "boom"}}}))
    with pytest.raises(SystemExit, match="no row with a held-out curve"):
        qs.plot([str(failed)], tmp_path / "x.png")
    with pytest.raises(SystemExit, match="--from"):
        qs.main(["--plot", str(tmp_path / "y.png")])


def test_compile_time_bench_compiles_a_cold_regional_block_in_a_fresh_process():
    from solrl_engine.hw import cpu_compile_available

    if not cpu_compile_available()[0]:
        pytest.skip("inductor needs a C++ compiler on a CPU")
    mod = load_bench("compile_time")
    r = mod.measure(1, "regional", 1)
    assert "error" not in r, r.get("error")
    assert r["compile_s"] > r["second_call_s"] > 0 and r["graphs"] == 1 == r["census"]["graphs"]


def test_same_metrics_compare_finds_a_changed_value_and_a_lost_field_but_not_a_new_one(tmp_path, capsys):
    mod = load_bench("same_metrics")

    def write(name: str, presets: dict) -> Path:
        p = tmp_path / name
        p.write_text(json.dumps({"engine": name, "presets": presets}))
        return p

    row = {"iter": 1, "loss": 0.25, "reward_mean": 0.5}
    before = write("a", {"sol_rl": {"metrics": [row], "lora": "ab12"}, "fidelity": {"spearman_mean": 0.9}})
    same = write("b", {"sol_rl": {"metrics": [dict(row)], "lora": "ab12"}, "fidelity": {"spearman_mean": 0.9}})
    assert mod.compare(before, same) == 0 and "identical, bit for bit" in capsys.readouterr().out
    added = write("c", {"sol_rl": {"metrics": [row], "lora": "ab12"},
                        "fidelity": {"spearman_mean": 0.9, "explore_attention": "bf16"}})  # fmt: skip
    assert mod.compare(before, added) == 0
    assert "not compared: fidelity.explore_attention" in capsys.readouterr().out
    changed = write("d", {"sol_rl": {"metrics": [{**row, "loss": 0.2500001}], "lora": "ab12"},
                          "fidelity": {"spearman_mean": 0.9}})  # fmt: skip
    assert mod.compare(before, changed) == 1 and "metrics row 1 differs: {'loss'" in capsys.readouterr().out
    assert mod.compare(added, before) == 1  # a field the newer tree stopped reporting is a difference


def test_objective_fidelity_measures_every_previews_x_objective_pairing(tmp_path):
    mod = load_bench("objective_fidelity")
    path = mod.main(["--prompts", "1", "--n", "4", "--k", "2", "--set", "full_steps=4", "--set", "preview_steps=1",
                     "--out", str(tmp_path)])  # fmt: skip
    rec = json.loads(path.read_text())
    got = {(r["previews"], r["objective"], r["coupled"]) for r in rec["pairings"]}
    assert got == {(p, o, False) for p in ("dpm2", "flow_sde") for o in ("nft", "flow_grpo", "flow_grpo_fast")} | {
        ("flow_sde_coupled", o, True) for o in ("flow_grpo", "flow_grpo_fast")}  # fmt: skip
    assert all(-1 <= r["spearman_mean"] <= 1 for r in rec["pairings"])
    finals = {r["objective"]: r["full_reward_mean"] for r in rec["pairings"] if r["previews"] == "dpm2"}
    assert finals["flow_grpo"] != finals["nft"]  # the SDE's finals are other samples than the ODE's


def test_convergence_speedup_is_over_the_named_baseline():
    mod = load_bench("convergence")

    def curve(*pts):  # noqa: ANN002, ANN202
        return [{"train_s": t, "reward": r, "gain": r - 0.3, "gain_stderr": 0.01} for t, r in pts]

    base = curve((0, 0.3), (10, 0.32), (20, 0.35), (30, 0.34))
    sol = curve((0, 0.3), (5, 0.36), (10, 0.37))
    got = mod.speedup(sol, base, "naive_scaling")
    assert got["naive_scaling_best_reward"] == 0.35 and got["naive_scaling_time_s"] == 20 and got["speedup"] == 4.0
    assert got["sol_rl_final_gain"] == pytest.approx(0.07) and got["naive_scaling_final_gain"] == pytest.approx(0.04)
    flat = mod.speedup(sol, curve((0, 0.3), (10, 0.29)), "naive_scaling")
    assert flat["speedup"] is None and "never rose" in flat["note"]
