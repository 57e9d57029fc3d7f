"""Trackers are views of a run: what they are handed arrives as it was written (scalars, grids, a video run's
compare.gif), in TensorBoard's files and through wandb's API (a stand-in module here: wandb is not installed)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from solrl_engine.store.tracking import Tracker
from solrl_engine.viz import write_gif


def test_tensorboard_gets_the_gif_as_it_plays(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    gif = write_gif(tmp_path / "clip.gif", torch.rand(2, 5, 3, 16, 24, generator=torch.Generator().manual_seed(0)))
    tr = Tracker(tmp_path, ("tensorboard",), "run", {})
    tr.log({"loss": 0.5, "note": "not a number"}, 3)
    tr.video("eval/compare_video", gif, 3)
    tr.close()
    ev = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0}).Reload()
    (img,) = ev.Images("eval/compare_video")
    assert img.step == 3 and img.encoded_image_string == gif.read_bytes()
    assert (img.width, img.height) == (2 * 192, 128)  # two 24 x 16 clips side by side, scaled 8x
    assert [s.value for s in ev.Scalars("loss")] == [0.5] and "note" not in ev.Tags()["scalars"]


def test_wandb_gets_the_gif_as_a_video(tmp_path, monkeypatch):
    logged: list[tuple[dict, int]] = []

    class Video:
        def __init__(self, path: str, format: str) -> None:  # noqa: A002 - wandb's own argument name
            self.path, self.format = path, format

    run = types.SimpleNamespace(log=lambda d, step: logged.append((d, step)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **k: run, Video=Video))
    gif = write_gif(tmp_path / "clip.gif", torch.rand(1, 3, 3, 8, 8))
    tr = Tracker(tmp_path, ("wandb",), "run", {})
    tr.video("eval/compare_video", gif, 7)
    ((d, step),) = logged
    assert step == 7 and d["eval/compare_video"].path == str(gif) and d["eval/compare_video"].format == "gif"


def test_an_unknown_tracker_is_named():
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        Tracker(__import__("pathlib").Path("."), ("mlflow",), "run", {})
