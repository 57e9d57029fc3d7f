"""End-to-end seconds per iteration of each family, split into explore / regenerate / train.

Runs the real trainer (solrl_engine.rl.Trainer) for a few iterations per family on one model and
reports medians after warm-up, plus the ratios that matter: the rollout phase (explore + regenerate)
and the whole iteration of each family against `compile` (compiled + graph-captured BF16, the
strongest baseline) and `naive_scaling` (eager BF16), all measured in the same run.

    python bench/e2e.py --model tiny --paper-scale                      # bundled model, N=96 -> K=24
    python bench/e2e.py --model flux-dev --prompts 1 --rollout-batch 24  # FLUX.1-dev size, 512 px
    python bench/e2e.py --model sd35-large --prompts 1 --rollout-batch 8
    python bench/e2e.py --model sana-1.6b --prompts 2 --rollout-batch 48
    python bench/e2e.py --model wan2.1-1.3b --preset configs/wan.py:wan13b --vae --n 16 --k 4 --prompts 1 \
        --set full_steps=10 --set preview_steps=6                      # video: 480 x 832, 81 frames

Full-size models have random weights and stand-in text encoder / VAE (model_path="random" of the
family adapters in solrl_engine/models/):
the timings are of the denoiser, the LoRA update and the explore copy, which is what Sol-RL changes. `--vae` builds
the published VAE (random weights) and `--reward` / `--reward-args` name a reward, so decoding and scoring are timed
as in a user's run (the GPU session's trainer stage: a PickScore of the published size).
Writes <out>/<date>-<device>-e2e-<model>.json. Phase times exclude the sampler's one-off compilation
(CPU: inductor) and graph capture (GPU), reported apart as time_compile_s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import _device_info  # noqa: E402 - bench/ scripts share helpers without being a package

from solrl_engine.models import ARCH_ALIASES  # noqa: E402
from solrl_engine.rl.config import FAMILY_TABLE, RLConfig, apply_overrides, load_config  # noqa: E402
from solrl_engine.rl.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("naive_scaling", "compile", "naive_quant", "sol_rl")
PHASES = ("time_explore_s", "time_regen_s", "time_train_s", "time_total_s")


def family_config(family: str, args: argparse.Namespace, out: str) -> RLConfig:
    """The run of one family; everything but the family is the same across families."""
    if args.preset:  # the family's preset (its model's published settings), on the benchmark's weights
        file, _, prefix = args.preset.rpartition(":")
        base = load_config(f"{ROOT / file}:{prefix}_{family}_{args.reward or 'pickscore'}")
        base = dataclasses.replace(base, model_path=args.model_path or ("random+vae" if args.vae else "random"))
    elif args.model == "tiny":
        spec = f"{ROOT}/configs/tiny.py:tiny_{family}_shapes"
        base = load_config(spec, [f"paper_scale={str(args.paper_scale).lower()}"])
    else:
        # the family's published architecture with random weights (solrl_engine/models/<family>.py)
        path = "random+vae" if args.vae else "random"
        base = RLConfig(family=family, model=ARCH_ALIASES[args.model], model_path=path)
    over = {
        "family": family,
        "name": f"bench-{family}",
        "iterations": args.warmup + args.iterations,
        "eval_every": 10**6,
        "save_every": 10**6,
        "output": out,
        "compiled_sampler": family in ("compile", "sol_rl"),
    }
    for key in ("n", "k", "prompts_per_iter", "rollout_batch_size", "train_batch_size", "explore_precision", "reward"):
        v = getattr(args, key)
        if v is not None:
            over[key] = v
    if args.reward_args:
        over["reward_args"] = tuple(a for a in args.reward_args.split(",") if a)
    if FAMILY_TABLE[family].all_rollouts:  # diffusionnft trains on every rollout: N = K
        over["n"] = over.get("k", base.k)
    return apply_overrides(dataclasses.replace(base, **over), args.sets)


def run_family(cfg: RLConfig, warmup: int) -> dict[str, object]:
    trainer = Trainer(cfg, progress=False)
    rows = [trainer.step() for _ in range(cfg.iterations)]
    timed = rows[warmup:]
    res: dict[str, object] = {p: statistics.median(r[p] for r in timed) for p in PHASES}
    res["raw"] = [{p: r[p] for p in PHASES} for r in rows]
    res["time_rollout_s"] = res["time_explore_s"] + res["time_regen_s"]
    res["reward_mean"] = statistics.mean(r["reward_mean"] for r in timed)
    res["policy_dtype"] = str(trainer.dtype).removeprefix("torch.")
    # the update's sizes as resolved for this device (auto: from its memory), and each phase's sample-steps: the
    # units of the update's cost in forward-equivalents (gpu_session's trainer stage)
    c, rule = trainer.cfg, FAMILY_TABLE[cfg.family]
    res["update_sizes"] = {"train_batch_size": c.train_batch_size, "gradient_checkpointing": c.gradient_checkpointing,
                           "reason": trainer.plan.sizes.reason}  # fmt: skip
    res["sample_steps"] = {
        "explore": c.prompts_per_iter * c.n * (c.preview_steps if rule.preview else c.full_steps),
        "regenerate": c.prompts_per_iter * c.k * c.full_steps if rule.regenerate else 0,
        "trained": c.prompts_per_iter * c.k * max(1, int(c.full_steps * c.timestep_fraction)),
    }
    vae = getattr(getattr(trainer.model, "pipe", None), "vae", None)
    res["decode"] = type(vae).__name__ if vae is not None else "stand-in (or the bundled model's own)"
    res["reward"] = repr(trainer.reward)  # e.g. "1 * pickscore", and each part as built (its device and dtype)
    res["reward_parts"] = [repr(fn) for *_, fn in getattr(trainer.reward, "parts", [])]
    res["explore_recipe"] = trainer.explorer.recipe_label  # "policy (<dtype>)" where the policy explores
    # like-for-like: whether full-precision rollouts ran the "old" LoRA merged into a copy (as the quantized
    # copy has it) or as PEFT's unmerged branches; what the quantized layers ran; the copy's speedup bound
    res["rollout_form"] = trainer.rollout_form
    res["explore_fast_path"] = trainer.explorer.fast_path.to_dict() if trainer.explorer.fast_path else None
    res["explore_bound"] = trainer.explorer.bound
    if trainer.explore is not None:
        res["explore_quantized_layers"] = len(trainer.explore.report.quantized)
    choice = trainer.explore_spec
    if choice is not None:
        res["explore_choice_reason"] = choice.reason
        res["explore_timings_ms"] = choice.timings_ms
    st = trainer.rollouts.sampler.stats
    res["graph_captures"] = st.captures
    res["graph_capture_s"] = st.capture_s
    res["graph_replays"] = st.replays
    res["compiles"] = st.compiles
    res["compile_s"] = st.compile_s
    res["time_compile_s"] = st.overhead_s  # once per run: compile + capture, out of the phase times
    res["compile_census"] = st.census.to_dict()  # each compiled graph's GEMMs: traced scaled GEMMs, opaque ops
    if torch.cuda.is_available():
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command line, also used by bench/test_bench_e2e.py to build the same runs."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | sd35-large | flux-dev | sana-1.6b")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--paper-scale", action="store_true", help="tiny: N=96, K=24, 16 prompts")
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per family")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first (compile, capture)")
    ap.add_argument("--n", type=int)
    ap.add_argument("--k", type=int)
    ap.add_argument("--prompts", dest="prompts_per_iter", type=int)
    ap.add_argument("--rollout-batch", dest="rollout_batch_size", type=int)
    ap.add_argument("--train-batch", dest="train_batch_size", type=int)
    ap.add_argument("--explore-precision", dest="explore_precision")
    ap.add_argument("--vae", action="store_true",
                    help="full-size models: the family's published VAE with random weights (model_path=random+vae), "
                         "so the decode a run makes is timed; default: a stand-in decode")  # fmt: skip
    ap.add_argument("--preset", default=None, help="configs/FILE.py:PREFIX: each family runs its preset "
                    "PREFIX_<family>_<reward> (a model's published settings, e.g. configs/wan.py:wan13b), on the "
                    "benchmark's weights (random, or --vae, or --model-path)")  # fmt: skip
    ap.add_argument("--model-path", default=None, help="with --preset: the weights (default: random)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE on every family's config, "
                    "after the other options (e.g. full_steps=10)")  # fmt: skip
    ap.add_argument("--reward", default=None, help="the reward (default: the config's)")
    ap.add_argument("--reward-args", default=None, help="reward_args, comma-separated (e.g. pickscore.model=DIR)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return ap


def _write(
    args: argparse.Namespace,
    info: dict[str, object],
    configs: dict[str, dict[str, object]],
    results: dict[str, dict[str, object]],
    final: bool,
) -> Path:
    """The JSON of the families measured so far, with their ratios to the baselines among them."""
    ratios: dict[str, dict[str, float]] = {}
    for base in ("compile", "naive_scaling"):
        if base not in results:
            continue
        b = results[base]
        for fam, r in results.items():
            ratios.setdefault(fam, {})[f"rollout_speedup_vs_{base}"] = b["time_rollout_s"] / r["time_rollout_s"]
            ratios[fam][f"e2e_speedup_vs_{base}"] = b["time_total_s"] / r["time_total_s"]
    if final:
        for fam, v in ratios.items():
            print(f"{fam:>14}: " + "  ".join(f"{k} {x:.2f}x" for k, x in v.items()))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = str(info.get("name", "cpu")).replace(" ", "_").replace("/", "_") if info.get("device") == "cuda" else "cpu"
    path = out_dir / f"{dt.date.today().isoformat()}-{tag}-e2e-{args.model}.json"
    rec = {"bench": "e2e", "info": info, "model": args.model, "configs": configs, "results": results,
           "ratios": ratios, "complete": final}  # fmt: skip
    path.write_text(json.dumps(rec, indent=2, default=str))
    return path


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = _device_info(device)
    results: dict[str, dict[str, object]] = {}
    configs: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in families:
            cfg = family_config(fam, args, f"{tmp}/{fam}")
            configs[fam] = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("output",)}
            print(f"== {fam}: n={cfg.n} k={cfg.k} prompts={cfg.prompts_per_iter} model={cfg.model}", flush=True)
            results[fam] = run_family(cfg, args.warmup)
            r = results[fam]
            print("   " + "  ".join(f"{p[5:-2]} {r[p]:.3f}s" for p in PHASES), flush=True)
            _write(args, info, configs, results, final=False)  # a timeout keeps what finished
    path = _write(args, info, configs, results, final=True)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
