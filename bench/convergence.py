"""Held-out reward against wall-clock training time for sol_rl, naive_scaling and diffusionnft on
the bundled model, at equal time budgets, and Sol-RL's convergence speedup.

Each family runs its own config (configs/tiny.py:tiny_<family>_shapes, the same `--set`s for all)
one after another in this process, until its training time (explore + regenerate + update, without
evaluation or compilation) reaches `--budget-s`, evaluating the EMA adapter after every
`--eval-every-s` seconds of training (the same time grid for every family) on the same held-out
prompts and seeds. All families start from the same model, so the
first evaluation is shared and the gains are paired image by image.

The convergence speedup (the paper's "up to 4.64x faster convergence than DiffusionNFT"): the time
diffusionnft takes to reach its best held-out reward, over the time sol_rl takes to first reach
that reward (diffusionnft's best is a maximum over noisy evaluations, so the target is, if
anything, set high). With several `--seeds`, each seed is one comparison and the ratio is reported
per seed and as the median.

    python bench/convergence.py                               # 300 s per family, seed 0
    python bench/convergence.py --budget-s 240 --seeds 0,1 --set lr=2e-3

Writes <out>/<date>-cpu-tiny-convergence.json and a plot beside it (.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solrl_engine.rl.config import load_config  # noqa: E402
from solrl_engine.rl.trainer import Trainer  # noqa: E402
from solrl_engine.viz import line_plot  # noqa: E402

FAMILIES = ("sol_rl", "naive_scaling", "diffusionnft")


def run_family(family: str, sets: list[str], seed: int, budget_s: float, eval_every_s: float, out: Path
               ) -> dict[str, Any]:  # fmt: skip
    """One family until `budget_s` seconds of training: its curve [(train seconds, iteration, held-out
    reward, standard error, paired gain, its standard error)] and per-phase seconds per iteration."""
    cfg = load_config(f"{ROOT}/configs/tiny.py:tiny_{family}_shapes", [*sets, f"seed={seed}"])
    cfg = dataclasses.replace(cfg, output=str(out), iterations=10**6, eval_every=10**6, save_every=10**6)
    tr = Trainer(cfg, progress=False)
    out.mkdir(parents=True, exist_ok=True)

    def point(t: float) -> dict[str, float]:
        tr.evaluate()
        (it, mean, sem), (_, gain, gain_sem) = tr.evals[-1], tr.gains[-1]
        p = {"train_s": t, "iter": it, "reward": mean, "stderr": sem, "gain": gain, "gain_stderr": gain_sem}
        print(f"  {family:>13} seed {seed}: {t:6.1f} s  iter {it:3d}  held-out {mean:.3f} +- {sem:.3f}  "
              f"gain {gain:+.3f} +- {gain_sem:.3f}", flush=True)  # fmt: skip
        return p

    curve, rows, t, last = [point(0.0)], [], 0.0, 0.0
    while t < budget_s:
        m = tr.step()
        rows.append(m)
        t += m["time_total_s"]
        if t - last >= eval_every_s or t >= budget_s:  # the same time grid for every family
            curve.append(point(t))
            last = t
    phases = ("time_explore_s", "time_regen_s", "time_train_s", "time_total_s")
    done = [r for r in rows if "reward_mean" in r]
    return {
        "curve": curve,
        "iterations": tr.iteration,
        "s_per_iter": {p: statistics.mean(r[p] for r in done) for p in phases},
        "explore": tr.explorer.recipe_label,
        "policy_dtype": str(tr.dtype).removeprefix("torch."),
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "output"},
    }


def first_time_at(curve: list[dict[str, float]], target: float) -> float | None:
    """Training seconds of the first evaluation at or above `target` (None: never)."""
    return next((p["train_s"] for p in curve if p["reward"] >= target), None)


def speedup(sol: list[dict[str, float]], nft: list[dict[str, float]], baseline: str = "diffusionnft"
            ) -> dict[str, Any]:  # fmt: skip
    """The baseline's (diffusionnft's) time to its best held-out reward over sol_rl's time to first reach it, and
    sol_rl's final held-out reward against the baseline's, with their paired gains' standard errors."""
    best = max(nft[1:], key=lambda p: p["reward"])  # the starting point is shared, not a result
    final = {"sol_rl_final_gain": sol[-1]["gain"], "sol_rl_final_gain_stderr": sol[-1]["gain_stderr"],
             f"{baseline}_final_gain": nft[-1]["gain"], f"{baseline}_final_gain_stderr": nft[-1]["gain_stderr"]}
    if best["reward"] <= nft[0]["reward"]:  # nothing to converge to: no ratio, said so
        return {f"{baseline}_best_reward": best["reward"], "speedup": None, **final,
                "note": f"{baseline} never rose above the shared start within the budget"}  # fmt: skip
    t_sol = first_time_at(sol[1:], best["reward"])
    return {f"{baseline}_best_reward": best["reward"], f"{baseline}_time_s": best["train_s"],
            "sol_rl_time_s": t_sol, "speedup": (best["train_s"] / t_sol) if t_sol else None, **final}  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--budget-s", type=float, default=300.0, help="training seconds per family")
    ap.add_argument("--eval-every-s", type=float, default=20.0, help="evaluate after this much training time")
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (prompts, seeds, LoRA init)")
    ap.add_argument("--set", action="append", default=[], help="key=value for every family's config")
    ap.add_argument("--set-family", action="append", default=[], metavar="FAMILY:KEY=VALUE",
                    help="key=value for one family's config, e.g. sol_rl:preview_sde=True")
    ap.add_argument("--baseline", default="diffusionnft", help="the family sol_rl's convergence speedup is over")
    ap.add_argument("--tag", default="", help="a suffix of the record's name, e.g. flow_grpo")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    own: dict[str, list[str]] = {f: [] for f in families}
    for item in args.set_family:
        fam, colon, kv = item.partition(":")
        if not colon or fam not in own or "=" not in kv:
            raise SystemExit(f"--set-family {item!r}: write FAMILY:KEY=VALUE with FAMILY one of {families}")
        own[fam].append(kv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for fam in families:
                runs[f"{fam}/seed{seed}"] = run_family(fam, [*args.set, *own[fam]], seed, args.budget_s,
                                                       args.eval_every_s, Path(tmp) / f"{fam}-{seed}")  # fmt: skip
    ratios = {}
    if {"sol_rl", args.baseline} <= set(families):
        for seed in seeds:
            sol, base = runs[f"sol_rl/seed{seed}"]["curve"], runs[f"{args.baseline}/seed{seed}"]["curve"]
            ratios[f"seed{seed}"] = speedup(sol, base, args.baseline)
        got = [r["speedup"] for r in ratios.values() if r["speedup"] is not None]
        ratios["median_speedup"] = statistics.median(got) if len(got) == len(seeds) else None
    for k, v in ratios.items():
        print(f"{k}: {v}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{dt.date.today().isoformat()}-cpu-tiny-convergence{'-' + args.tag if args.tag else ''}"
    rec = {
        "bench": "convergence: held-out reward against training time at equal budgets",
        "command": " ".join(["python bench/convergence.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},  # fmt: skip
        "budget_s": args.budget_s,
        "sets": args.set,
        "family_sets": {f: v for f, v in own.items() if v},
        "runs": runs,
        "convergence": ratios,
    }
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=2, default=str))
    # every family starts from the same model and is evaluated on the same images: the paired gain over
    # that shared start has a far smaller standard error than the reward itself
    series = {k: ([p["train_s"] for p in r["curve"]], [p["gain"] for p in r["curve"]]) for k, r in runs.items()}
    bands = {k: [p["gain_stderr"] for p in r["curve"]] for k, r in runs.items()}
    line_plot(stem.with_suffix(".png"), series, "bundled model, shapes reward: held-out gain (EMA, paired)",
              "training time (s, without evaluation)", "held-out reward - start", bands)  # fmt: skip
    print(f"wrote {stem.with_suffix('.json')} and .png")
    return stem.with_suffix(".json")


if __name__ == "__main__":
    main()
