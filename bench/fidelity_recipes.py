"""Rank fidelity of each explore recipe (NVFP4 variants, FP8, INT8) on the bundled model: one table, one oracle.

Every row is `solrl fidelity` on the same prompts and seeds (the full-step oracle is computed once
and cached); the columns are the issue's: Spearman, Kendall, top/bottom-K/2 overlap, the share of
the linear FLOPs in 4 bits, and the recipe's extra cost (FLOPs and bytes, as a share of the 4-bit
layers it applies to; see `extra_cost`).

    python bench/fidelity_recipes.py                      # 32 prompts x 96 seeds, K=24 (the issue's)
    python bench/fidelity_recipes.py --rows rht16,4o6 --prompts 8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

CONFIG = "configs/tiny.py:tiny_sol_rl_shapes"
ALL = "explore_layers=*"  # every layer the recipe's skip rules allow (embedders, adaLN, final proj stay)
# name -> (--set overrides, what it is)
ROWS: dict[str, tuple[list[str], str]] = {
    "bf16": (["explore_precision=bf16"], "no quantization, preview steps only (the ceiling)"),
    "fp8": (["explore_precision=fp8"], "FP8 W8A8 on Sol-RL's rule (Hopper's choice)"),
    "int8": (["explore_precision=int8"], "INT8 W8A8 on Sol-RL's rule (Ampere's choice)"),
    "all:fp8": (["explore_precision=fp8", "explore_layers=*"], "FP8 W8A8 on every eligible layer"),
    "all:int8": (["explore_precision=int8", "explore_layers=*"], "INT8 W8A8 on every eligible layer"),
    "nvfp4": (["explore_precision=nvfp4"], "NVFP4 W4A4, Sol-RL's rule (image-stream MLPs), the TE recipe"),
    "rht16": (["explore_rht=16"], "+ 16-point random Hadamard rotation along K"),
    "rht32": (["explore_rht=32"], "+ 32-point rotation"),
    "rht64": (["explore_rht=64"], "+ 64-point rotation"),
    "rht128": (["explore_rht=128"], "+ 128-point rotation"),
    "4o6": (["explore_four_over_six=true"], "+ 4-over-6 adaptive block scales"),
    "rht16+4o6": (["explore_rht=16", "explore_four_over_six=true"], "+ rotation 16 and 4-over-6"),
    "rht128+4o6": (["explore_rht=128", "explore_four_over_six=true"], "+ rotation 128 and 4-over-6"),
    "rht64+4o6": (["explore_rht=64", "explore_four_over_six=true"], "+ rotation 64 and 4-over-6"),
    "lowrank2": (["explore_lowrank=2"], "+ rank-2 BF16 branch (the largest within 10% of the bytes at width 128)"),
    "lowrank8": (["explore_lowrank=8"], "+ rank-8 BF16 branch, NVFP4 residual (over the 10% cost bound here)"),
    "lowrank8+rht128+4o6": (["explore_lowrank=8", "explore_rht=128", "explore_four_over_six=true"],
                            "+ rank-8 branch, rotation 128, 4-over-6"),  # fmt: skip
    "all:nvfp4": ([ALL], "NVFP4 W4A4 on every eligible layer"),
    "all:rht128+4o6": ([ALL, "explore_rht=128", "explore_four_over_six=true"], "every layer, rotation 128, 4-over-6"),
}


BASE = ["explore_rht=0", "explore_four_over_six=false", "explore_lowrank=0"]  # the TE recipe under every row


def row_sets(name: str) -> list[str]:
    """A row's overrides on top of the TE recipe (the preset's own recipe options are reset first)."""
    return BASE + ROWS[name][0]


def extra_cost(sets: list[str], layers: list[tuple[int, int, int]]) -> dict[str, float]:
    """Extra FLOPs and bytes of a recipe as a share of its 4-bit layers' (2 x rows x in x out FLOPs,
    in x out x 9/16 bytes of NVFP4 weights with scales). `layers` are (in, out, rows) per 4-bit layer.

    Rotation: log2(n) add/sub stages plus one scale per activation element (K (log2 n + 1) per row);
    the weight side is rotated once per update, not per step. 4-over-6: a second quantize-dequantize
    of each activation block and the error comparison, about 12 elementwise ops per element.
    Low rank r: 2 r (in + out) FLOPs per row and r (in + out) BF16 weights (2 bytes each).
    """
    kv = dict(s.split("=", 1) for s in sets)  # later entries win, as with --set
    rht, lowrank = int(kv.get("explore_rht", 0)), int(kv.get("explore_lowrank", 0))
    o46 = kv.get("explore_four_over_six", "false").lower() == "true"
    base_f = sum(2 * r * i * o for i, o, r in layers)
    base_b = sum(i * o * 9 / 16 for i, o, _ in layers)
    f = b = 0.0
    for i, o, r in layers:
        if rht:
            f += r * i * (math.log2(rht) + 1)
        if o46:
            f += r * i * 12
        if lowrank:
            f += 2 * r * lowrank * (i + o)
            b += 2 * lowrank * (i + o)
    return {"extra_flop_share": f / base_f if base_f else 0.0, "extra_byte_share": b / base_b if base_b else 0.0}


def main() -> None:
    from solrl_engine.nn import QuantLinear
    from solrl_engine.rl import load_config
    from solrl_engine.rl.fidelity import fidelity
    from solrl_engine.rl.runtime import explorer_for

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {list(ROWS)}")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--k", type=int, default=24)
    ap.add_argument("--oracle-cache", default="bench/results/.oracle-cache.json")
    ap.add_argument("--output", default=f"bench/results/{dt.date.today()}-cpu-tiny-recipes.json")
    args = ap.parse_args()
    out = Path(args.output)
    done: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    rows = done.get("rows", {})
    for name in args.rows.split(","):
        sets, what = row_sets(name), ROWS[name][1]
        t0 = time.perf_counter()
        captured: list[tuple[int, int, int]] = []
        res = fidelity(load_config(CONFIG, sets), args.prompts, args.n, args.k, oracle_cache=args.oracle_cache)
        ex = explorer_for(load_config(CONFIG, sets))  # the copy's 4-bit layers, for the cost
        fl = ex.rollouts.linear_flops(ex.copy.transformer)
        mods = dict(ex.copy.transformer.named_modules())
        for lname, fmt in fl.formats.items():
            if fmt == "nvfp4" and isinstance(mods[lname], QuantLinear):
                i, o = mods[lname].in_features, mods[lname].out_features
                captured.append((i, o, fl.layers[lname] // (2 * i * o)))
        res.pop("per_prompt", None)
        wall = time.perf_counter() - t0
        rows[name] = {"what": what, "set": sets, **res, **extra_cost(sets, captured), "wall_s": wall}
        keys = ("spearman_mean", "kendall_mean", "top_overlap_mean", "bottom_overlap_mean", "quantized_flop_share",
                "extra_flop_share", "extra_byte_share")  # fmt: skip
        print(f"{name:>22}: " + "  ".join(f"{k.removesuffix('_mean')}={rows[name][k]:.3f}" for k in keys), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "bench": "rank fidelity of NVFP4 explore recipes, bundled tiny model, shapes reward",
            "command": f"python bench/fidelity_recipes.py --prompts {args.prompts} --n {args.n} --k {args.k}",
            "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
            "rows": rows,
        }, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
