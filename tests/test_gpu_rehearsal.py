"""The GPU session rehearsed on the CPU exactly as the lent machine runs it: a copy of the working tree as the
device tool sends it (tracked and untracked-not-ignored files), the project NOT installed (`python -S`: no .pth
file, so no editable install, only site-packages on PYTHONPATH), the device command itself
(`bash bench/device_call.sh 1|2|3|4|5`), at a simulated sm_90 and sm_80 with Triton interpreted (the video calls 4, 5
at sm_90), every stage of each call at smoke shapes. No error, timeout or failed capture anywhere in the JSON is
allowed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from bench_scripts import load_bench

from solrl_engine.sampling.compile import PRODUCER_KINDS

ROOT = Path(__file__).resolve().parents[1]
BAD_KEYS = ("error", "traceback", "timed_out", "graphed_error")
SMOKE_BUDGET = load_bench("gpu_session").SMOKE_BUDGET  # the smoke call's own limit


def _tree_copy(dst: Path) -> Path:
    """The working tree as the device tool copies it: tracked files and untracked ones git does not ignore."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("the rehearsal copies the tree as git lists it: needs a git checkout and git")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    return dst


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tree_copy(tmp_path_factory.mktemp("device-tree"))


@pytest.fixture(scope="module")
def rehearse(tree: Path, tmp_path_factory: pytest.TempPathFactory):
    """(call, sm) -> (return code, the JSON, the log): each combination run once for the module."""
    runs: dict[tuple[int, str], tuple[int, dict, str]] = {}
    site = os.pathsep.join(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))

    def run(call: int, sm: str) -> tuple[int, dict, str]:
        if (call, sm) not in runs:
            out = tmp_path_factory.mktemp(f"call{call}-sm{sm}")
            env = {**os.environ, "OUT": str(out), "SOLRL_SITE": str(out / "site"), "PYTHON": f"{sys.executable} -S",
                   "PYTHONPATH": site, "SOLRL_SIMULATE_SM": sm, "TRITON_INTERPRET": "1"}  # fmt: skip
            env.pop("SOLRL_BACKEND", None)
            try:  # the script's own smoke budget bounds it; this limit only catches a hang
                proc = subprocess.run(["bash", "bench/device_call.sh", str(call), "--smoke"], cwd=tree, env=env,
                                      capture_output=True, text=True, timeout=SMOKE_BUDGET + 120)  # fmt: skip
            except subprocess.TimeoutExpired:
                log = (out / "gpu_session.log").read_text() if (out / "gpu_session.log").is_file() else ""
                pytest.fail(f"call {call} at sm_{sm} ran past {SMOKE_BUDGET + 120:.0f} s; its log ends:\n{log[-3000:]}")
            saved = out / "gpu_session.json"
            rec = json.loads(saved.read_text()) if saved.is_file() else {}
            log = (out / "gpu_session.log").read_text() if (out / "gpu_session.log").is_file() else ""
            runs[(call, sm)] = (proc.returncode, rec, log + proc.stderr[-3000:])
        return runs[(call, sm)]

    return run


def _bad(obj: object, path: str = "") -> list[str]:
    """Every error, traceback, timeout or failed capture anywhere in the record, with where it is."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in BAD_KEYS:
                found.append(f"{path}/{k}: {str(v)[:300]}")
            found += _bad(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _bad(v, f"{path}[{i}]")
    return found


# sm_90 here; sm_80's calls in test_gpu_rehearsal_sm80.py, so that pytest-xdist runs the two rehearsals side by side
CASES = [(1, "90"), (2, "90"), (3, "90"), (4, "90"), (5, "90")]
FORWARDS = {3: ["sana-1.6b", "flux-dev", "sd35-large"], 4: ["wan2.1-1.3b", "wan2.1-14b"]}  # the calls with forwards


@pytest.mark.slow
@pytest.mark.parametrize(("call", "sm"), CASES)
def test_each_device_call_runs_every_stage_clean_from_a_bare_copy(call, sm, rehearse, tree):
    check_every_stage(call, sm, rehearse, tree)


def check_every_stage(call: int, sm: str, rehearse, tree: Path) -> None:  # noqa: ANN001 - the fixture
    rc, rec, log = rehearse(call, sm)
    assert rc == 0, log[-4000:]
    stages = list(rec["stage_order"])
    assert list(rec["stages"]) == stages and not rec["skipped"], rec["skipped"]
    assert _bad(rec) == []
    # what ran is the copy, not an installed project
    prov = rec["provenance"]
    assert prov["from_checkout"] and prov["solrl_engine"].startswith(str(tree)), prov
    assert prov["solrl_triton"].startswith(str(tree / "triton_kernels")), prov
    # the log under OUT holds the run and the summary after every stage
    assert log.count("== ") >= 2 * len(stages) and log.count(f"gpu_session call {call} on") == len(stages)
    for stage in stages:
        assert "partial" not in rec["stages"][stage], stage


@pytest.mark.slow
def test_call_1_preflight_checks_the_gpu_path_of_each_format_the_device_has(rehearse):
    check_preflight("90", rehearse)


def check_preflight(sm: str, rehearse) -> None:  # noqa: ANN001 - the fixture
    _, rec, _ = rehearse(1, sm)
    pre = rec["stages"]["preflight"]
    assert pre["ok"] and pre["failed"] == []
    eight = ["fp8", "int8"] if sm == "90" else ["int8"]  # FP8 tensor cores need sm_89; nothing NVFP4 below sm_100
    assert pre["formats"] == {"eight_bit": eight, "explore": eight}
    for fmt in eight:
        layer = pre["layers"][fmt]
        assert layer["ok"] and layer["rel_error_vs_reference"] <= 2e-2 and "1/1 quantized layers on the fast path" in (
            layer["ran"])  # fmt: skip
        fp = pre["fast_path_small"][fmt]
        assert fp["layers"] > 0 and fp["fast"] == fp["layers"] and fp["reference"] == 0
    c = pre["census"]["census"]
    assert pre["census"]["format"] == eight[0] and c["traced"] >= 1 and c["opaque"] == 0
    assert pre["capture"]["violations"] == [] and "meta" in pre["capture"]["how"]
    assert "nvfp4" not in pre["fast_path_small"]


@pytest.mark.slow
def test_call_1_measures_sol_rl_against_both_baselines_first(rehearse):
    _, rec, log = rehearse(1, "90")
    assert rec["stage_order"] == ["gpu-tests", "preflight", "trainer:sana-1.6b", "ceilings:producers"]
    # the fused producer kernels beside the unfused ops they replace (the Triton interpreter here: no speed)
    prod = rec["ceilings"]["producers"]
    assert prod["format"] == "fp8" and prod["rows"] == 8
    for name in ("adaln", "rms", "gelu", "glu"):
        (row,) = [v for k, v in prod.items() if k.startswith(name)]
        assert "error" not in row and min(row["fused_ms"], row["unfused_ms"], row["codes_alone_ms"]) > 0, row
    s = rec["stages"]["trainer:sana-1.6b"]
    for fam in ("sol_rl", "naive_scaling", "compile"):
        m = s["families"][fam]
        assert m["time_total_s"] >= m["time_rollout_s"] > 0 and m["time_train_s"] > 0
        assert len(m["raw"]) == 2 and m["settings"]["gradient_checkpointing"]  # the warm-up and the timed one
        assert m["reward"] == "1 * pickscore" and m["reward_parts"][0].startswith("PickScore(")  # the stage's CLIP
    for base in ("naive_scaling", "compile"):
        r = s["sol_rl_vs"][base]["time_rollout_s"]
        assert r == pytest.approx(s["families"][base]["time_rollout_s"] / s["families"]["sol_rl"]["time_rollout_s"])
    # no forwards stage in this call (and smoke's trainer runs the bundled model): nothing to predict from
    assert "skipped" in s["predicted_from_forwards"] and s["reward_build_s"] > 0
    assert "sol_rl vs naive_scaling: rollout" in log and "sol_rl vs compile: rollout" in log


@pytest.mark.slow
@pytest.mark.parametrize(("call", "sm"), [(c, sm) for c, sm in CASES if c in FORWARDS])
def test_forwards_run_the_gpu_path_eager_and_compiled(call, sm, rehearse):
    check_forwards(call, sm, rehearse)


def check_forwards(call: int, sm: str, rehearse) -> None:  # noqa: ANN001 - the fixture
    _, rec, _ = rehearse(call, sm)
    models = FORWARDS[call]
    eight = ["fp8", "int8"] if sm == "90" else ["int8"]
    for model in models:
        s = rec["stages"][f"forwards:{model}"]
        p = s["precisions"]
        assert "sm_100" in p["nvfp4"]["skipped"] and ("sm_89" in p["fp8"].get("skipped", "")) == (sm == "80")
        for fmt in ["bf16", *eight]:
            e = p[fmt]
            assert e["eager_ms"] > 0 and e["compiled"]["forward_ms"] > 0
            c = e["compiled"]["census"]
            assert e["compiled"]["regional_blocks"] > 0 and c["graphs"] >= 1
            if fmt != "bf16":  # a simulated GPU: every layer fast eager; compiled, traced scaled GEMMs only
                assert e["fast_path"]["fast"] == e["fast_path"]["layers"] == len(e["quantized_layers"]) > 0
                assert c["traced"] > 0 and c["opaque"] == 0 and 0 < c["fed"] <= c["traced"], c
                # no more graphs than the BF16 policy's: each block class compiled once, not once per instance
                assert c["graphs"] <= p["bf16"]["compiled"]["census"]["graphs"], (c, p["bf16"]["compiled"]["census"])
                assert e["refresh_ms"] > 0
                # every family's 8-bit copy has producers (adaLN modules, inline-modulated norms, FFN GELUs), each run
                # by its kernel
                assert e["producers_ran"] and all(r.startswith("triton") for r in e["producers_ran"]), e
                assert e["producers_codes_alone"] > 0 and any(r.endswith("(y unwritten)") for r in e["producers_ran"])
                assert e["eager_ms_producers_paused"] > 0  # the same copy timed with its producers paused
                assert sum(c["gemms"].get(k, 0) for k in PRODUCER_KINDS) > 0, c
        assert s["nft_update"]["ms"] > 0 and s["nft_update"]["checkpointing"] == (model != "sana-1.6b")
        it = s["iteration"][f"eager/{eight[0]}"]
        assert it["sol_rl_vs_naive_scaling"] == pytest.approx(it["naive_scaling_s"] / it["sol_rl_s"])


@pytest.mark.slow
def test_call_4_times_video_forwards_and_reports_attentions_share(rehearse):
    """Wan at a smoke clip (5 frames): a video latent [C, F, H, W], the profile's attention share per precision
    (the part the explore copy leaves in BF16, or runs in INT8 or FP8 with fp8+int8- / fp8+fp8-attention), the attention
    peers (FP8 attention's kernel at the simulated sm_90), and the Wan model's own
    preset for the update."""
    _, rec, _ = rehearse(4, "90")
    assert rec["stage_order"] == ["ceilings:attention", "forwards:wan2.1-1.3b", "forwards:wan2.1-14b"]
    peers = rec["ceilings"]["attention"]  # the attention peers: SDPA and ours timed, SageAttention v1 CUDA-only
    assert peers["sdpa_bf16"]["median_ms"] > 0 and peers["ours_int8"]["ran"].startswith("triton"), peers
    assert peers["ours_int8"]["rel_error"] < 0.05 and "skipped" in peers["sageattention_v1"], peers
    assert peers["ours_fp8"]["ran"] == "triton: FP8 Q K^T, FP8 P V attention" and peers["ours_fp8"]["rel_error"] < 0.1
    for model in ("wan2.1-1.3b", "wan2.1-14b"):
        s = rec["stages"][f"forwards:{model}"]
        assert len(s["latent_shape"]) == 4 and s["latent_shape"][1] == 2  # 5 frames: 1 + 4 -> 2 latent frames
        for fmt in ("bf16", "fp8", "int8", "fp8+int8-attention", "fp8+fp8-attention"):
            share = s["precisions"][fmt]["profile_eager"]["share"]
            assert 0 < share["attention"] < 1 and sum(share.values()) == pytest.approx(1.0)
        # the FP8 copy with FP8 and with INT8 attention: each Triton kernel ran (the interpreter here), eager and
        # compiled
        for fmt, kernel in (("fp8+fp8-attention", "triton: FP8"), ("fp8+int8-attention", "triton: INT8")):
            att = s["precisions"][fmt]
            assert att["attention_ran"].startswith(kernel) and att["compiled"]["forward_ms"] > 0, (fmt, att)
        assert s["train_settings"]["checkpointing"] and s["train_settings"]["timestep_fraction"] == 0.6


@pytest.mark.slow
def test_call_1_runs_the_gpu_tests_from_the_copy_first(rehearse):
    _, rec, log = rehearse(1, "90")
    t = rec["stages"]["gpu-tests"]
    assert t["returncode"] == 0 and t["counts"]["failed"] == t["counts"]["errors"] == 0
    assert t["counts"]["skipped"] > 0 and "-m gpu" in t["command"]  # no CUDA here: every GPU test skips
    assert "gpu tests: 0 passed, 0 failed, 0 errors" in log


def _positive(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < float("inf")


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(FORWARDS))
def test_forwards_time_one_update_and_each_refresh_and_count_them_per_iteration(call, rehearse):
    _, rec, log = rehearse(call, "90")
    for key, s in rec["stages"].items():
        if not key.startswith("forwards:"):
            continue
        model, upd, ts = s["model"], s["nft_update"], s["train_settings"]
        assert _positive(upd["ms"]) and upd["batch"] == ts["batch"] == 2
        assert upd["calls"] == 3  # one warm-up + 2 timed
        for fmt in ("fp8", "int8"):
            e = s["precisions"][fmt]
            assert _positive(e["refresh_ms"]) and _positive(e["refresh"]["requantize_all_ms"])
            assert e["refresh"]["layers"] > 0 and e["refresh"]["requantize_all_layers"] == len(e["quantized_layers"])
        tr = s["iteration"]["training"]
        n_t = max(1, int(10 * ts["timestep_fraction"]))
        assert tr["update_batches"] == n_t * -(-24 * 6 // ts["batch"]) and "left_out" not in tr
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
        assert f"{model:<12}train nft_update" in log


@pytest.mark.slow
def test_forwards_time_the_torchao_peer_on_the_same_layers(rehearse):
    _, rec, _ = rehearse(3, "90")
    import importlib.util

    installed = importlib.util.find_spec("torchao") is not None
    for key in ("forwards:flux-dev", "forwards:sd35-large"):
        p = rec["stages"][key]["precisions"]
        ao = p["int8"]["torchao"]
        if not installed:  # both peers say why, with the install command
            for fmt in ("fp8", "int8"):
                assert "does not import" in p[fmt]["torchao"]["skipped"] and "[peers]" in p[fmt]["torchao"]["skipped"]
            continue
        assert "CUDA GPU" in p["fp8"]["torchao"]["skipped"]  # torchao's float8 asserts a GPU; the CPU skips it
        assert _positive(ao["eager_ms"]) and _positive(ao["compiled"]["forward_ms"])
        assert ao["same_layers_as_ours"] and ao["layers"] > 0
        assert ao["layers"] + len(ao["ours_not_in_peer"]) == len(p["int8"]["quantized_layers"])
    if not installed:
        pytest.skip("torchao is not installed (pip install -e '.[peers]'): its peers are skipped, as checked")


@pytest.mark.slow
def test_call_5_runs_videos_whole_iteration_per_family(rehearse):
    """The video trainer stage on a tiny WanPipeline of the real classes, saved and loaded: every family's iteration,
    each clip decoded by its Wan VAE and scored by the stage's PickScore on frames, no warm-up."""
    _, rec, log = rehearse(5, "90")
    s = rec["stages"]["trainer:wan2.1-1.3b"]
    assert s["model"] == "wan2.1-1.3b" and "--preset" in s["argv"]
    for fam in ("sol_rl", "naive_scaling", "compile"):
        m = s["families"][fam]
        assert m["time_total_s"] >= m["time_rollout_s"] > 0 and m["time_train_s"] > 0 and len(m["raw"]) == 1
        assert m["decode"] == "AutoencoderKLWan" and m["reward"] == "1 * pickscore"
    assert "sol_rl vs naive_scaling: rollout" in log and "one iteration after" not in log
