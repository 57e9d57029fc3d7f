"""Layer rules per 8-bit format, chosen by fidelity: `solrl fidelity --search --tolerance` for FP8 and INT8 on each
image family's tiny pipeline (and the bundled model): the largest FLOP share in the format (attention projections
and 1x1 convolutions among the candidates) whose previews rank within the tolerance of the policy's own previews.

    python bench/format_rules.py --out bench/results/2026-11-28-cpu-format-rules.json

The pipelines are the tests' tiny random-weight ones (tests/tiny_pipelines.py: the real diffusers classes at toy
widths) scored by a tiny random CLIP, and the bundled model by its own reward: this checks the search's plumbing on
every family, not what trained weights would choose. On real weights the same search is one command:

    solrl fidelity configs/sana.py:sana_sol_rl_pickscore --set model_path=... --set explore_precision=fp8 \\
        --search --tolerance 0.005
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny pipelines are built as the tests build them


def main(argv: list[str] | None = None) -> Path:
    from tiny_pipelines import SIZES, build_clip_reward, build_flux, build_sana, build_sd3

    from solrl_engine.rl import load_config
    from solrl_engine.rl.fidelity import search

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=0.005)
    ap.add_argument("--formats", default="fp8,int8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"{dt.date.today()}-cpu-format-rules.json"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clip = build_clip_reward(Path(tmp) / "clip")
        steps = ["preview_steps=2", "full_steps=4", "device=cpu"]
        cases = [("tiny", "configs/tiny.py:tiny_sol_rl_shapes", [])]
        for name, build, preset in (("sd3", build_sd3, "configs/sd3.py:sd3_sol_rl_clipscore"),
                                    ("flux", build_flux, "configs/flux1.py:flux1_sol_rl_clipscore"),
                                    ("sana", build_sana, "configs/sana.py:sana_sol_rl_clipscore")):  # fmt: skip
            path = build(Path(tmp) / name)
            cases.append((name, preset, [f"model_path={path}", f"resolution={SIZES[name]}",
                                         f"reward_args=clipscore.model={clip}"]))  # fmt: skip
        for model, preset, extra in cases:
            for fmt in args.formats.split(","):
                sets = [f"explore_precision={fmt}", *steps, *extra]
                t0 = time.perf_counter()
                res = search(load_config(str(ROOT / preset), sets), tolerance=args.tolerance, prompts=args.prompts,
                             n=args.n, k=args.k, progress=False, probe_prompts=2, probe_seeds=6)  # fmt: skip
                row = {"model": model, "format": fmt, "seconds": time.perf_counter() - t0,
                       "policy_spearman": res["policy_previews"]["spearman_mean"],
                       "target_spearman": res["target_spearman"], "verdict": res["verdict"],
                       "chosen": res["chosen"], "candidates": res["groups"], "points": res["points"],
                       "set_arg": res["set_arg"]}  # fmt: skip
                rows.append(row)
                share = res["chosen"].get("quantized_flop_share", 0.0)
                print(f"{model:<5} {fmt:<5} policy {row['policy_spearman']:+.3f} -> {len(res['chosen']['include'])} "
                      f"of {len(res['groups'])} groups, {share:.0%} of the linear FLOPs: {res['verdict']}",
                      flush=True)  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    rec = {"bench": "format-rules", "settings": settings,
           "note": "tiny random-weight pipelines of the real classes (a tiny random CLIP scores them) and the bundled "
                   "model: the search's plumbing per family and format, not what trained weights would choose",
           "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.write_text(json.dumps(rec, indent=2, default=str))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
