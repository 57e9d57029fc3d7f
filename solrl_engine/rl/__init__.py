"""Sol-RL: selection, advantages, the DiffusionNFT loss, LoRA adapters, the trainer, checkpoints."""

from solrl_engine.rl.config import FAMILIES, ConfigError, RLConfig, apply_overrides, load_config

__all__ = ["FAMILIES", "ConfigError", "RLConfig", "apply_overrides", "load_config"]
