"""What the NVFP4 explore recipes cost on the real models' 4-bit layers (FLUX.1-dev, SD3.5-Large,
SANA) and on the bundled model, from the layer shapes alone (meta device: no memory, no download).

Per 4-bit layer of K inputs and N outputs, against its GEMM (2 K N FLOPs per token) and its NVFP4
weight (K N 9/16 bytes with scales):
- rank-r branch: 2 r (K + N) FLOPs per token, r (K + N) BF16 weights;
- n-point rotation of the activations: K (log2 n + 1) FLOPs per token (weights are rotated once);
- 4-over-6: a second quantize of each activation block and the error comparison, ~12 K per token.
Shares are per token, so they hold whatever the token count (layers over text and image tokens
alike); the largest rank within 10% is reported per model.

    python bench/recipe_cost.py        # prints a table, writes bench/results/<date>-recipe-cost.json
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import torch

from solrl_engine.models import model_spec
from solrl_engine.nn import plan_quantization
from solrl_engine.quant.recipe import get_recipe

RANKS = (8, 16, 32, 64, 128, 300)


def four_bit_layers(name: str, every_layer: bool = False) -> list[tuple[int, int]]:
    """(in, out) of each layer the family's explore rule puts in NVFP4 (or every eligible one)."""
    spec = model_spec(name)
    if name == "tiny":  # the shipped weights (3.5M parameters)
        from solrl_engine.models import load_model

        net = load_model("tiny").transformer
    else:
        import diffusers

        adapter = spec.adapter_object()
        with torch.device("meta"):
            net = getattr(diffusers, adapter.TRANSFORMER_CLASS)(**adapter.FULL_CONFIG)
    rule = {} if every_layer else dict(spec.explore_rule)
    rep = plan_quantization(net, get_recipe("nvfp4").with_(**rule))
    return [(d.in_features, d.out_features) for d in rep.layers if d.quantized]


def cost(layers: list[tuple[int, int]], rank: int = 0, rht: int = 0, four_over_six: bool = False) -> dict[str, float]:
    gemm = sum(2 * k * n for k, n in layers)
    weight = sum(k * n * 9 / 16 for k, n in layers)
    flops = sum(2 * rank * (k + n) + (k * (math.log2(rht) + 1) if rht else 0) + (12 * k if four_over_six else 0)
                for k, n in layers)  # fmt: skip
    return {"extra_flop_share": flops / gemm, "extra_byte_share": sum(2 * rank * (k + n) for k, n in layers) / weight}


def max_rank(layers: list[tuple[int, int]], share: float = 0.10) -> int:
    """The largest rank whose branch stays within `share` of the 4-bit layers' FLOPs and bytes."""
    r = 0
    while max(cost(layers, r + 1).values()) <= share:
        r += 1
    return r


def main() -> None:
    out: dict[str, object] = {"bench": __doc__.splitlines()[0], "models": {}}
    for name in ("tiny", "flux", "sd3", "sana"):
        for every in (False, True):
            layers = four_bit_layers(name, every)
            key = f"{name}{':every_layer' if every else ''}"
            row = {
                "layers": len(layers),
                "shapes": sorted({f"{k}x{n}" for k, n in layers}),
                "lowrank": {r: cost(layers, r) for r in RANKS},
                "max_rank_within_10pct": max_rank(layers),
                "rht16": cost(layers, rht=16),
                "rht128": cost(layers, rht=128),
                "four_over_six": cost(layers, four_over_six=True),
            }
            out["models"][key] = row  # type: ignore[index]
            print(f"{key:>18}: {len(layers)} layers, max rank within 10% = {row['max_rank_within_10pct']}, "
                  f"rank 16: +{row['lowrank'][16]['extra_flop_share']:.1%} FLOPs "
                  f"+{row['lowrank'][16]['extra_byte_share']:.1%} bytes, "
                  f"rht128 +{row['rht128']['extra_flop_share']:.2%}, "
                  f"4o6 +{row['four_over_six']['extra_flop_share']:.2%}")
    path = Path(f"bench/results/{dt.date.today()}-recipe-cost.json")
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
