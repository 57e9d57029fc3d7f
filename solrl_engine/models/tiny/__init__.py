"""The bundled default model (see MODEL_CARD.md beside this file)."""

from solrl_engine.models.tiny.model import TinyConfig, TinyT2I, load_tiny

__all__ = ["TinyConfig", "TinyT2I", "load_tiny"]
