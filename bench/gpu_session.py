"""The whole GPU picture in device calls: Sol-RL's real trainer iterations first, then each full-size
denoiser's explore speed, each stage under its own deadline.

Why: a GPU machine is lent rarely, for minutes, bare, and the project is not installed there. This script
spends that time on what says whether Sol-RL pays off, most valuable first: the GPU tests in their own process;
a preflight that stops the call in under a minute when the setup is broken; one real trainer iteration of
`sol_rl`, `naive_scaling` and `compile` on SANA-1.6B, then on FLUX.1-dev (the headline: whole iterations, decode
and reward included); then, when device time is left, per full-size random-weight denoiser one forward at the
rollout batch in BF16 and each explore precision, eager and compiled, with where its time goes, torchao's peer,
the refresh and the update, and the seconds per iteration that follow beside bench/predict.py's speed model.

    bash bench/device_call.sh 1      # device call 1: gpu-tests, preflight, trainer:sana-1.6b
    bash bench/device_call.sh 2      # device call 2: trainer:flux-dev
    python bench/gpu_session.py --smoke --call 1 --out /tmp/s     # CPU, tiny shapes

The JSON is rewritten atomically after every entry and the summary printed after every stage, so a call cut off
keeps and shows what finished. See docs/gpu-session.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts import each other
import e2e  # noqa: E402
import preflight as preflight_mod  # noqa: E402
import session_summary as summary  # noqa: E402
from kernels import _device_info  # noqa: E402
from session_common import (  # noqa: E402
    FORMATS,
    HERE,
    MODELS,
    ROLLOUT_BATCH,
    SMALL_FLUX,
    TINY,
    TINY_RES,
    VIDEO_MODELS,
    WAN_ATTENTION,
    _error,
    _release,
    build_model,
    ceilings,
    cuda_broken,
    format_unavailable,
    graphed_ms,
    predict,
)
from session_forwards import COMPILE_ALLOWANCE, device_from_ceilings, model_stage  # noqa: E402
from session_train import TRAIN_ALLOWANCE  # noqa: E402

ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the reward of published size is built as the tests build tiny ones
import tiny_clip  # noqa: E402

# the device calls (docs/gpu-session.md): 15 minutes of device time hold the first two, the whole iteration of the
# two paper families the headline rests on; the GPU tests first, in their own process, so a poisoned CUDA context
# cannot skip them; then (when device time is left) the forwards per precision, and video (Wan2.1 at 480 x 832 and
# 81 frames, where attention is a large share)
CALLS = {
    # ceilings:producers: the fused producer kernels against the unfused ops they replace (half a minute, last)
    1: ("gpu-tests", "preflight", "trainer:sana-1.6b", "ceilings:producers"),
    2: ("trainer:flux-dev",),  # FLUX.1-dev's trainer has never completed on a GPU: a call of its own
    3: ("ceilings", "forwards:sana-1.6b", "forwards:flux-dev", "forwards:sd35-large"),
    # ceilings:attention adds the attention peers (ours and SageAttention v1) at Wan2.1-1.3B's attention shape
    4: ("ceilings:attention", "forwards:wan2.1-1.3b", "forwards:wan2.1-14b"),
    # video's whole iteration: the real trainer on Wan2.1-1.3B at 480 x 832, 81 frames, N = 16, K = 4
    5: ("trainer:wan2.1-1.3b",),
}
BUDGET = 540.0  # of a device command's 600 s: the rest is the wheels' install and the imports
# seconds each kind of stage may run (its hard deadline, and what must be left for it to start); each call's
# allowances sum to less than BUDGET (a test checks)
ALLOWANCE = {
    "gpu": {"preflight": 45.0, "ceilings": 20.0, "gpu-tests": 160.0, "trainer": 290.0, "forwards": 170.0,
            # a 12B model's three families, each after a warm-up iteration: what a call holds after the imports
            "trainer:flux-dev": 500.0, "trainer:wan2.1-1.3b": 520.0, "ceilings:attention": 60.0,
            "ceilings:producers": 30.0},
    # smoke: generous, on a loaded 2-core CPU the trainer stage's inductor compiles alone take a minute or more
    "smoke": {"preflight": 180.0, "ceilings": 30.0, "gpu-tests": 300.0, "trainer": 600.0, "forwards": 240.0,
              "ceilings:attention": 90.0, "ceilings:producers": 120.0},
}
SMOKE_BUDGET = 1800.0


# --- Sol-RL's headline: real trainer iterations -------------------------------------------------------

TRAINER_FAMILIES = ("sol_rl", "naive_scaling", "compile")  # in this order: the headline pair first
# video trainer stages: the model's preset (configs/wan.py), N = 16, K = 4, 10 full and 6 preview steps (the image
# papers' ratio; the preset's 50 / 30 would not fit one device call), one iteration each, no warm-up (the sampler's
# compile and capture are timed apart: time_compile_s); compile last, kept only if the call has time for it
TRAINER_VIDEO = {"wan2.1-1.3b": "configs/wan.py:wan13b"}
VIDEO_TRAINER_SETTINGS = ("--n", "16", "--k", "4", "--set", "full_steps=10", "--set", "preview_steps=6")


def trainer_stage(alias: str, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    """One iteration of the real trainer (bench/e2e.py's run_family: solrl_engine.rl.Trainer) of `sol_rl`,
    `naive_scaling` and `compile`, in that order, on the model (random weights, stand-in text encoder; the published
    VAE with random weights; PickScore of its published architecture and size, CLIP ViT-H/14 with random weights,
    built here: each image decoded and scored as in a user's run): 1 prompt, N = 96, K = 24, its rollout batch, after
    one warm-up iteration (compile, capture). Each family's result is written as it finishes, so a stage cut off
    keeps the families that ran. Smoke: the bundled model and its decode, a tiny CLIP of the same class."""
    smoke = cfg["smoke"]
    video = alias in TRAINER_VIDEO  # (its preset; smoke: a tiny WanPipeline of the real classes, saved and loaded)
    model = "tiny" if smoke and not video else alias
    argv = ["--model", model, "--iterations", "1", "--warmup", "0" if video else "1", "--prompts", "1"]
    rollout_batch = cfg["batch"].get(alias, ROLLOUT_BATCH[alias])
    if video:
        argv += ["--preset", TRAINER_VIDEO[alias], *VIDEO_TRAINER_SETTINGS]
    # the update's micro-batch and recompute: sized by the trainer from the GPU's memory (train_batch_size and
    # gradient_checkpointing auto); smoke (a CPU, where auto recomputes nothing) recomputes, to rehearse that path
    argv += (["--n", "4", "--k", "2", "--rollout-batch", "4", "--train-batch", "2"] if smoke else
             ["--rollout-batch", str(rollout_batch)])  # fmt: skip
    out: dict[str, Any] = {"model": model, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if video and smoke:  # (the preset's clip on a tiny WanPipeline of the real classes, saved and loaded)
            import tiny_pipelines

            path = tiny_pipelines.build_wan(Path(tmp) / "wan")
            side = tiny_pipelines.SIZES["wan"]
            argv += ["--model-path", str(path), "--set", f"resolution={side}", "--set", f"width={side}", "--set",
                     f"frames={tiny_pipelines.WAN_FRAMES}", "--set", "preview_steps=1", "--set", "full_steps=2"]
        t0 = time.perf_counter()
        clip = tiny_clip.build_clip_reward(Path(tmp) / "pickscore", published=None if smoke else tiny_clip.VIT_H_14,
                                           device=str(device))  # fmt: skip
        out["reward_build_s"] = time.perf_counter() - t0
        argv += ["--reward", "pickscore", "--reward-args", f"pickscore.model={clip},pickscore.processor={clip}"]
        argv += [] if smoke else ["--vae"]  # (a video preset's: the Wan VAE, random weights, decoding 81 frames)
        out["argv"] = argv
        args = e2e.build_parser().parse_args(argv)
        for fam in TRAINER_FAMILIES:
            c = e2e.family_config(fam, args, f"{tmp}/{fam}")
            c = dataclasses.replace(c, gradient_checkpointing=True) if smoke else c
            out["families"][fam] = {"running": True}
            try:
                res = e2e.run_family(c, warmup=args.warmup)
                res["settings"] = {k: getattr(c, k) for k in (
                    "n", "k", "prompts_per_iter", "preview_steps", "full_steps", "rollout_batch_size",
                    "timestep_fraction")} | {k: v for k, v in res["update_sizes"].items() if k != "reason"}  # fmt: skip
                out["families"][fam] = res
            except Exception as e:  # one family failing keeps the others
                out["families"][fam] = _error(e)
            finally:
                _release(device)
            _ratios(out)
            cfg["progress"](out)
    return out


def _ratios(out: dict[str, Any]) -> None:
    """Sol-RL's measured speed-up over each baseline that ran: rollout and whole iteration."""
    fams = out["families"]
    sol = fams.get("sol_rl", {})
    if "time_rollout_s" not in sol:
        return
    out["sol_rl_vs"] = {base: {k: fams[base][k] / sol[k] for k in ("time_rollout_s", "time_total_s")}
                        for base in ("naive_scaling", "compile") if "time_rollout_s" in fams.get(base, {})}  # fmt: skip
    out["update_forward_equivalents"] = update_forward_equivalents(fams)


def update_forward_equivalents(fams: dict[str, Any]) -> dict[str, float]:
    """Each family's update seconds per trained sample-step over the `compile` family's explore seconds per
    sample-step (a compiled, graph-captured forward at the rollout batch: the unit), from one trainer stage; the
    arithmetic of an update without fixed predictions' recompute is about 3 (old and reference forwards batched,
    the policy's forward, a backward of input gradients), the issue's goal 4."""
    unit = fams.get("compile", {})
    if "time_explore_s" not in unit or not unit.get("sample_steps", {}).get("explore"):
        return {}
    per_step = unit["time_explore_s"] / unit["sample_steps"]["explore"]
    return {fam: m["time_train_s"] / m["sample_steps"]["trained"] / per_step for fam, m in fams.items()
            if "time_train_s" in m and m.get("sample_steps", {}).get("trained")}  # fmt: skip


def trainer_prediction(rec: dict[str, Any], fams: dict[str, Any], alias: str | None) -> dict[str, Any]:
    """iteration_seconds at each trainer run's own settings from the model's forwards stage (its compiled
    forwards, the CUDA-graph replay where measured: what the compiled sampler runs), the precision sol_rl
    explored in, its refresh, and the measured nft_update scaled to the trainer's train batch (linear in the
    batch: an assumption); each family's measured rollout and total over the prediction."""
    stage = rec["stages"].get(f"forwards:{alias}") if alias else None
    if not stage or "precisions" not in stage:
        return {"skipped": "no forwards stage of this model in this call's record to predict from"}
    precs = stage.get("precisions", {})
    sol = fams.get("sol_rl", {})
    fmt = str(sol.get("explore_recipe", "")).split("+")[0]

    def fwd_ms(e: dict[str, Any], compiled: bool) -> float | None:
        c = e.get("compiled") or {}
        return (c.get("graphed_ms") or c.get("forward_ms")) if compiled else e.get("eager_ms")

    upd = stage.get("nft_update") or {}
    out: dict[str, Any] = {"explore_precision": fmt or "policy"}
    # the compiled families (sol_rl, compile) against the compiled forwards; naive_scaling samples eagerly
    for fam, table, compiled in (("compile", "naive_scaling", True), ("naive_scaling", "naive_scaling", False),
                                 ("sol_rl", "sol_rl", True)):  # fmt: skip
        m = fams.get(fam, {})
        st = m.get("settings")
        t_bf16 = fwd_ms(precs.get("bf16", {}), compiled)
        t_q = fwd_ms(precs.get(fmt, {}), compiled) if fmt in precs else t_bf16  # the policy explored: its forward
        if "time_rollout_s" not in m or st is None:
            continue
        if t_bf16 is None or t_q is None or "ms" not in upd:
            out[fam] = {"skipped": f"missing a measured forward ({fmt or 'bf16'}) or the nft_update"}
            continue
        t_update = upd["ms"] * st["train_batch_size"] / upd["batch"]
        it = predict.iteration_seconds(t_bf16 / 1e3, t_q / 1e3, t_update / 1e3 / predict.TRAIN_FORWARDS,
                                       (precs.get(fmt, {}).get("refresh_ms") or 0.0) / 1e3,
                                       prompts=st["prompts_per_iter"], n=st["n"], k=st["k"],
                                       batch=st["rollout_batch_size"], preview_steps=st["preview_steps"],
                                       full_steps=st["full_steps"], timestep_fraction=st["timestep_fraction"],
                                       train_batch=st["train_batch_size"])  # fmt: skip
        p = it[table]
        out[fam] = {"predicted_rollout_s": p["rollout"], "predicted_total_s": p["total"],
                    "forward_ms": {"bf16": t_bf16, "explore": t_q}, "update_ms_scaled": t_update,
                    "measured_over_predicted_rollout": m["time_rollout_s"] / p["rollout"],
                    "measured_over_predicted_total": m["time_total_s"] / p["total"]}  # fmt: skip
    return out


# --- the GPU tests ------------------------------------------------------------------------------------


def gpu_tests_stage(cfg: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The GPU-marked tests (`pytest -m gpu`), from this checkout as it lies (not installed), in a child process
    with its own time limit: counts, the failed tests' names, and the tail of the output. On a CPU they are all
    skipped (the rehearsal checks the command, not the tests)."""
    import xml.etree.ElementTree as ET

    junit = Path(cfg["out_dir"]) / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(seconds, 1.0))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"{e.stdout or ''}{e.stderr or ''}\n(stopped after {seconds:.0f} s)"
        text = text if isinstance(text, str) else text.decode(errors="replace")
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": time.monotonic() - t0,
                           "tail": text.splitlines()[-40:]}  # fmt: skip
    if junit.is_file():
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
        failed = [f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}" for tc in root.iter("testcase")
                  if tc.find("failure") is not None or tc.find("error") is not None]  # fmt: skip
        bad = n.get("failures", 0) + n.get("errors", 0) + n.get("skipped", 0)
        out["counts"] = {"passed": n.get("tests", 0) - bad, "failed": n.get("failures", 0),
                         "errors": n.get("errors", 0), "skipped": n.get("skipped", 0)}  # fmt: skip
        out["failed_tests"] = failed
    if rc not in (0, 5):  # 5: nothing collected (no GPU test selected)
        out["error"] = f"pytest -m gpu exited {rc}" + (f": {', '.join(out.get('failed_tests', [])[:4])}"
                                                      if out.get("failed_tests") else "")  # fmt: skip
    return out


# --- the session ------------------------------------------------------------------------------------

class StageTimeout(BaseException):
    """Raised in the main thread when a stage's allowance runs out. A BaseException, so the stages' own
    `except Exception` (one precision's failure must not lose the others) cannot swallow it; their `finally`
    blocks still release memory and restore compiled blocks."""


@contextlib.contextmanager
def stage_deadline(seconds: float, stage: str) -> Iterator[None]:
    """StageTimeout after `seconds` (SIGALRM; off the main thread or without it, no hard deadline: the soft
    checks inside the stages still apply)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(_signum: int, _frame: Any) -> None:
        raise StageTimeout(f"stage {stage} ran past its {seconds:.0f} s allowance and was stopped")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def stage_kind(stage: str) -> str:
    """preflight | ceilings | gpu-tests | trainer | forwards: what a stage name asks for."""
    kind = stage.split(":", 1)[0]
    takes = {"trainer": MODELS + tuple(TRAINER_VIDEO), "forwards": MODELS + VIDEO_MODELS}
    if kind not in ("preflight", "ceilings", "gpu-tests", "trainer", "forwards"):
        raise ValueError(f"unknown stage {stage!r}: use preflight, ceilings, gpu-tests, trainer:MODEL (MODEL one of "
                         f"{', '.join(takes['trainer'])}) or forwards:MODEL (MODEL one of "
                         f"{', '.join(takes['forwards'])})")  # fmt: skip
    if kind in takes and stage.partition(":")[2] not in takes[kind]:
        raise ValueError(f"stage {stage!r} names no model it takes: write {kind}:MODEL with MODEL one of "
                         f"{', '.join(takes[kind])}")  # fmt: skip
    return kind


def source_digest(root: Path = ROOT) -> str:
    """sha256 of every .py file of the engine, the kernels, bench/ and tests/ (relative path and bytes): which
    commit a device ran can be matched here (`--digest`) although the device's copy has no .git."""
    h = hashlib.sha256()
    for folder in ("solrl_engine", "triton_kernels", "bench", "tests"):
        for f in sorted((root / folder).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def provenance() -> dict[str, Any]:
    """Where the engine and its Triton kernels were imported from (`from_checkout`: both from this checkout, as on
    a device, where nothing is installed), any installed metadata, and the source digest."""
    import importlib.metadata

    import solrl_engine
    from solrl_engine.kernels.dispatch import source_tree_kernels

    try:
        meta = importlib.metadata.version("solrl-engine")
    except importlib.metadata.PackageNotFoundError:
        meta = None
    engine, kernels = solrl_engine.__file__, source_tree_kernels()
    inside = [p is not None and Path(p).resolve().is_relative_to(ROOT.resolve()) for p in (engine, kernels)]
    return {"solrl_engine": engine, "solrl_triton": kernels, "from_checkout": all(inside), "checkout": str(ROOT),
            "installed_metadata": meta, "source_digest": source_digest()}  # fmt: skip


def write_json(path: Path, rec: dict[str, Any]) -> None:
    """The record written whole or not at all (temporary file, then rename): a call killed mid-write keeps the
    previous version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=2, default=str))
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--call", type=int, choices=sorted(CALLS),
                    help="one device call's stages (CALLS): 1 the GPU tests, the preflight, SANA-1.6B's trainer "
                         "iterations; 2 FLUX.1-dev's trainer iterations; 3 ceilings, SANA-1.6B's, FLUX.1-dev's and "
                         "SD3.5-L's forwards; 4 ceilings, Wan2.1-1.3B's and -14B's forwards")  # fmt: skip
    ap.add_argument("--stages", default=None, help="comma list instead of --call, run in the order given: preflight, "
                    "ceilings, gpu-tests, trainer:MODEL, forwards:MODEL")  # fmt: skip
    ap.add_argument("--budget", type=float, default=None, help="seconds this call may spend (a stage whose "
                    f"allowance does not fit in what is left is skipped; default {BUDGET:.0f}, smoke "
                    f"{SMOKE_BUDGET:.0f})")  # fmt: skip
    ap.add_argument("--out", default="bench/results/gpu-session", help="folder for gpu_session.json")
    ap.add_argument("--resolution", type=int, default=None, help="pixels for every model (default: each family's "
                    "own, as its rollouts and bench/predict.py use: SANA 1024, SD3.5-L 1024, FLUX 512)")  # fmt: skip
    ap.add_argument("--batch", action="append", default=[], help="rollout batch of a model, e.g. flux-dev=16")
    ap.add_argument("--formats", default="fp8,int8,nvfp4", help="explore formats (skipped where the device lacks one); "
                    "the forwards stages also take fp8+every-layer: FP8 on every eligible layer, not the family's rule")
    ap.add_argument("--train-batch", action="append", default=[], help="train batch of a model's nft_update, e.g. "
                    "sd35-large=1 (default: its paper preset's)")  # fmt: skip
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--no-train", action="store_true", help="no nft_update and no refresh timing")
    ap.add_argument("--no-torchao", action="store_true", help="no torchao peer")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; smoke: eager)")
    ap.add_argument("--reps", type=int, default=None, help="timed forwards per median, after 2 warm-ups (default 3; "
                    "a full-size forward is 0.3-4 s, steady on a GPU; smoke 2)")  # fmt: skip
    ap.add_argument("--gemm", default="4096x2048x2048", help="the ceilings' GEMM shape m x n x k")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny configs of the same classes, every stage")
    ap.add_argument("--digest", action="store_true", help="print this checkout's source digest and exit")
    return ap


def _allowance(stage: str, table: dict[str, float]) -> float:
    """A stage's own allowance where it has one (a 12B model's trainer), else its kind's."""
    return table.get(stage, table[stage_kind(stage)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run one call's stages, each under its own deadline, writing the JSON after every entry and printing the
    summary after every stage; a failed preflight stops the call. Returns the record (`exit_code` in it)."""
    args = build_parser().parse_args(argv)
    if args.digest:
        print(source_digest())
        return {}
    start = time.monotonic()
    smoke = args.smoke
    if args.budget is None:
        args.budget = SMOKE_BUDGET if smoke else BUDGET
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if args.stages is not None:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    else:
        stages = list(CALLS[args.call or 1])
    allowance = ALLOWANCE["smoke" if smoke else "gpu"]
    for s in stages:
        stage_kind(s)  # a misspelt stage stops here, before anything runs
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_session.json"
    cfg: dict[str, Any] = {
        "smoke": smoke, "resolution": args.resolution, "reps": args.reps or (2 if smoke else 3), "out_dir": out_dir,
        "batch": {k: int(v) for k, _, v in (b.partition("=") for b in args.batch)},
        "train_batch": {k: int(v) for k, _, v in (b.partition("=") for b in args.train_batch)},
        "train": not args.no_train, "train_allowance": TRAIN_ALLOWANCE["smoke" if smoke else "gpu"],
        "torchao": not args.no_torchao,
        "formats": [f.strip() for f in args.formats.split(",") if f.strip()],
        "compile": not args.no_compile, "compile_why": "--no-compile",
        "compile_backend": args.compile_backend or ("eager" if smoke else "inductor"),
        "compile_allowance": 1.0 if smoke else COMPILE_ALLOWANCE,
    }  # fmt: skip
    rec: dict[str, Any] = {
        "bench": "gpu-session", "call": args.call, "argv": sys.argv[1:] if argv is None else list(argv),
        "budget_s": args.budget, "stage_order": stages, "info": _device_info(device),
        "env": {k: os.environ.get(k) for k in ("SOLRL_SIMULATE_SM", "TRITON_INTERPRET", "PYTHONPATH")},
        "provenance": provenance(), "allowance_s": {s: _allowance(s, allowance) for s in stages},
        "stages": {}, "skipped": {}, "elapsed_s": 0.0, "exit_code": 0,
    }  # fmt: skip
    if smoke:
        rec["smoke"] = "CPU, tiny configs of the same diffusers classes: checks the script, measures nothing"

    def write() -> None:
        rec["elapsed_s"] = time.monotonic() - start
        write_json(path, rec)

    def save_partial(key: str, part: dict[str, Any]) -> None:
        rec["stages"][key] = {**part, "partial": True}
        write()

    gemm = (64, 32, 32) if smoke else tuple(int(v) for v in args.gemm.lower().split("x"))
    copy_mib = 4 if smoke else 512
    attention_shape = (1, 2, 300, 64) if smoke else WAN_ATTENTION  # ceilings:attention's (Wan2.1-1.3B's on a GPU)
    dev_rates = None
    stop = None
    for stage in stages:
        kind, alias = stage_kind(stage), stage.partition(":")[2]
        need = _allowance(stage, allowance)
        left = args.budget - (time.monotonic() - start)
        if stop or need > left:
            rec["skipped"][stage] = stop or f"needs about {need:.0f} s, {left:.0f} s of the budget left"
            print(f"== {stage}: skipped ({rec['skipped'][stage]})", flush=True)
            write()
            continue
        t0 = time.monotonic()
        cfg["deadline"] = t0 + need
        cfg["progress"] = partial(save_partial, stage)
        print(f"== {stage} (allowance {need:.0f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        res: dict[str, Any] = {}
        try:
            with stage_deadline(need, stage):
                if kind == "preflight":
                    res = run_preflight(device, cfg)
                elif kind == "ceilings":
                    rec["ceilings"] = res = ceilings(device, gemm, copy_mib, reps=cfg["reps"] * 4,  # type: ignore[arg-type]
                                                     attention=attention_shape if stage == "ceilings:attention"
                                                     else None,
                                                     producer_rows=(8 if smoke else 16384)
                                                     if stage == "ceilings:producers" else 0)  # fmt: skip
                elif kind == "gpu-tests":
                    res = gpu_tests_stage(cfg, need - 5.0)
                elif kind == "trainer":
                    res = trainer_stage(alias, device, cfg)
                else:
                    if "ceilings" not in rec:
                        rec["ceilings"] = ceilings(device, gemm, copy_mib, reps=cfg["reps"] * 2)  # type: ignore[arg-type]
                    if dev_rates is None:
                        dev_rates = device_from_ceilings(rec["ceilings"], str(rec["info"].get("name")))
                    res = model_stage(alias, device, cfg, dev_rates)
        except StageTimeout as e:
            res = {**rec["stages"].get(stage, {}), "timed_out": str(e)}
            res.pop("partial", None)
        except Exception as e:  # the entries written before the error stay (its step names where it was)
            res = {**rec["stages"].get(stage, {}), **_error(e, 6)}
            res.pop("partial", None)
        broken = cuda_broken(device)
        if broken:  # a sticky CUDA error (an illegal address): every later CUDA call in this process fails
            res["cuda_broken"] = broken
            stop = f"the CUDA context is broken ({broken}); the next call starts a fresh process"
            rec["exit_code"] = 4
        res["seconds"] = time.monotonic() - t0
        if device.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        rec["stages"][stage] = res
        if kind == "preflight" and not res.get("ok"):
            res["message"] = preflight_mod.failure_message(res) if "failed" in res else _why_failed(res)
            stop = f"the preflight failed: {res['message']}; nothing after it would measure what it claims"
            rec["exit_code"] = 2
        for key, s in rec["stages"].items():  # the trainer's prediction, once its model's forwards are measured
            if key.startswith("trainer:") and "families" in s:  # (smoke: the bundled model, which has none)
                s["predicted_from_forwards"] = trainer_prediction(rec, s["families"], s["model"])
        rec["summary"] = summary.summary_lines(rec)
        write()
        print(f"== {stage}: {res['seconds']:.1f} s" + (" (error)" if "error" in res else "")
              + (" (cut at its allowance)" if "timed_out" in res else ""), flush=True)  # fmt: skip
        print("\n".join(rec["summary"]), flush=True)
        if not broken:
            _release(device)
    rec["summary"] = summary.summary_lines(rec)
    if rec["skipped"]:  # the last summary printed did not know of the stages skipped after it
        print("\n".join(rec["summary"]), flush=True)
    if stop:
        print(f"STOPPED: {stop}", flush=True)
    write()
    print(f"wrote {path}")
    return rec


def _why_failed(res: dict[str, Any]) -> str:
    return str(res.get("error") or res.get("timed_out") or "it did not finish").splitlines()[0][:300]


def run_preflight(device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    """bench/preflight.py's checks on this device: kernels, one FP8 and one INT8 layer, the small denoiser's fast
    path per format, one compiled quantized layer's census, one captured sampling step. Formats the device has
    no tensor cores for are left out (NVFP4 below sm_100)."""
    smoke = cfg["smoke"]
    arch, res, batch = (TINY["flux-dev"], TINY_RES["flux-dev"], 2) if smoke else (SMALL_FLUX, 256, 4)
    small = build_model("flux-dev", device, arch, res)
    inputs = predict.forward_inputs(small, batch, device=device, dtype=torch.bfloat16)
    eight = [f for f in ("fp8", "int8") if format_unavailable(f, device) is None]
    every = [f for f in FORMATS if f in cfg["formats"] and format_unavailable(f, device) is None]
    census_fmt = eight[0] if eight else "fp8"
    pf = preflight_mod
    checks = [
        ("kernels", lambda: pf.check_kernels(device)),
        ("layers", lambda: pf.check_layers(device, eight)),
        ("fast_path_small", lambda: pf.check_fast_path_small(small, inputs, device, every)),
        ("census", lambda: pf.check_census(device, census_fmt, "inductor")),  # as the sampler compiles, smoke too
        ("capture", lambda: pf.check_capture(small, inputs, device, lambda f: graphed_ms(f, device, 2))),
    ]
    out = pf.run_checks(checks)
    out["formats"] = {"eight_bit": eight, "explore": every}
    return out


if __name__ == "__main__":
    sys.exit(main().get("exit_code", 0))
