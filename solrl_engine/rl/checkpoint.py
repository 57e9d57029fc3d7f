"""Atomic checkpoints: written to a temporary directory, then renamed, keeping the last few.

A crash mid-write leaves the previous checkpoint intact; `latest()` only returns complete ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

DONE = "COMPLETE"


def save(root: str | Path, iteration: int, state: dict[str, Any], keep: int = 2) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp_iter_{iteration:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    (tmp / DONE).write_text(str(iteration))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(p for p in root.glob("iter_*") if (p / DONE).exists())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory under `root`, or None."""
    done = sorted(p for p in Path(root).glob("iter_*") if (p / DONE).exists())
    return done[-1] if done else None


def load(path: str | Path) -> dict[str, Any]:
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
