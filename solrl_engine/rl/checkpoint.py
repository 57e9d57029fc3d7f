"""Atomic checkpoints: written to a temporary directory, then renamed, keeping the last few.

A crash mid-write leaves the previous checkpoint intact; `latest()` only returns complete ones.
`prepare_output` guards a run directory before anything loads: an existing run is never
overwritten without --resume or --overwrite, and an unwritable or full disk fails at once.
"""

from __future__ import annotations

import os
import shutil
import time
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
    pause = float(os.environ.get("SOLRL_CHECKPOINT_PAUSE_S", "0") or 0)
    if pause > 0:  # a test hook: hold the writer mid-checkpoint so a kill can land there
        (tmp / "PAUSED").write_text("")
        time.sleep(pause)
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


RUN_FILES = ("metrics.jsonl", "config.json", "summary.json", "reward.png", "quantization.txt")
# the EMA adapter of the best held-out evaluation, and the file inside it that says which one that was
BEST_LORA, BEST_INFO = "lora_best", "solrl_best.json"
RUN_DIRS = ("checkpoints", "lora", "lora_ema", BEST_LORA, "tensorboard")
MIN_FREE_BYTES = 64 * 2**20


def prepare_output(out: str | Path, resume: bool = False, overwrite: bool = False) -> Path:
    """Check (and with `overwrite`, clear) a run directory before training starts.

    Raises FileExistsError when `out` holds a run and neither `resume` nor `overwrite` is set (nothing
    is touched), PermissionError when it cannot be written, OSError when its disk is nearly full."""
    out = Path(out)
    existing = [f for f in RUN_FILES + RUN_DIRS if (out / f).exists()] + [p.name for p in out.glob("eval_*.png")]
    if existing and not resume and not overwrite:
        raise FileExistsError(
            f"{out} already holds a run ({', '.join(sorted(existing)[:4])}...): pass --resume to continue it, "
            "--overwrite to start over in it, or choose another --output"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".solrl_write_test"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"cannot write to the output directory {out}: {e}; choose a writable --output") from e
    free = shutil.disk_usage(out).free
    if free < MIN_FREE_BYTES:
        raise OSError(
            f"only {free / 2**20:.0f} MiB free on the disk of {out}: checkpoints need room; free space or choose "
            "another --output (the run has not started)"
        )
    if overwrite and not resume:
        for f in RUN_FILES:
            (out / f).unlink(missing_ok=True)
        for p in out.glob("eval_*.png"):
            p.unlink()
        for d in RUN_DIRS:
            shutil.rmtree(out / d, ignore_errors=True)
    return out
