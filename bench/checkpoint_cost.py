"""What a trustworthy checkpoint costs: safetensors + JSON + a SHA-256 manifest + fsync of every file
and directory (solrl_engine.store.checkpoint), against the same write without fsync and against the
pickled `torch.save` of earlier versions; plus verifying it (what --resume and `solrl verify` do),
loading it, and exporting one adapter directory with its manifest.

Two states:
- the bundled tiny model's trainer state at the quickstart config (configs/tiny.py, LoRA rank 32);
- an SD3.5-Large-sized one: the LoRA targets of solrl_engine.models.sd3 found on the real
  transformer's shapes (meta device: no weights, no download), rank 32 (the trainer's default),
  random values; trained, old and EMA adapters plus AdamW's two moments, all FP32, as the trainer
  keeps them.

    python bench/checkpoint_cost.py     # a table; bench/results/<date>-cpu-checkpoint-cost.json
    python bench/checkpoint_cost.py --reps 1 --sd3-blocks 2 --output /tmp/x.json    # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from solrl_engine.store import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def sd3_large_lora_state(rank: int = 32, blocks: int | None = None, seed: int = 0) -> dict[str, Any]:
    """A trainer-shaped state for LoRA on SD3.5-Large's attention projections (random values)."""
    import diffusers

    from solrl_engine.models.sd3 import SD3_LORA_TARGETS, SD3Model
    from solrl_engine.rl.config import RLConfig

    cfg = dict(SD3Model.FULL_CONFIG)
    if blocks is not None:
        cfg["num_layers"] = blocks
    with torch.device("meta"):
        net = getattr(diffusers, SD3Model.TRANSFORMER_CLASS)(**cfg)
    targeted = lambda n: any(n == t or n.endswith("." + t) for t in SD3_LORA_TARGETS)  # noqa: E731 - as PEFT matches
    shapes = {n: (m.in_features, m.out_features) for n, m in net.named_modules()
              if isinstance(m, torch.nn.Linear) and targeted(n)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def adapter() -> dict[str, torch.Tensor]:
        out = {}
        for n, (k, m) in shapes.items():
            out[f"{n}.lora_A"] = torch.randn(rank, k, generator=gen)
            out[f"{n}.lora_B"] = torch.randn(m, rank, generator=gen)
        return out

    train = adapter()
    opt_state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(t.shape, generator=gen),
                     "exp_avg_sq": torch.rand(t.shape, generator=gen)}
                 for i, t in enumerate(train.values())}  # fmt: skip
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True, "params": list(range(len(train)))}]  # fmt: skip
    rng = random.Random(seed)
    return {
        "iteration": 100,
        "adapters": {"default": train, "old": adapter(), "ema": adapter()},
        "opt": {"state": opt_state, "param_groups": groups},
        "prompts": {"rng": rng.getstate(), "order": list(range(50))},
        "seed_rng": random.Random(seed + 1).getstate(),
        "gen": torch.Generator().manual_seed(seed + 2).get_state(),
        "evals": [(i, 0.5, 0.01) for i in range(0, 100, 5)],
        "config": dataclasses.asdict(RLConfig(model="sd3", family="sol_rl")),
        "world_size": 8,
        "layers": len(shapes),
    }


def tiny_trainer_state(tmp: Path) -> tuple[dict[str, Any], Callable[[], None]]:
    """The bundled model's trainer state at the quickstart config, and its LoRA export."""
    from solrl_engine.rl import load_config
    from solrl_engine.rl.trainer import Trainer

    cfg = load_config(str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes"),
                      ["explore_precision=nvfp4", f"output={tmp / 'tiny_run'}"])  # fmt: skip
    tr = Trainer(cfg, progress=False)
    return tr._state(), tr.export


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(state: dict[str, Any], work: Path, reps: int, export: Callable[[], None] | None = None) -> dict[str, Any]:
    """Median seconds of each operation over `reps` runs, and the sizes written."""
    root = work / "checkpoints"
    shutil.rmtree(root, ignore_errors=True)
    times: dict[str, list[float]] = {}
    times["save_verified_fsync"] = _timed(lambda: checkpoint.save(root, 1, state), reps)
    real = os.fsync
    os.fsync = lambda fd: None  # the same write, durability off: what fsync itself costs
    try:
        times["save_verified_no_fsync"] = _timed(lambda: checkpoint.save(root, 1, state), reps)
    finally:
        os.fsync = real
    ck = checkpoint.save(root, 1, state)
    times["verify"] = _timed(lambda: (checkpoint._checked.clear(), checkpoint.verify(ck)), reps)  # hash every time
    times["load"] = _timed(lambda: checkpoint.load(ck), reps)
    legacy = work / "state.pt"
    times["save_pickle_torch_save"] = _timed(lambda: torch.save(state, legacy), reps)  # the old way: no fsync
    if export is not None:
        times["export_lora_and_lora_ema"] = _timed(export, reps)
    else:  # one adapter directory as the exporter writes it: safetensors, then sealed and renamed
        from safetensors.torch import save_file

        ema = state["adapters"]["ema"]

        def one_adapter() -> None:
            tmp = work / ".tmp_lora"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_file(ema, tmp / "pytorch_lora_weights.safetensors")
            checkpoint.seal(tmp, {"kind": "lora"})
            checkpoint.commit(tmp, work / "lora")

        times["export_one_adapter"] = _timed(one_adapter, reps)
    files = json.loads((ck / checkpoint.MANIFEST).read_text())["files"]
    sizes = {name: f["size"] for name, f in files.items()}
    tensors, _ = checkpoint.encode(state)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = sum(sizes.values())
    return {
        "bytes": sizes,
        "tensors": len(tensors),
        "legacy_state_pt_bytes": legacy.stat().st_size,
        "median_s": med,
        "all_s": times,
        "fsync_share_of_save": 1 - med["save_verified_no_fsync"] / med["save_verified_fsync"],
        "save_vs_pickle": med["save_verified_fsync"] / med["save_pickle_torch_save"],
        "save_MBps": total / med["save_verified_fsync"] / 1e6,
        "verify_MBps": total / med["verify"] / 1e6,
    }


def _filesystem(path: Path) -> str:
    best = ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines() if Path("/proc/mounts").exists() else []:
        dev, mnt, fs = line.split()[:3]
        if str(path.resolve()).startswith(mnt) and len(mnt) > len(best[2]):
            best = (dev, fs, mnt)
    return f"{best[1]} on {best[0]} (mounted at {best[2]})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sd3-rank", type=int, default=32)
    ap.add_argument("--sd3-blocks", type=int, default=None, help="fewer transformer blocks (a quick look)")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--output", default=f"bench/results/{dt.date.today()}-cpu-checkpoint-cost.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="solrl_ckcost_", dir=args.workdir))
    cases: dict[str, Any] = {}
    try:
        if not args.skip_tiny:
            state, export = tiny_trainer_state(work)
            cases["tiny (bundled model, quickstart config, LoRA r32)"] = measure(state, work, args.reps, export)
        blocks = "" if args.sd3_blocks is None else f", {args.sd3_blocks} blocks only"
        state = sd3_large_lora_state(args.sd3_rank, args.sd3_blocks)
        name = f"SD3.5-Large LoRA r{args.sd3_rank} ({state['layers']} layers{blocks}; random values)"
        cases[name] = measure(state, work, args.reps)
        fs = _filesystem(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), platform.processor())
    result = {
        "date": str(dt.date.today()),
        "device": f"cpu: {cpu}, {os.cpu_count()} cores",
        "filesystem": fs,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": __import__("safetensors").__version__,
        "reps": args.reps,
        "cases": cases,
    }
    print(f"{'case':<62} {'MiB':>8} {'save+fsync':>10} {'no fsync':>9} {'pickle':>8} {'verify':>8} {'load':>8} "
          f"{'export':>8}")  # fmt: skip
    for name, c in cases.items():
        m = c["median_s"]
        exp = m.get("export_lora_and_lora_ema", m.get("export_one_adapter"))
        print(f"{name[:62]:<62} {sum(c['bytes'].values()) / 2**20:8.1f} {m['save_verified_fsync']:10.3f} "
              f"{m['save_verified_no_fsync']:9.3f} {m['save_pickle_torch_save']:8.3f} {m['verify']:8.3f} "
              f"{m['load']:8.3f} {exp:8.3f}")  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
