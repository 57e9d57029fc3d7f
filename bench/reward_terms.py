"""Which terms of the `shapes` reward a trained adapter moved, against the bundled base model.

The held-out gain is one number; this splits it into the reward's own terms (each object's presence,
shape and size, the relation, the clutter, the best template IoU) on the same prompts and seeds, so
one can see what RL learned and where the headroom is:

    python bench/reward_terms.py --lora runs/tiny_sol_rl_shapes/lora_ema --seeds 8

Writes bench/results/DATE-cpu-tiny-reward-terms.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from solrl_engine.cli import load_lora_into
from solrl_engine.data import shapes as world
from solrl_engine.evaluation import generate
from solrl_engine.models.tiny import load_tiny
from solrl_engine.rewards import shapes

ROOT = Path(__file__).resolve().parents[1]
TERMS = ("presence", "shape", "size", "relation", "clutter")


def terms(lora: str | None, prompts: list[str], seeds: int, steps: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Mean of every term and the per-image rewards. Per-object terms are [first object, second object],
    the second over two-object prompts only; the relation over prompts that name one."""
    model = load_tiny()
    if lora:
        load_lora_into(model.transformer, lora)
    ps = [p for p in prompts for _ in range(seeds)]
    images = generate(model, ps, [j for _ in prompts for j in range(seeds)], steps)
    d = shapes.score(images, ps, details=True)
    assert isinstance(d, dict)
    scenes = [world.parse(p) for p in ps]
    two = torch.tensor([len(s.objects) == 2 for s in scenes])  # the second slot is empty otherwise
    rel = torch.tensor([s.relation is not None for s in scenes])

    def per_object(v: torch.Tensor) -> list[float]:
        return [v[:, 0].mean().item(), v[two, 1].mean().item() if two.any() else float("nan")]

    out: dict[str, Any] = {"reward": d["reward"].mean().item()}
    for k in TERMS:
        v = d[k].float()
        out[k] = per_object(v) if v.dim() > 1 else (v[rel] if k == "relation" else v).mean().item()
    out["best_template_iou"] = per_object(d["iou"].amax(-1))
    out["images"], out["two_object_images"], out["relation_images"] = len(ps), int(two.sum()), int(rel.sum())
    return out, d["reward"]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lora", required=True, help="an exported adapter directory (a run's lora/ or lora_ema/)")
    ap.add_argument("--prompts", default="heldout", help="prompt split of the shapes world (heldout, train)")
    ap.add_argument("--max-prompts", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=8, help="seeds per prompt (0 .. N-1)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    prompts = world.prompts(args.prompts)[: args.max_prompts]
    base, r0 = terms(None, prompts, args.seeds, args.steps)
    tuned, r1 = terms(args.lora, prompts, args.seeds, args.steps)
    diff = r1 - r0
    rec = {
        "bench": "shapes reward terms, base vs adapter (same prompts and seeds)",
        "command": " ".join(["python bench/reward_terms.py", *(argv if argv is not None else sys.argv[1:])]),
        "lora": args.lora,
        "prompts": f"{args.prompts}[:{args.max_prompts}] x seeds 0..{args.seeds - 1}",
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },  # fmt: skip
        "base": base,
        "adapter": tuned,
        "paired_gain": diff.mean().item(),
        "paired_gain_stderr": (diff.std() / len(diff) ** 0.5).item(),
    }
    for k in ("reward", *TERMS, "best_template_iou"):
        print(f"{k:>18}: {json.dumps(base[k])} -> {json.dumps(tuned[k])}")
    print(f"paired gain {rec['paired_gain']:+.3f} +- {rec['paired_gain_stderr']:.3f} ({len(diff)} images)")
    name = f"{dt.date.today().isoformat()}-cpu-tiny-reward-terms.json"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
