"""Model adapters: every model presents the FlowModel interface (models/base.py).

`load_model(name)` builds one by name; the tiny bundled model needs no download. The full-size
architectures (models/archs.py) come with random weights and stand-in text encoder / VAE, for speed
benchmarks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from solrl_engine.models.base import Conditioning, FlowModel

MODELS = ("tiny", "sd35-large", "flux-dev", "sana-1.6b")


def load_model(
    name: str, path: str | Path | None = None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> FlowModel:
    """A model by name; `path` overrides where its weights come from."""
    if name == "tiny":
        from solrl_engine.models.tiny import load_tiny

        return load_tiny(path, device=device, dtype=dtype)
    if name in MODELS:  # full-size architectures for speed benchmarks (models/archs.py)
        from solrl_engine.models.archs import load_arch

        return load_arch(name, None if path is None else str(path), device=device, dtype=dtype)
    raise ValueError(f"unknown model {name!r}; available: {list(MODELS)}")


__all__ = ["Conditioning", "FlowModel", "MODELS", "load_model"]
