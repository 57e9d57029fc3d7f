"""Model adapters: every model presents the FlowModel interface (models/base.py).

`load_model(name)` builds one by name; the tiny bundled model needs no download.
"""

from __future__ import annotations

from pathlib import Path

import torch

from solrl_engine.models.base import Conditioning, FlowModel

MODELS = ("tiny",)


def load_model(
    name: str, path: str | Path | None = None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> FlowModel:
    """A model by name; `path` overrides where its weights come from."""
    if name == "tiny":
        from solrl_engine.models.tiny import load_tiny

        return load_tiny(path, device=device, dtype=dtype)
    raise ValueError(f"unknown model {name!r}; available: {list(MODELS)}")


__all__ = ["Conditioning", "FlowModel", "MODELS", "load_model"]
