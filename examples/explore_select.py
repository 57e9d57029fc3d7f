"""Sol-RL's explorer around a plain diffusers pipeline: explore 16 seeds per prompt in NVFP4 at 2
preview steps, keep the 4 most contrastive, regenerate them with the pipeline itself, compare.

    python examples/explore_select.py --pipeline /w/sd35-large   # or any SD3 / FLUX / SANA pipeline dir
"""

import argparse

import torch
from diffusers import DiffusionPipeline

from solrl_engine.explore import Explorer


def redness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """A stand-in reward (any (images, prompts) -> Tensor[B] works: ImageReward, PickScore, ...)."""
    return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))


ap = argparse.ArgumentParser()
ap.add_argument("--pipeline", required=True)
ap.add_argument("--resolution", type=int, default=None)
args = ap.parse_args()
pipe = DiffusionPipeline.from_pretrained(args.pipeline, torch_dtype=torch.float32)
pipe.set_progress_bar_config(disable=True)

explorer = Explorer(pipe, redness, n=16, k=4, preview_steps=2, explore_precision="nvfp4", resolution=args.resolution)
sel = explorer.select(["a red apple on a table", "a sunset over the sea"])
print("selected seeds (top 2, bottom 2):", sel.seeds)
print("proxy rewards:", sel.proxy_rewards.round(decimals=3).tolist())
regen = sel.regenerate(pipe, steps=4)  # the full-precision twins, through the stock pipeline
print("full-precision rewards:", regen.rewards.round(decimals=3).tolist())
print("proxy fidelity:", {k: round(v, 3) for k, v in sel.fidelity(regen.rewards).items() if not k.startswith("per")})
