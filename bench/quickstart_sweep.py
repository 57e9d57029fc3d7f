"""Sweep the quickstart's settings: each row is `solrl train CONFIG --set ...` as a user runs it.

Records, per row, the held-out curve (reward, standard error, the gain paired with the first
evaluation and its standard error), the training-prompt curve, seconds per iteration by phase and
the wall-clock time, in one JSON under bench/results/. Rows run `--jobs` at a time, each with
`--threads` threads (2 rows x 1 thread on a 2-core machine: times compare within one sweep only).

    python bench/quickstart_sweep.py --row "base:" --row "lr3e-3:lr=3e-3" --row "u2:updates_per_iter=2"
    python bench/quickstart_sweep.py --rows-file rows.txt --jobs 2 --threads 1 --tag lr
    python bench/quickstart_sweep.py --plot gains.png --from SWEEP.json --from OTHER.json

A row is NAME:SET|SET|... (SETs as for `--set`, separated by |; empty for the config as it is).
`--plot` draws the paired held-out gain of every row of recorded sweeps against the iteration, with
+-1 standard-error bands, instead of running anything.
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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_row(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    if not name:
        raise SystemExit(f"row {text!r}: write NAME:SET|SET|... (e.g. lr3e-3:lr=3e-3|iterations=40)")
    return name, [s.strip() for s in rest.split("|") if s.strip()]


def summarize(out: Path) -> dict[str, Any]:
    """The curves and timings of one finished run directory."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    done = [r for r in recs if "reward_mean" in r]
    held = [{"iter": r["iter"], "reward": r["heldout_reward"], "stderr": r["heldout_stderr"], "gain": r["heldout_gain"],
             "gain_stderr": r["heldout_gain_stderr"], "train_prompt_reward": r.get("train_prompt_reward"),
             "train_time_s": sum(x["time_total_s"] for x in recs if x["iter"] <= r["iter"])}
            for r in recs if "heldout_reward" in r]  # fmt: skip
    n = max(1, len(done))
    return {
        "heldout_start": summary["heldout_reward_start"],
        "heldout_final": summary["heldout_reward_final"],
        "gain_final": summary["heldout_gain_final"],
        "gain_stderr_final": summary["heldout_gain_stderr_final"],
        "gain_best": max((h["gain"] for h in held), default=None),
        "train_prompt_start": summary.get("train_prompt_reward_start"),
        "train_prompt_final": summary.get("train_prompt_reward_final"),
        "heldout": held,
        "s_per_iter": {k: sum(r[k] for r in done) / n for k in ("time_explore_s", "time_regen_s", "time_train_s",
                                                                "time_total_s")},  # fmt: skip
        "proxy_spearman_mean": (sum(r["proxy_spearman"] for r in done if r.get("proxy_spearman") is not None) / n
                                if any(r.get("proxy_spearman") is not None for r in done) else None),  # fmt: skip
        "explore_recipe": summary["explore_recipe"],
        "time_compile_s": summary.get("time_compile_s"),
    }


def plot(files: list[str], out: str | Path, title: str = "quickstart sweep") -> Path:
    """Held-out gain against iteration for every row of the sweep JSONs (rows that failed are left out)."""
    from solrl_engine.viz import line_plot

    series: dict[str, tuple[list[float], list[float]]] = {}
    bands: dict[str, list[float]] = {}
    for f in files:
        for name, r in json.loads(Path(f).read_text())["rows"].items():
            if not r.get("heldout"):
                continue
            pts = [(0, 0.0, 0.0)] + [(h["iter"], h["gain"], h["gain_stderr"]) for h in r["heldout"]]
            series[name] = ([p[0] for p in pts], [p[1] for p in pts])
            bands[name] = [p[2] for p in pts]
    if not series:
        raise SystemExit(f"no row with a held-out curve in {', '.join(files)}")
    return line_plot(out, series, title, "iteration", "held-out gain (paired, +-1 s.e.)", bands)


def run_row(config: str, name: str, sets: list[str], base: Path, threads: int) -> dict[str, Any]:
    out = base / name
    cmd = [sys.executable, "-m", "solrl_engine.cli", "train", config, "--output", str(out), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"[{name}] failed:\n{proc.stderr[-3000:]}", flush=True)
        return {"sets": sets, "error": proc.stderr[-3000:], "wall_s": wall}
    res = {"sets": sets, "wall_s": wall, **summarize(out)}
    print(f"[{name}] gain {res['gain_final']:+.3f} +- {res['gain_stderr_final']:.3f} (best {res['gain_best']:+.3f}), "
          f"held-out {res['heldout_start']:.3f} -> {res['heldout_final']:.3f}, {wall:.0f} s", flush=True)  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py:tiny_sol_rl_shapes")
    ap.add_argument("--row", action="append", default=[], help="NAME:SET|SET|... (repeatable)")
    ap.add_argument("--rows-file", help="one row per line (# comments)")
    ap.add_argument("--common", default="", help="SETs applied to every row, |-separated")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="sweep")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--plot", help="write this PNG from the --from sweep JSONs instead of running rows")
    ap.add_argument("--from", dest="sources", action="append", default=[], help="a recorded sweep JSON (repeatable)")
    args = ap.parse_args(argv)
    if args.plot:
        if not args.sources:
            raise SystemExit("--plot needs at least one --from SWEEP.json")
        path = plot(args.sources, args.plot, f"quickstart sweep ({args.tag})")
        print(f"wrote {path}")
        return path
    texts = list(args.row)
    if args.rows_file:
        texts += [ln.strip() for ln in Path(args.rows_file).read_text().splitlines() if ln.strip() and ln[0] != "#"]
    rows = [parse_row(t) for t in texts]
    common = [s.strip() for s in args.common.split("|") if s.strip()]
    if not rows:
        raise SystemExit("give at least one --row NAME:SET|SET|...")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futs = {name: pool.submit(run_row, args.config, name, common + sets, Path(tmp), args.threads)
                for name, sets in rows}  # fmt: skip
        results = {name: f.result() for name, f in futs.items()}
    rec = {
        "bench": f"quickstart sweep ({args.tag})",
        "command": " ".join(["python bench/quickstart_sweep.py", *(sys.argv[1:] if argv is None else argv)]),
        "config": args.config,
        "common_sets": common,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "jobs": args.jobs, "threads_per_job": args.threads},  # fmt: skip
        "rows": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}-cpu-tiny-quickstart-sweep-{args.tag}.json"
    path.write_text(json.dumps(rec, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
