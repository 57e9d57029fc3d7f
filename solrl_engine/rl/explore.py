"""The explore copy's first home: it is solrl_engine.explore.copy now (below rl/, so other trainers reach it as
the trainer does). Re-exported here for code that imports it from rl/."""

from solrl_engine.explore.choice import POLICY
from solrl_engine.explore.copy import ExploreCopy, unreachable_lora_layers

__all__ = ["POLICY", "ExploreCopy", "unreachable_lora_layers"]
