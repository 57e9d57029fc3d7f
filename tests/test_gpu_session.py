"""bench/gpu_session.py's smoke mode: every stage runs on the CPU with tiny shapes and writes its part of the
JSON (forwards, the torchao peer, each copy's refresh, one nft_update), a budget too small for the later
stages skips them and says so, and the summary prints. The smoke run is shared by the tests that read it."""

import contextlib
import importlib.util
import io
import json
import math

import pytest
from bench_scripts import load_bench

MODELS = ("sana-1.6b", "sd35-large", "flux-dev")


@pytest.fixture(scope="module")
def session():
    return load_bench("gpu_session")


@pytest.fixture(scope="module")
def smoke(session, tmp_path_factory):
    """One smoke run of every stage: (returned record, the JSON on disk, what it printed)."""
    out_dir = tmp_path_factory.mktemp("gpu-session")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rec = session.main(["--smoke", "--stages", "0,1,2,3,4", "--budget", "600", "--out", str(out_dir)])
    return rec, json.loads((out_dir / "gpu_session.json").read_text()), printed.getvalue()


def _positive(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0 and math.isfinite(v)


def test_smoke_runs_every_stage_and_writes_each_part(smoke):
    rec, saved, out = smoke
    assert saved["stages"].keys() == {"0", "1", "2", "3", "4"} and not saved["skipped"]
    s0 = saved["stages"]["0"]
    assert "error" not in s0, s0.get("traceback")
    assert s0["ceilings"]["copy"]["gb_per_s"] > 0 and s0["ceilings"]["bf16_mm"]["tflops"] > 0
    for fmt in ("fp8", "int8", "nvfp4"):  # the CPU runs every layer on the reference, and the record says so
        fp = s0["fast_path_small"][fmt]
        assert fp["layers"] > 0 and fp["fast"] + fp["reference"] == fp["layers"], fp
    for key, model in zip(("1", "2", "3"), MODELS, strict=True):
        s = saved["stages"][key]
        assert s.get("model") == model and "partial" not in s, s.get("error")
        p = s["precisions"]
        assert "nvfp4" in p and "FP4" in p["nvfp4"]["skipped"]  # no CPU FP4 GEMM without a simulated sm_100
        for fmt in ("bf16", "fp8", "int8"):
            e = p[fmt]
            assert "error" not in e, e.get("traceback")
            assert e["eager_ms"] > 0 and e["compiled"]["forward_ms"] > 0, e.get("compiled")
            shares = e["profile_eager"]["share"]
            assert sum(shares.values()) == pytest.approx(1.0) and shares["bf16_gemm"] > 0
            if fmt != "bf16":
                assert e["fast_path"]["layers"] == len(e["quantized_layers"]) > 0
            # compiled as the sampler compiles: the repeated blocks in place, each compiled graph's GEMMs counted
            c = e["compiled"]
            assert c["regional_blocks"] > 0 and c["census"]["graphs"] >= 1, c
            # no simulated GPU here: a quantized layer runs the reference, an opaque op (only `cuda` is traced)
            assert c["census"]["traced"] == 0 and (c["census"]["opaque"] > 0) == (fmt != "bf16"), c["census"]
        # INT8 widens the family rule (every eligible layer); FP8 keeps it, except FLUX whose rule is every layer
        assert len(p["int8"]["quantized_layers"]) >= len(p["fp8"]["quantized_layers"])
        it = s["iteration"]["eager/fp8"]
        assert it["sol_rl_vs_naive_scaling"] == pytest.approx(it["naive_scaling_s"] / it["sol_rl_s"])
        assert s["predicted"]["forward_ms"]["bf16"]["eager"] > 0
    assert len(saved["stages"]["1"]["precisions"]["int8"]["quantized_layers"]) > len(
        saved["stages"]["1"]["precisions"]["fp8"]["quantized_layers"]
    )  # fmt: skip  (SANA's rule is narrower)
    assert rec["summary"] == saved["summary"]
    for line in ("ceilings", "sana-1.6b  fp8", "sd35-large int8", "flux-dev   bf16", "vs torchao", "wrote"):
        assert line in out


def test_smoke_times_one_update_and_each_refresh_and_counts_them_per_iteration(session, smoke):
    _, saved, out = smoke
    for key, model in zip(("1", "2", "3"), MODELS, strict=True):
        s = saved["stages"][key]
        upd, ts = s["nft_update"], s["train_settings"]
        assert "error" not in upd, upd.get("traceback")
        assert _positive(upd["ms"]) and upd["batch"] == ts["batch"] == session.TINY_BATCH
        assert upd["checkpointing"] is (model == "flux-dev")  # the FLUX preset trains with checkpointing
        assert upd["calls"] == 3  # one warm-up + 2 timed
        for fmt in ("fp8", "int8"):
            e = s["precisions"][fmt]
            assert "error" not in e.get("refresh", {}), e["refresh"].get("traceback")
            assert _positive(e["refresh_ms"]) and _positive(e["refresh"]["requantize_all_ms"])
            assert e["refresh"]["layers"] > 0 and e["refresh"]["requantize_all_layers"] == len(e["quantized_layers"])
        tr = s["iteration"]["training"]
        n_t = max(1, int(10 * ts["timestep_fraction"]))
        assert tr["update_batches"] == n_t * math.ceil(24 * 6 / ts["batch"]) and "left_out" not in tr
        for mode in ("eager", "compiled"):
            it = s["iteration"][f"{mode}/int8"]
            assert _positive(it["train_s"]) and _positive(it["refresh_s"]) and it["refresh_measured"]
            assert it["train_s"] == pytest.approx(tr["update_batches"] * upd["ms"] / 1e3)
            assert it["refresh_s"] == pytest.approx(s["precisions"]["int8"]["refresh_ms"] / 1e3)
            assert it["sol_rl_total_s"] == pytest.approx(it["sol_rl_s"] + it["train_s"])
            assert it["naive_scaling_total_s"] == pytest.approx(it["naive_scaling_s"] + it["train_s"])
        pr = s["predicted"]
        assert _positive(pr["update_ms"]["predicted"]) and pr["update_ms"]["measured"] == upd["ms"]
        assert _positive(pr["iteration_eager/fp8"]["train_s"]) and _positive(pr["forward_ms"]["fp8"]["refresh_ms"])
        assert f"{model:<11}train nft_update" in out


def test_smoke_times_the_torchao_peer_on_the_same_layers(smoke):
    _, saved, _ = smoke
    installed = importlib.util.find_spec("torchao") is not None
    for key in ("1", "2", "3"):
        p = saved["stages"][key]["precisions"]
        ao = p["int8"]["torchao"]
        if not installed:  # both peers say why, with the install command
            for fmt in ("fp8", "int8"):
                assert "does not import" in p[fmt]["torchao"]["skipped"] and "[peers]" in p[fmt]["torchao"]["skipped"]
            continue
        assert "sm_89" in p["fp8"]["torchao"]["skipped"]  # torchao's float8 asserts a GPU; the CPU skips it
        assert "error" not in ao and "error" not in ao["compiled"], ao.get("traceback") or ao["compiled"]
        assert _positive(ao["eager_ms"]) and _positive(ao["compiled"]["forward_ms"])
        # every linear of ours, no other; SANA's 1x1 convolutions are ours alone
        assert ao["same_layers_as_ours"] and ao["layers"] > 0
        assert ao["layers"] + len(ao["ours_not_in_peer"]) == len(p["int8"]["quantized_layers"])
    if not installed:
        pytest.skip("torchao is not installed (pip install -e '.[peers]'): its peers are skipped, as checked")


def test_iteration_table_adds_refresh_and_training_to_the_rollouts(session):
    """sol_rl = ceil(N P / b) x 6 x t_q + ceil(K P / b) x 10 x t_bf16 + refresh + training; naive_scaling =
    ceil(N P / b) x 10 x t_bf16 + training; training = n_t x ceil(K P / train batch) x t_update."""
    rec = {
        "precisions": {"bf16": {"eager_ms": 100.0}, "fp8": {"eager_ms": 60.0, "refresh_ms": 50.0}},
        "train_settings": {"batch": 12, "timestep_fraction": 0.4},
        "nft_update": {"ms": 900.0, "batch": 12, "checkpointing": True},
    }
    t = session.iteration_table(rec, 24)
    updates = 4 * math.ceil(24 * 6 / 12)
    assert t["training"]["update_batches"] == updates
    it = t["eager/fp8"]
    train = updates * 0.9
    assert it["train_s"] == pytest.approx(train)
    assert it["sol_rl_total_s"] == pytest.approx(24 * 6 * 0.06 + 6 * 10 * 0.1 + 0.05 + train)
    assert it["naive_scaling_total_s"] == pytest.approx(24 * 10 * 0.1 + train)
    rec.pop("nft_update")
    t = session.iteration_table(rec, 24)
    assert t["eager/fp8"]["train_s"] == 0.0 and "not measured" in t["training"]["left_out"]


def test_a_small_budget_skips_the_later_stages_and_says_so(session, tmp_path, capsys):
    need0, need1 = session.ALLOWANCE["smoke"][0], session.ALLOWANCE["smoke"]["model"]
    assert need0 < need1
    budget = (need0 + need1) / 2  # stage 0 fits; a model stage never does, however fast stage 0 runs
    session.main(["--smoke", "--stages", "0,1,2", "--budget", str(budget), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    assert list(saved["stages"]) == ["0"]
    assert set(saved["skipped"]) == {"1", "2"} and all("budget" in why for why in saved["skipped"].values())
    assert "stage 1 skipped" in capsys.readouterr().out


def test_smoke_runs_one_trainer_iteration_of_compile_and_sol_rl(smoke):
    _, saved, out = smoke
    s4 = saved["stages"]["4"]
    assert "error" not in s4 and "partial" not in s4, s4.get("traceback")
    for fam in ("compile", "sol_rl"):
        m = s4["families"][fam]
        assert "error" not in m, m.get("traceback")
        assert m["time_total_s"] >= m["time_rollout_s"] > 0 and m["time_train_s"] > 0
        assert m["settings"]["n"] == 4 and len(m["raw"]) == 2  # the warm-up and the timed iteration
    assert s4["families"]["sol_rl"]["time_regen_s"] > 0
    r = s4["sol_rl_vs_compile"]["time_rollout_s"]
    assert r == pytest.approx(s4["families"]["compile"]["time_rollout_s"] / s4["families"]["sol_rl"]["time_rollout_s"])
    # the smoke's model stages are tiny SANA configs, its trainer the bundled model: nothing to predict from
    assert "skipped" in s4["predicted_from_forwards"]
    assert "sol_rl vs compile: rollout" in out


def test_trainer_prediction_uses_the_model_stages_forwards_at_the_trainers_settings(session):
    """Stage 4's check: iteration_seconds at the trainer's own settings from the model stage's compiled
    (graph-replayed where measured) forwards, its refresh and the nft_update scaled to the train batch."""
    stage = {"model": "sana-1.6b", "nft_update": {"ms": 800.0, "batch": 16},
             "precisions": {"bf16": {"eager_ms": 900.0, "compiled": {"forward_ms": 700.0, "graphed_ms": 600.0}},
                            "fp8": {"eager_ms": 800.0, "compiled": {"forward_ms": 450.0}, "refresh_ms": 30.0}}}
    settings = {"n": 96, "k": 24, "prompts_per_iter": 1, "preview_steps": 6, "full_steps": 10,
                "rollout_batch_size": 48, "train_batch_size": 8, "timestep_fraction": 0.6}
    fams = {"compile": {"time_rollout_s": 14.0, "time_total_s": 24.0, "settings": settings},
            "sol_rl": {"time_rollout_s": 9.0, "time_total_s": 19.0, "settings": settings, "explore_recipe": "fp8"}}
    p = session.trainer_prediction({"stages": {"1": stage}}, fams, "sana-1.6b")
    assert p["explore_precision"] == "fp8" and p["forward_ms"] == {"bf16": 600.0, "explore": 450.0}
    assert p["update_ms_scaled"] == 400.0  # 800 ms at batch 16, at the trainer's batch 8
    # compile: ceil(96/48) = 2 chunks x 10 steps x 0.6 s; sol_rl: 2 x 6 x 0.45 + ceil(24/48) = 1 x 10 x 0.6 + 0.03
    assert p["compile"]["predicted_rollout_s"] == pytest.approx(12.0)
    assert p["sol_rl"]["predicted_rollout_s"] == pytest.approx(5.4 + 6.0 + 0.03)
    train = 6 * 3 * 0.4  # int(10 x 0.6) timesteps x ceil(24 / 8) update batches x 0.4 s
    assert p["sol_rl"]["predicted_total_s"] == pytest.approx(5.4 + 6.0 + 0.03 + train)
    assert p["compile"]["measured_over_predicted_rollout"] == pytest.approx(14.0 / 12.0)
    assert "skipped" in session.trainer_prediction({"stages": {}}, fams, "sana-1.6b")
