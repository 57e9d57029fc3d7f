"""Reward models behind one registry: `load_reward(spec, args)` returns a callable
`(images [B, 3, H, W] float in [0, 1], prompts: list[str]) -> Tensor[B]`.

`spec` is one name or a weighted sum ("pickscore:1.0,clipscore:0.5"); `args` gives each component
its keyword arguments ({"pickscore": {"model": "/w/pickscore"}}), parsed from the config's
`reward_args` strings ("pickscore.model=/w/pickscore") by `parse_reward_args`. The callable keeps
the last call's per-component scores in `last_components`, so the trainer logs every component.

Adding a reward is one new file plus one line in REWARDS. Heavy scorers import their packages lazily
and have a cheap `check_weights(**kwargs)` that `check_reward` runs before any model loads, so a
missing weight file or an offline cache miss fails at start-up with the exact file or id expected.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]

# name -> "module:attribute" of a factory (or class) taking the reward's keyword arguments
REWARDS: dict[str, str] = {
    "shapes": "solrl_engine.rewards.shapes:ShapesReward",
    "clipscore": "solrl_engine.rewards.clipscore:CLIPScore",
    "pickscore": "solrl_engine.rewards.pickscore:PickScore",
    "hpsv2": "solrl_engine.rewards.hpsv2:HPSv2",
    "imagereward": "solrl_engine.rewards.imagereward:ImageRewardScorer",
}


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """"pickscore:1.0,clipscore:0.5" -> [("pickscore", 1.0), ("clipscore", 0.5)]; a bare name has weight 1."""
    out: list[tuple[str, float]] = []
    for part in spec.split(","):
        name, _, w = part.strip().partition(":")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in {spec!r}; available: {sorted(REWARDS)}")
        try:
            weight = float(w) if w.strip() else 1.0
        except ValueError:
            raise ValueError(f"reward {spec!r}: weight {w!r} of {name} is not a number (write name:weight)") from None
        out.append((name, weight))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"reward {spec!r} names a reward twice")
    return out


def parse_reward_args(items: tuple[str, ...] | list[str]) -> dict[str, dict[str, str]]:
    """("pickscore.model=/w/ps", "hpsv2.checkpoint=/w/hps.pt") -> {"pickscore": {"model": ...}, ...}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        name, dot, arg = key.strip().partition(".")
        if not eq or not dot or not name or not arg:
            raise ValueError(f"reward_args item {item!r}: write name.key=value, e.g. pickscore.model=/w/pickscore")
        if name not in REWARDS:
            raise ValueError(f"reward_args item {item!r}: unknown reward {name!r}; available: {sorted(REWARDS)}")
        out.setdefault(name, {})[arg.strip()] = value.strip()
    return out


def _module(name: str) -> Any:
    mod, _ = REWARDS[name].split(":")
    try:
        return importlib.import_module(mod)
    except ImportError as e:
        raise ImportError(f"reward {name!r} needs {e.name or e}: pip install -e \".[rewards]\"") from e


def check_reward(spec: str, args: dict[str, dict[str, str]] | None = None) -> None:
    """Validate the spec and that every component's weights can be found, before anything loads."""
    args = args or {}
    names = [n for n, _ in parse_reward_spec(spec)]
    for extra in set(args) - set(names):
        raise ValueError(f"reward_args names {extra!r}, which is not part of reward {spec!r}")
    for name in names:
        check = getattr(_module(name), "check_weights", None)
        if check is not None:
            check(**args.get(name, {}))


class WeightedReward:
    """sum_i w_i * reward_i(images, prompts); `last_components` holds each reward's last scores."""

    def __init__(self, parts: list[tuple[str, float, RewardFn]]) -> None:
        self.parts = parts
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        total = None
        comps = {}
        for name, w, fn in self.parts:
            r = fn(images, prompts)
            if not isinstance(r, torch.Tensor) or r.shape != (len(prompts),):
                shape = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                raise TypeError(f"reward {name!r} returned {shape}; expected a Tensor[{len(prompts)}]")
            comps[name] = r.detach().float()
            total = w * r.float() if total is None else total + w * r.float().to(total.device)
        self.last_components = comps
        assert total is not None
        return total

    def __repr__(self) -> str:
        return " + ".join(f"{w:g} * {n}" for n, w, _ in self.parts)


def load_reward(spec: str, args: dict[str, dict[str, str]] | None = None, **kwargs: object) -> RewardFn:
    """Build the reward `spec` (a name from REWARDS or a weighted sum). `args` are per-reward keyword
    arguments; plain `kwargs` go to a single named reward (load_reward("shapes"))."""
    parts = parse_reward_spec(spec)
    args = args or {}
    if kwargs and len(parts) != 1:
        raise ValueError("keyword arguments apply to a single reward; use args={name: {...}} for a sum")
    built = []
    for name, w in parts:
        _, attr = REWARDS[name].split(":")
        kw = {**args.get(name, {}), **kwargs}
        built.append((name, w, getattr(_module(name), attr)(**kw)))
    return WeightedReward(built)


__all__ = ["REWARDS", "RewardFn", "WeightedReward", "check_reward", "load_reward", "parse_reward_args"]
