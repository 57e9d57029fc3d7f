"""AWM (rl/objectives/awm.py): the loss is the advantage-weighted flow-matching error plus the KL to the reference,
and the objective runs through the registry in the trainer (every part of the engine but its module and its registry
line unchanged), trains, and resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch

from solrl_engine.rl.config import RLConfig
from solrl_engine.rl.objectives import objective
from solrl_engine.rl.objectives.awm import AWMSettings, awm_loss


@pytest.mark.parametrize("shape", [(6, 4, 8, 8), (5, 16, 6)])
def test_the_loss_is_advantage_weighted_matching_plus_the_kl(shape):
    g = torch.Generator().manual_seed(3)
    v, noise, x0, ref = (torch.randn(shape, generator=g) for _ in range(4))
    x0[0] *= 1e3  # magnitudes over decades: the matching error stays per sample
    adv = torch.randn(shape[0], generator=g) * 4
    adv[1] = -8.0  # clamped to -5
    vv = v.clone().requires_grad_(True)
    loss, parts = awm_loss(vv, noise, x0, adv, 5.0, ref, 0.1)
    per = torch.stack([((v[i] - (noise[i] - x0[i])) ** 2).mean() for i in range(shape[0])])
    kl = torch.stack([((v[i] - ref[i]) ** 2).mean() for i in range(shape[0])]).mean()
    torch.testing.assert_close(parts["policy_loss"], (adv.clamp(-5, 5) * per).mean())
    torch.testing.assert_close(loss, (adv.clamp(-5, 5) * per).mean() + 0.1 * kl)
    loss.backward()  # a better-than-its-group sample is pulled toward its target, a worse one pushed away
    n = v[0].numel() * shape[0]
    want = 2 * (adv.clamp(-5, 5).view(-1, *[1] * (len(shape) - 1)) * (v - (noise - x0)) + 0.1 * (v - ref)) / n
    torch.testing.assert_close(vv.grad, want)


def test_awm_trains_through_the_registry_and_resumes_exactly(small_model, tmp_path):
    from solrl_engine.rl.trainer import Trainer

    def cfg(out: str, iterations: int) -> RLConfig:
        return RLConfig(name="awm", model="tiny", model_path=small_model, objective="awm", n=6, k=4, prompts_per_iter=2,
                        preview_steps=2, full_steps=4, iterations=iterations, eval_every=1, eval_prompt_count=2,
                        eval_seeds=1, save_every=1, lora_rank=4, lora_alpha=8, lr=1e-2, rollout_batch_size=8,
                        train_batch_size=4, updates_per_iter=2, timestep_fraction=0.5, kl_beta=0.1,
                        explore_precision="nvfp4", device="cpu", output=str(tmp_path / out))  # fmt: skip

    whole = Trainer(cfg("whole", 2), progress=False)
    assert whole.objective is objective("awm") and isinstance(whole.update_settings, AWMSettings)
    before = [p.detach().clone() for p in whole.adapters.params("default")]
    whole.run()
    assert any(not torch.equal(a, p) for a, p in zip(before, whole.adapters.params("default"), strict=True))
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["objective"] for r in rows] == ["awm", "awm"] and all(r["kl"] > 0 for r in rows)
    Trainer(cfg("split", 1), progress=False).run()
    split = Trainer(cfg("split", 2), progress=False)
    split.run(resume=True)
    rows2 = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, rows2, strict=True):
        for key in ("reward_mean", "loss", "policy_loss", "kl", "grad_norm", "selection_digest"):
            assert a[key] == b[key], key
    for a, b in zip(whole.adapters.params("default"), split.adapters.params("default"), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
