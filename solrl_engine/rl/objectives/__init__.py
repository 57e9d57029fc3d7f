"""Objectives: the loss a run trains its selected samples with, one handler per name behind a registry.

Why a seam: Sol-RL's explore (many seeds cheaply), select (the contrastive ones) and regenerate (those at full
precision) are not tied to one loss. The trainer asks `objective(cfg.objective)` for the settings it reads of the
config and the update it runs on an UpdateBatch; the shared part of every update (the batch, the fixed
predictions computed before the gradient pass from policies that do not change during it) is rl/update.py's.

"objective" is the loss; "family" (RLConfig.family) stays the training method's rollout recipe (which precision
explores, whether seeds are selected and regenerated): any family can train with any objective that can use its
rollouts. The registry (rl/config.py's OBJECTIVES, beside FAMILY_TABLE) holds names and where each handler lives,
imported here on first use, so the config checks a name without importing the update code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from solrl_engine.rl.config import FAMILY_TABLE, OBJECTIVES
from solrl_engine.sampling.sde import Coupling, sde_window


@dataclass(frozen=True)
class Objective:
    """One objective's handler: `settings` (a frozen dataclass with `from_config(cfg)` and `fixed`, the
    predictions its loss needs from policies fixed during the update) and `update` (one iteration's optimizer
    steps: (model, trained weights, optimizer, UpdateBatch, settings, Dist, autocast, predict, compiled) ->
    the loss statistics the trainer records)."""

    name: str
    settings: type
    update: Callable[..., dict[str, float]]


def objective(name: str) -> Objective:
    """The handler of objective `name`; a ValueError naming the registered ones otherwise."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {tuple(OBJECTIVES)}")
    return OBJECTIVES[name].load()  # (its module's Objective)


def settings_of(cfg: Any) -> Any:
    """The settings `cfg`'s objective reads of it."""
    return objective(cfg.objective).settings.from_config(cfg)


def rollout_window(cfg: Any, gen: torch.Generator | None) -> tuple[int, int] | None:
    """The SDE steps [k0, k1) `cfg`'s objective trains on for one iteration's rollouts (drawn from `gen` where the
    window moves: Flow-GRPO-Fast), or None for an objective that trains on final samples of any solver."""
    spec = OBJECTIVES[cfg.objective]
    if spec.rollout != "sde":
        return None
    return sde_window(cfg.full_steps, cfg.sde_window if spec.window else 0, cfg.sde_window_range, gen)


def preview_coupling(cfg: Any, window: tuple[int, int] | None) -> Coupling | None:
    """How sol_rl's previews are coupled to an SDE objective's regeneration on `window` (rollout_window's): its
    Brownian path, unless preview_sde is False (then the previews sample `solver` as it is); None where nothing is
    regenerated with an SDE."""
    if window is None or not FAMILY_TABLE[cfg.family].regenerate or cfg.preview_sde is False:
        return None
    return Coupling(cfg.full_steps, window)
