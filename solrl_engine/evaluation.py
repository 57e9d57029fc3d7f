"""Mean reward of a model on a prompt set: the number every model card and RL curve reports."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from solrl_engine.models.base import FlowModel
from solrl_engine.rewards import RewardFn
from solrl_engine.sampling import sample


@torch.no_grad()
def generate(
    model: FlowModel,
    prompts: Sequence[str],
    seeds: Sequence[int],
    steps: int = 10,
    shift: float = 1.0,
    batch_size: int = 64,
    solver: str = "euler",
    transformer: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] for (prompts[i], seeds[i]), no guidance."""
    cond = model.encode_prompts(list(prompts))
    x0 = sample(
        model, cond, list(seeds), steps, shift=shift, solver=solver, batch_size=batch_size, transformer=transformer
    )
    return model.decode(x0)


@torch.no_grad()
def evaluate(
    model: FlowModel,
    reward: RewardFn,
    prompts: Sequence[str],
    seeds_per_prompt: int = 4,
    steps: int = 10,
    seed0: int = 0,
    batch_size: int = 64,
) -> dict[str, float]:
    """Mean / std of `reward` over prompts x seeds (seeds seed0 .. seed0 + seeds_per_prompt - 1)."""
    ps = [p for p in prompts for _ in range(seeds_per_prompt)]
    seeds = [seed0 + j for _ in prompts for j in range(seeds_per_prompt)]
    images = generate(model, ps, seeds, steps, batch_size=batch_size)
    r = reward(images, ps).float()
    return {"reward_mean": r.mean().item(), "reward_std": r.std().item(), "n": len(ps)}
