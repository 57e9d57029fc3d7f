"""The Explorer's first import path (README and examples of earlier releases): the public Explorer, Selection
and Regenerated now live in solrl_engine.explore, re-exported here. The config-built rollouts moved too:
`Rollouts` to solrl_engine.sampling.rollouts (built from a config by solrl_engine.rl.runtime.build_rollouts),
`explore_rule` to solrl_engine.explore.plan; asking this module for them says so."""

from __future__ import annotations

from typing import Any

from solrl_engine.explore import Explorer, Regenerated, Selection

__all__ = ["Explorer", "Regenerated", "Selection"]

_MOVED = {
    "Rollouts": "solrl_engine.sampling.rollouts.Rollouts (from an RLConfig: "
                "solrl_engine.rl.runtime.build_rollouts(cfg); its explore copy: solrl_engine.rl.runtime.plan_explore "
                "and build_explorer)",
    "Scored": "solrl_engine.sampling.rollouts.Scored",
    "explore_rule": "solrl_engine.explore.plan.explore_rule (it takes an ExploreSettings: "
                    "RLConfig.explore_settings())",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # an ImportError, not an AttributeError: `from ... import` would replace the message
        raise ImportError(f"solrl_engine.rollout.{name} moved: use {_MOVED[name]}")
    raise AttributeError(f"module 'solrl_engine.rollout' has no attribute {name!r}")
