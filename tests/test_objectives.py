"""The objective seam (rl/objectives/, rl/config.py's OBJECTIVES): DiffusionNFT is one handler behind the registry,
an unknown name is refused at config time with the registered ones, and another objective plugs in through the
registry alone: the trainer runs its settings and its update, nothing else of the engine changes."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import pytest
import torch

from solrl_engine.rl.config import OBJECTIVES, ConfigError, ObjectiveSpec, RLConfig
from solrl_engine.rl.objectives import Objective, objective, settings_of
from solrl_engine.rl.objectives.nft import NFTSettings, nft_update


def test_diffusionnft_is_the_default_objective_behind_the_registry():
    cfg = RLConfig(name="t", model="tiny")
    assert cfg.objective == "nft" and objective("nft").update is nft_update
    assert isinstance(settings_of(cfg), NFTSettings) and settings_of(cfg).kl_beta == cfg.kl_beta
    with pytest.raises(ConfigError, match=r"objective = 'grpo': unknown objective; choose one of \('nft', "
                                          r"'flow_grpo', 'flow_grpo_fast', 'awm'\)"):
        RLConfig(name="t", model="tiny", objective="grpo").validate()
    with pytest.raises(ValueError, match="unknown objective 'grpo'"):
        objective("grpo")


@dataclass(frozen=True)
class ToySettings:
    """A toy objective's settings: advantage-weighted flow matching toward the selected samples (no fixed
    predictions: it needs no policy but the trained one)."""

    full_steps: int
    train_batch_size: int
    grad_clip: float

    fixed = ()

    @classmethod
    def from_config(cls, cfg: Any) -> ToySettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


CALLS: list[int] = []


def toy_update(model, adapters, opt, batch, c, dist, autocast, predict=None, compiled=None) -> dict[str, float]:  # noqa: ANN001
    """One optimizer step: mean over rows of advantage x || v - (noise - x0) ||^2 at one drawn flow time."""
    from solrl_engine.rl.adapters import TRAIN

    CALLS.append(len(batch.x0))
    t = batch.sigmas[torch.randint(len(batch.sigmas), (len(batch.x0),), generator=batch.gen)].to(batch.x0.device)
    noise = torch.randn(batch.x0.shape, generator=batch.gen).to(batch.x0)
    tb = t.view(-1, *([1] * (batch.x0.dim() - 1)))
    with autocast():
        v = model.velocity((1 - tb) * batch.x0 + tb * noise, t, batch.cond).float()
    loss = (batch.adv.to(v.device) * (v - (noise - batch.x0).float()).square().flatten(1).mean(1)).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(adapters.params(TRAIN), c.grad_clip)
    opt.step()
    return {"loss": float(loss), "policy_loss": float(loss), "kl": 0.0, "grad_norm": float(gn), "old_decay": 0.0}


TOY = Objective("toy", ToySettings, toy_update)


def test_another_objective_plugs_in_through_the_registry_alone(small_model, tmp_path, monkeypatch):
    from solrl_engine.rl.trainer import Trainer

    monkeypatch.setitem(OBJECTIVES, "toy", ObjectiveSpec("toy", "a test's objective", "test_objectives:TOY"))
    CALLS.clear()
    cfg = RLConfig(name="toy", model="tiny", model_path=small_model, objective="toy", n=6, k=4, prompts_per_iter=2,
                   preview_steps=2, full_steps=3, iterations=2, eval_every=10, eval_prompt_count=2, eval_seeds=1,
                   save_every=10, lora_rank=4, lora_alpha=8, lr=5e-2, rollout_batch_size=8, train_batch_size=4,
                   explore_precision="nvfp4", device="cpu", output=str(tmp_path / "run"))  # fmt: skip
    tr = Trainer(cfg, progress=False)
    assert tr.objective is TOY and isinstance(tr.update_settings, ToySettings)
    before = [p.detach().clone() for p in tr.adapters.params("default")]
    tr.run()
    assert CALLS == [8, 8]  # K x prompts selected samples, one update per iteration
    assert any(not torch.equal(a, p) for a, p in zip(before, tr.adapters.params("default"), strict=True))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "loss" in r]) == 2
    assert json.loads((tmp_path / "run" / "config.json").read_text())["objective"] == "toy"
