"""`solrl` command line."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path


def _version(_: argparse.Namespace) -> int:
    import torch

    import solrl_engine
    from solrl_engine.kernels import backend_report
    from solrl_engine.quant.recipe import auto_explore_recipe

    print(f"solrl-engine {solrl_engine.__version__}")
    print(f"python       {platform.python_version()}")
    print(f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})")
    try:
        import triton

        print(f"triton       {triton.__version__}")
    except ImportError:
        print("triton       not installed (pip install triton)")
    cap = None
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print(f"device       {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        print("device       cpu (no CUDA device)")
    print(f"explore      {auto_explore_recipe(cap)} (auto)")
    for name, state in backend_report().items():
        print(f"backend      {name:<9} {state}")
    return 0


def _pretrain_tiny(args: argparse.Namespace) -> int:
    from solrl_engine.models.tiny.pretrain import PretrainConfig, pretrain_tiny

    cfg = PretrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads)
    metrics = pretrain_tiny(args.output, cfg, resume=args.resume, device=args.device)
    print(json.dumps(metrics, indent=2))
    print(f"weights, loss.png and sample grids are in {args.output}")
    return 0


def _parse_seeds(spec: str) -> list[int]:
    """'0-15' or '1,5,9' or a mix: '0-3,10'."""
    seeds: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part.strip()[1:]:
                a, b = part.split("-", 1)
                seeds.extend(range(int(a), int(b) + 1))
            else:
                seeds.append(int(part))
    except ValueError:
        raise SystemExit(f"--seeds {spec!r}: write a range like 0-15, a list like 1,5,9, or both") from None
    return seeds


def _sample(args: argparse.Namespace) -> int:
    import torch

    from solrl_engine.data import shapes as world
    from solrl_engine.evaluation import generate
    from solrl_engine.models import load_model
    from solrl_engine.rewards import load_reward
    from solrl_engine.viz import image_grid

    if (args.prompt is None) == (args.split is None):
        raise SystemExit("give exactly one of --prompt TEXT or --split train|heldout")
    seeds = _parse_seeds(args.seeds)
    base = [args.prompt] if args.prompt else world.prompts(args.split)[: args.max_prompts]
    prompts = [p for p in base for _ in seeds]
    all_seeds = [s for _ in base for s in seeds]
    reward = load_reward(args.reward)
    try:
        reward(torch.zeros(len(base), 3, 8, 8), base)  # validates the prompts before any sampling
    except ValueError as e:
        raise SystemExit(str(e)) from None
    model = load_model(args.model, args.model_path)
    images = generate(model, prompts, all_seeds, steps=args.steps, shift=args.shift)
    rewards = reward(images, prompts).tolist()
    head = f"{args.model}, {args.steps} steps, mean {args.reward} reward {sum(rewards) / len(rewards):.3f}"
    image_grid(images, [f"{r:.2f}" for r in rewards], ncol=min(len(seeds), 16), header=head).save(args.out)
    files = [None] * len(prompts)
    if args.save_dir:
        from PIL import Image

        d = Path(args.save_dir)
        d.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images):
            name = d / f"{i:04d}_seed{all_seeds[i]}.png"
            Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(name)
            files[i] = str(name)
    if args.json:
        with open(args.json, "w") as f:
            for p, s, r, fn in zip(prompts, all_seeds, rewards, files, strict=True):
                f.write(json.dumps({"prompt": p, "seed": s, "reward": r, "file": fn}) + "\n")
    print(f"{head}; grid written to {args.out}")
    return 0


def _load_cfg(args: argparse.Namespace):  # noqa: ANN202 - RLConfig, imported lazily
    from solrl_engine.rl import ConfigError, load_config

    try:
        return load_config(args.config, args.set or [])
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def _train(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    from solrl_engine.rl.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = _load_cfg(args)
    if args.output:
        cfg = dataclasses.replace(cfg, output=args.output)
    trainer = Trainer(cfg)
    print(
        f"{cfg.name}: family {cfg.family}, N={cfg.n} -> K={cfg.k}, {cfg.prompts_per_iter} prompts/iter, "
        f"{cfg.iterations} iterations, output {trainer.out}"
    )
    if trainer.explore is not None:
        print(trainer.explore.report)
    summary = trainer.run(resume=args.resume)
    print(json.dumps(summary, indent=2))
    return 0


def _fidelity(args: argparse.Namespace) -> int:
    from solrl_engine.rl.fidelity import fidelity, write_report

    cfg = _load_cfg(args)
    res = fidelity(cfg, prompts=args.prompts, n=args.n, k=args.k)
    path = write_report(res, args.output)
    keys = ("spearman_mean", "kendall_mean", "top_overlap_mean", "bottom_overlap_mean", "time_proxy_s", "time_full_s")
    print("  ".join(f"{k}={res[k]:.3f}" for k in keys))
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="solrl",
        description="Sol-RL: explore in NVFP4, regenerate the most contrastive seeds in BF16, train on them.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser("version", help="versions, device, and which kernel backends are available")
    v.set_defaults(func=_version)

    pt = sub.add_parser("pretrain-tiny", help="train the bundled tiny model on the procedural shapes world")
    pt.add_argument("--output", required=True, help="directory for weights, checkpoints, loss.png, sample grids")
    pt.add_argument("--steps", type=int, default=6000)
    pt.add_argument("--batch-size", type=int, default=32)
    pt.add_argument("--lr", type=float, default=5e-4)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    pt.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    pt.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint.pt")
    pt.set_defaults(func=_pretrain_tiny)

    sp = sub.add_parser("sample", help="sample images, score them, write a grid with each reward under its image")
    sp.add_argument("--model", default="tiny")
    sp.add_argument("--model-path", default=None, help="weights directory (default: the bundled weights)")
    sp.add_argument("--prompt", default=None)
    sp.add_argument("--split", choices=["train", "heldout"], default=None, help="use the world's prompts instead")
    sp.add_argument("--max-prompts", type=int, default=8, help="with --split: how many prompts")
    sp.add_argument("--seeds", default="0-15", help="e.g. 0-15 or 1,5,9")
    sp.add_argument("--steps", type=int, default=10)
    sp.add_argument("--shift", type=float, default=1.0)
    sp.add_argument("--reward", default="shapes")
    sp.add_argument("--out", default="grid.png")
    sp.add_argument("--save-dir", default=None, help="also write each image as a PNG here")
    sp.add_argument("--json", default=None, help="write one JSON record per image (prompt, seed, reward, file)")
    sp.set_defaults(func=_sample)

    tr = sub.add_parser("train", help="Sol-RL post-training: solrl train configs/tiny.py:tiny_sol_rl_shapes")
    tr.add_argument("config", help="CONFIG_SPEC: path/to/config.py:function")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    tr.add_argument("--output", default=None, help="run directory (default: runs/<config name>)")
    tr.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    tr.set_defaults(func=_train)

    fi = sub.add_parser("fidelity", help="rank fidelity of quantized previews vs BF16 full-step rollouts")
    fi.add_argument("config", help="CONFIG_SPEC: path/to/config.py:function")
    fi.add_argument("--set", action="append", metavar="KEY=VALUE")
    fi.add_argument("--prompts", type=int, default=32)
    fi.add_argument("--n", type=int, default=96)
    fi.add_argument("--k", type=int, default=24)
    fi.add_argument("--output", default="fidelity.json")
    fi.set_defaults(func=_fidelity)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
