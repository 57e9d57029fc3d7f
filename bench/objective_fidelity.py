"""How faithfully Sol-RL's previews rank seeds for each objective: `solrl fidelity` (rl/fidelity.py) on the bundled
model for every pairing of the previews (`dpm2`: the ODE; `flow_sde`: Flow-GRPO's SDE with its own noise;
`flow_sde_coupled`: the SDE on the regeneration's Brownian path, preview_sde's default for an SDE objective) with the
finals the objective trains on (nft: the ODE at the full steps; flow_grpo: its SDE on every step but the last;
flow_grpo_fast: its SDE on a window of 2 steps, Euler elsewhere). Coupling needs an SDE regeneration: nft has no
coupled row. The previews run in the explore precision (NVFP4, the preset's
recipe) at preview_steps. On a random-weight-free but tiny model this measures the plumbing and the SDE's effect on
ranking, not a real model's numbers.

    python bench/objective_fidelity.py --prompts 16 --n 16

Writes <out>/<date>-cpu-tiny-objective-fidelity.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from solrl_engine.rl.config import load_config  # noqa: E402
from solrl_engine.rl.fidelity import fidelity  # noqa: E402

# the previews' settings per row
PREVIEWS = {"dpm2": ["solver=dpm2", "preview_sde=False"], "flow_sde": ["solver=flow_sde", "preview_sde=False"],
            "flow_sde_coupled": ["solver=dpm2"]}  # fmt: skip
OBJECTIVES = ("nft", "flow_grpo", "flow_grpo_fast")
KEEP = ("spearman_mean", "kendall_mean", "top_overlap_mean", "bottom_overlap_mean", "proxy_reward_mean",
        "full_reward_mean")  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], help="key=value for every pairing's config")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    rows = []
    for previews, sets in PREVIEWS.items():
        for obj in OBJECTIVES:
            if previews == "flow_sde_coupled" and obj == "nft":
                continue
            cfg = load_config(f"{ROOT}/configs/tiny.py:tiny_sol_rl_shapes",
                              ["explore_precision=nvfp4", *sets, f"objective={obj}", *args.set])
            res = fidelity(cfg, prompts=args.prompts, n=args.n, k=args.k, progress=False)
            row = {"previews": previews, "objective": obj, "coupled": res["previews_coupled"],
                   **{k: res[k] for k in KEEP if k in res}}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}-cpu-tiny-objective-fidelity.json"
    rec = {
        "bench": "objective fidelity: preview-vs-final rank fidelity for each previews solver x objective's finals",
        "command": " ".join(["python bench/objective_fidelity.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__},  # fmt: skip
        "prompts": args.prompts, "n": args.n, "k": args.k, "sets": args.set,
        "pairings": rows,
    }
    path.write_text(json.dumps(rec, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
