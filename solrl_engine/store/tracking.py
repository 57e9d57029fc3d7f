"""Experiment trackers for long runs: TensorBoard (offline, files under OUT/tensorboard) and,
optionally, Weights & Biases. metrics.jsonl stays the record of truth; trackers are views of it.

Chosen by the config's `log_with` (e.g. ("tensorboard",) or ("tensorboard", "wandb")); each is
imported only when asked for, with an error naming what to install.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard", "wandb")


class Tracker:
    """Scalars, image grids and videos to every configured backend; a no-op with none."""

    def __init__(
        self, out: Path, backends: tuple[str, ...], name: str, config: dict[str, Any], purge_step: int | None = None
    ) -> None:
        """`purge_step`: a resumed run's first iteration; TensorBoard drops the events a stopped run logged
        from there on (they run again), as metrics.jsonl is cut back to the checkpoint."""
        self.tb = self.wandb = None
        for b in backends:
            if b not in TRACKERS:
                raise ValueError(f"log_with: unknown tracker {b!r}; choose from {TRACKERS}")
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "log_with=tensorboard needs the tensorboard package: pip install tensorboard "
                    '(or pip install -e ".[logging]")'
                ) from e
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge_step)
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("log_with=wandb needs wandb: pip install wandb") from e
            self.wandb = wandb.init(project="solrl", name=name, dir=str(out), config=config, resume="allow")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def image(self, tag: str, image: Any, step: int) -> None:
        """A PIL image (an evaluation grid)."""
        if self.tb is not None:
            import numpy as np

            self.tb.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(image)}, step=step)

    def video(self, tag: str, gif: str | Path, step: int) -> None:
        """An animated GIF (a video run's compare.gif): TensorBoard shows it playing in its images tab (the
        GIF's bytes as the image, as TensorBoard's own video summaries are, without moviepy), wandb as a video."""
        gif = Path(gif)
        if self.tb is not None:
            from PIL import Image
            from tensorboard.compat.proto.summary_pb2 import Summary

            with Image.open(gif) as im:
                w, h = im.size
            img = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=gif.read_bytes())
            self.tb._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=img)]), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Video(str(gif), format="gif")}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
