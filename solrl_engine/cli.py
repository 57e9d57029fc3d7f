"""`solrl` command line."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="solrl",
        description="Sol-RL: explore in NVFP4, regenerate the most contrastive seeds in BF16, train on them.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser("version", help="versions, device, and which kernel backends are available")
    v.set_defaults(func=_version)
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
