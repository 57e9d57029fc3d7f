"""`solrl pretrain-tiny` with a short budget: the loss falls, artefacts are written, resume works."""

from __future__ import annotations

import json

import pytest

from solrl_engine.models.tiny import TinyConfig, load_tiny
from solrl_engine.pretrain import PretrainConfig, pretrain_tiny
from solrl_engine.store import checkpoint

SMALL = TinyConfig(num_layers=1, heads=2, head_dim=16, text_dim=32, text_layers=1)


@pytest.mark.slow
def test_short_pretraining_lowers_the_loss_and_resumes(tmp_path):
    cfg = PretrainConfig(
        steps=60, batch_size=16, lr=2e-3, warmup=5, log_every=5, save_every=30, sample_every=1000, eval_seeds=1
    )
    half = PretrainConfig(**{**cfg.__dict__, "steps": 30})
    pretrain_tiny(tmp_path, half, model_config=SMALL, progress=False)
    assert checkpoint.verify(tmp_path / "checkpoints" / "iter_000030").status == "ok"
    metrics = pretrain_tiny(tmp_path, cfg, model_config=SMALL, resume=True, progress=False)
    losses = checkpoint.load(checkpoint.pick(tmp_path / "checkpoints"))["losses"]
    steps = [s for s, _ in losses]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # resumed, not restarted
    assert losses[-1][1] < 0.7 * losses[0][1]
    for name in ("loss.png", "samples_final.png", "model.safetensors", "config.json", "metrics.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 60
    assert 0 <= metrics["heldout_reward_mean"] <= 1
    load_tiny(tmp_path)  # the output directory is a loadable model
