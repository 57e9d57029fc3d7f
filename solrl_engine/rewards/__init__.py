"""Reward models behind one registry: `load_reward(name)` returns a callable
`(images [B, 3, H, W] float in [0, 1], prompts: list[str]) -> Tensor[B]`.

Adding a reward is one new file plus one line in REWARDS. Heavy scorers (ImageReward, CLIPScore,
PickScore, HPSv2) import their packages lazily, with an error naming the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]

# name -> "module:attribute" of a zero-argument factory (or class) returning the callable
REWARDS: dict[str, str] = {
    "shapes": "solrl_engine.rewards.shapes:ShapesReward",
}


def load_reward(name: str, **kwargs: object) -> RewardFn:
    """Build the reward called `name` (see REWARDS)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; available: {sorted(REWARDS)}")
    mod, attr = REWARDS[name].split(":")
    return getattr(importlib.import_module(mod), attr)(**kwargs)


__all__ = ["REWARDS", "RewardFn", "load_reward"]
