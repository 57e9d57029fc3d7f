"""What the paper presets resolve to on the GPUs the project is lent (rl/runtime.resolve -> RunPlan, as `solrl plan`
prints it): the update's auto micro-batch and recompute, the explore precisions auto chooses among, the memory peak.
Fake tensors from the published configs: nothing is loaded, every number is an estimate no GPU has checked.

    python bench/run_plans.py     # one line per plan, writes bench/results/<date>-run-plans.json
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import torch

from solrl_engine.rl.config import load_config
from solrl_engine.rl.runtime import Target, resolve

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"sana": "configs/sana.py:sana_sol_rl_pickscore", "flux1": "configs/flux1.py:flux1_sol_rl_pickscore",
           "sd3": "configs/sd3.py:sd3_sol_rl_pickscore"}  # fmt: skip
GPUS = {"h100": (80.0, (9, 0)), "h200": (141.0, (9, 0)), "b200": (180.0, (10, 0))}


def main() -> None:
    rows = {}
    for preset, spec in PRESETS.items():
        cfg = load_config(str(ROOT / spec))
        for gpu, (gib, sm) in GPUS.items():
            run = resolve(cfg, Target.gpu(gib, 1, sm), show=True)
            d = {k: v for k, v in run.to_dict().items() if k != "memory"}
            mem = run.memory
            d["memory"] = {"peak_gib": mem.peak_gib, "peak_phase": mem.peak_phase, "fits": mem.fits,
                           "update_activations_gib": mem.update_activations_gib}  # fmt: skip
            d["command"] = f"solrl plan {spec} --gpu-memory {gib:g} --sm {sm[0]}{sm[1]}"
            rows[f"{preset}-{gpu}"] = d
            s = run.sizes
            print(f"{preset:6s} {gpu}: micro-batch {s.train_batch_size}, recompute {s.recompute}; peak "
                  f"{mem.peak_gib:.1f} GiB ({mem.peak_phase}); explore {[e.precision for e in run.explore]}",
                  flush=True)  # fmt: skip
    out = ROOT / "bench" / "results" / f"{dt.date.today().isoformat()}-run-plans.json"
    out.write_text(json.dumps({
        "what": "the paper presets resolved for one H100 (80 GiB), H200 (141 GiB) and B200 (180 GiB) as `solrl plan "
                "--sm` resolves them: the update's auto sizes, auto's explore candidates, the memory plan's peak; "
                "fake tensors from the published configs, estimates never compared with a GPU",
        "date": dt.date.today().isoformat(), "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
