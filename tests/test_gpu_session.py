"""bench/gpu_session.py's smoke mode: every stage runs on the CPU with tiny shapes and writes its part of the
JSON, a budget too small for the later stages skips them and says so, and the summary prints."""

import json

import pytest
from bench_scripts import load_bench


@pytest.fixture(scope="module")
def session():
    return load_bench("gpu_session")


def test_smoke_runs_every_stage_and_writes_each_part(session, tmp_path, capsys):
    rec = session.main(["--smoke", "--stages", "0,1,2,3", "--budget", "600", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    assert saved["stages"].keys() == {"0", "1", "2", "3"} and not saved["skipped"]
    s0 = saved["stages"]["0"]
    assert "error" not in s0, s0.get("traceback")
    assert s0["ceilings"]["copy"]["gb_per_s"] > 0 and s0["ceilings"]["bf16_mm"]["tflops"] > 0
    for fmt in ("fp8", "int8", "nvfp4"):  # the CPU runs every layer on the reference, and the record says so
        fp = s0["fast_path_small"][fmt]
        assert fp["layers"] > 0 and fp["fast"] + fp["reference"] == fp["layers"], fp
    for key, model in zip(("1", "2", "3"), ("sana-1.6b", "sd35-large", "flux-dev"), strict=True):
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
        # INT8 widens the family rule (every eligible layer); FP8 keeps it, except FLUX whose rule is every layer
        assert len(p["int8"]["quantized_layers"]) >= len(p["fp8"]["quantized_layers"])
        it = s["iteration"]["eager/fp8"]
        assert it["sol_rl_vs_naive_scaling"] == pytest.approx(it["naive_scaling_s"] / it["sol_rl_s"])
        assert s["predicted"]["forward_ms"]["bf16"]["eager"] > 0
    assert len(saved["stages"]["1"]["precisions"]["int8"]["quantized_layers"]) > len(
        saved["stages"]["1"]["precisions"]["fp8"]["quantized_layers"]
    )  # fmt: skip  (SANA's rule is narrower)
    assert rec["summary"] == saved["summary"]
    for line in ("ceilings", "sana-1.6b  fp8", "sd35-large int8", "flux-dev   bf16", "wrote"):
        assert line in out


def test_a_small_budget_skips_the_later_stages_and_says_so(session, tmp_path, capsys):
    need0, need1 = session.ALLOWANCE["smoke"][0], session.ALLOWANCE["smoke"]["model"]
    assert need0 < need1
    budget = (need0 + need1) / 2  # stage 0 fits; a model stage never does, however fast stage 0 runs
    session.main(["--smoke", "--stages", "0,1,2", "--budget", str(budget), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    assert list(saved["stages"]) == ["0"]
    assert set(saved["skipped"]) == {"1", "2"} and all("budget" in why for why in saved["skipped"].values())
    assert "stage 1 skipped" in capsys.readouterr().out
