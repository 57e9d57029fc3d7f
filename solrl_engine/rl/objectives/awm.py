"""AWM, advantage-weighted matching (Xue et al. 2025), as an objective: the pretraining loss itself, flow matching
toward the rollouts' own samples, each sample's loss weighed by its advantage.

For a selected sample x0 re-noised at a rollout time t, x_t = (1 - t) x0 + t eps, the matching loss is
l = mean_dims((v_theta(x_t, t) - (eps - x0))^2); AWM minimizes mean(A l) with A the group-normalised advantage clamped
to [-adv_clip, adv_clip]: samples better than their group pulled closer, worse ones pushed away. What keeps it from
running off is the KL to the reference, kl_beta mean((v_theta - v_ref)^2), as DiffusionNFT weighs it (here the
weighting is AWM's uniform one; its t-weighted and Huber forms and its ratio clip are not built). Like DiffusionNFT
it trains on final samples of any solver, and its rollouts come from the "old" policy, moved as DiffusionNFT moves it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from solrl_engine.hw import training_attention
from solrl_engine.models.base import FlowModel
from solrl_engine.rl.distributed import Dist
from solrl_engine.rl.full import REF, TrainedWeights
from solrl_engine.rl.objectives import Objective
from solrl_engine.rl.update import Check, Predict, UpdateBatch, eager_predictions, optimizer_groups
from solrl_engine.sampling import seeded_noise


@dataclass(frozen=True)
class AWMSettings:
    """What the update reads of a run's config: the rollout times and their share, the batching, the advantage clip
    and KL weight, the gradient clip, and how the EMA and "old" policies move."""

    full_steps: int
    timestep_fraction: float
    updates_per_iter: int
    train_batch_size: int
    adv_clip: float
    kl_beta: float
    grad_clip: float
    ema_decay_max: float
    old_decay_rate: float
    old_decay_max: float

    @property
    def fixed(self) -> tuple[str, ...]:
        """The reference's velocities while the KL weighs anything; nothing else is fixed."""
        return (REF,) if self.kl_beta > 0 else ()

    @classmethod
    def from_config(cls, cfg: Any) -> AWMSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


def awm_loss(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, advantages: torch.Tensor, adv_clip: float,
             v_ref: torch.Tensor | None = None, kl_beta: float = 0.0
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Loss of rows (scalar, differentiable through v) and its parts (detached 0-dim tensors)."""
    dims = tuple(range(1, v.dim()))
    matching = ((v - (noise - x0)) ** 2).mean(dim=dims)
    policy = (advantages.clamp(-adv_clip, adv_clip) * matching).mean()
    kl = ((v - v_ref.detach()) ** 2).mean(dim=dims).mean() if v_ref is not None else torch.zeros((), device=v.device)
    loss = policy + kl_beta * kl
    return loss, {"loss": loss.detach(), "policy_loss": policy.detach(), "kl": kl.detach()}


def awm_update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
               c: AWMSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager],
               predict: Predict | None = None, compiled: Callable[[], contextlib.AbstractContextManager] | None = None
               ) -> dict[str, float]:  # fmt: skip
    """`updates_per_iter` optimizer steps (rl.update.optimizer_groups) over the selected samples x a drawn share of the
    rollout times, each (sample, time) weighed 1 / (its group's global size x times); then the old policy moves."""
    predict = predict or eager_predictions(model, adapters, autocast, c.train_batch_size)
    compiled = compiled or contextlib.nullcontext
    x0, cond, adv, sig, device = batch.x0, batch.cond, batch.adv, batch.sigmas, batch.x0.device
    n_t = max(1, int(c.full_steps * c.timestep_fraction))
    rows_all = slice(batch.row0, batch.row0 + len(x0))
    times = torch.stack([torch.randperm(c.full_steps, generator=batch.gen)[:n_t] for _ in range(batch.b_global)])
    seeds = torch.randint(0, 2**62, (batch.b_global, n_t), generator=batch.gen)[rows_all]
    times = times[rows_all]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    n_groups = max(1, c.updates_per_iter)

    def accumulate(rows: torch.Tensor, real: int, group: int) -> list[Check]:
        nonlocal totals
        weight, checks = 1.0 / (group * n_t), []
        for j in range(n_t):
            rd = rows.to(device)
            t = sig[times[rows, j]].to(device)
            noise = seeded_noise(seeds[rows, j].tolist(), tuple(x0.shape[1:]), device, x0.dtype)
            tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
            xt = (1 - tb) * x0[rd] + tb * noise
            ref = predict(REF, xt, t, cond[rd]) if REF in c.fixed else None
            with compiled():
                for s in range(0, len(rows), c.train_batch_size):
                    n, sl = min(c.train_batch_size, real - s), slice(s, s + c.train_batch_size)
                    with autocast():
                        v = model.velocity(xt[sl], t[sl], cond[rd[sl]]).float()
                    if n <= 0:  # padding only: the backward's collectives, adding exact zeros
                        (v.sum() * 0.0).backward()
                        continue
                    ix = rows[s : s + n]
                    loss, st = awm_loss(v[:n], noise[s : s + n].float(), x0[rd[s : s + n]].float(),
                                        adv[ix.to(adv.device)].to(device), c.adv_clip,
                                        None if ref is None else ref[s : s + n].float(), c.kl_beta)  # fmt: skip
                    (loss * (n * weight)).backward()
                    totals += torch.stack([st["loss"], st["policy_loss"], st["kl"]]).double() * (n * weight / n_groups)
                    checks.append((f"the velocities at t={sig[times[ix, j]].tolist()}", ix,  # host values: no sync
                                   ~torch.isfinite(v[:n].detach()).flatten(1).all(dim=1), ~torch.isfinite(loss)))
        return checks

    with training_attention():
        gn, groups = optimizer_groups(adapters, opt, batch, dist, c.updates_per_iter, c.grad_clip, c.ema_decay_max,
                                      accumulate)  # fmt: skip
    totals = dist.sum_data_(totals).cpu()
    d = adapters.update_old((batch.iteration + 1) * groups, c.old_decay_rate, c.old_decay_max)
    loss, policy, kl = totals.tolist()
    return {"loss": loss, "policy_loss": policy, "kl": kl, "grad_norm": gn, "old_decay": d}


OBJECTIVE = Objective("awm", AWMSettings, awm_update)
