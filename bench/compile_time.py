"""Cold compile seconds of a denoiser, whole module vs regional (its repeated block once), as depth grows.

Why: on a fresh GPU machine every compile is cold, and a whole-module compile traces and generates code
for every block; the compiled sampler compiles a rollout copy's repeated block once and reuses it
(solrl_engine.sampling.compile). This measures both on the bundled model's SD3 class at two depths, each
in a fresh process with an empty inductor cache (truly cold), as the first forward's seconds.

    python bench/compile_time.py --layers 6,24 --out bench/results/DATE-cpu-compile-time.json

Runs on a CPU (inductor's C++ backend) or a GPU (Triton); the ratio, not the absolute seconds, is what
carries over between them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHILD = r"""
import json, sys, time, torch
from solrl_engine.models.tiny.model import TinyConfig, TinyT2I
from solrl_engine.models import model_spec
from solrl_engine.explore.choice import POLICY
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.sampling.compile import Census, census_backend, compile_regions

layers, how, batch = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])  # argv[4]: timed forwards after two
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = TinyT2I(TinyConfig(num_layers=layers)).to(dev)
spec = model_spec("tiny")
net = ExploreCopy(model.transformer, POLICY).transformer
census = Census()
backend = census_backend(census)
if how == "regional":
    compile_regions(net, backend, spec.repeated_blocks)
    fwd = net
else:
    fwd = torch.compile(net, backend=backend, dynamic=False)
c = model.encode_prompts(["a red circle"] * batch)
x = torch.randn(batch, 3, 32, 32, device=dev)
t = torch.full((batch,), 500.0, device=dev)
kw = dict(hidden_states=x, encoder_hidden_states=c.hidden, pooled_projections=c.pooled, timestep=t, return_dict=False)
def timed():
    t0 = time.perf_counter(); fwd(**kw)
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0

with torch.no_grad():
    cold = timed()
    warm = timed()
    runs = sorted(timed() for _ in range(int(sys.argv[4])))
print(json.dumps({"compile_s": cold, "second_call_s": warm, "forward_ms_median": 1e3 * runs[len(runs) // 2],
                  "forward_ms_min": 1e3 * runs[0], "graphs": len(census.graphs), "census": census.to_dict()}))
"""


def measure(layers: int, how: str, batch: int, reps: int = 5) -> dict[str, Any]:
    """One cold compile in a fresh process with its own empty inductor cache, then `reps` timed forwards."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=str(Path(cache) / "triton"))
        r = subprocess.run([sys.executable, "-c", CHILD, str(layers), how, str(batch), str(reps)], capture_output=True,
                           text=True, env=env, timeout=1800)  # fmt: skip
    if r.returncode:
        return {"error": r.stderr[-1500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="6,24", help="transformer depths to compile (comma-separated)")
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7, help="timed forwards after the compile (median and min kept)")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    import torch

    rows = []
    for layers in (int(v) for v in args.layers.split(",")):
        row: dict[str, Any] = {"layers": layers}
        for how in ("whole", "regional"):
            row[how] = measure(layers, how, args.batch, args.reps)
            r, nan = row[how], float("nan")
            print(f"{layers:3d} layers, {how:8s}: {r.get('compile_s', nan):6.1f} s cold, {r.get('graphs', '?')} "
                  f"graphs, forward {r.get('forward_ms_median', nan):.1f} ms", flush=True)  # fmt: skip
        if "compile_s" in row["whole"] and "compile_s" in row["regional"]:
            row["whole_over_regional"] = row["whole"]["compile_s"] / row["regional"]["compile_s"]
            row["regional_forward_over_whole"] = (row["regional"]["forward_ms_median"]
                                                  / row["whole"]["forward_ms_median"])  # fmt: skip
        rows.append(row)
    res = {
        "what": "cold torch.compile (inductor, default mode) of the bundled model's SD3 transformer: whole module "
                "vs its repeated block compiled once (regional), first forward's seconds, fresh process and cache; "
                "then the compiled forward's time (median of --reps after two calls)",
        "command": "python bench/compile_time.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": str(dt.date.today()),
        "machine": {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__},  # fmt: skip
        "batch": args.batch,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
