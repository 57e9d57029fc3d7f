"""DiffusionNFT (Zheng et al. 2025) as an objective: its loss, its settings and its update, as Sol-RL trains with it.

The loss: the current policy v_theta and the frozen sampling policy v_old define an implicit positive policy
v+ = b v_theta + (1 - b) v_old and negative policy v- = (1 + b) v_old - b v_theta. Both predict the
clean sample x0 from the re-noised x_t; each squared error is divided by its own detached mean
absolute error (per sample); the reward, as r = clamp(A / (2 c) + 1/2, 0, 1) with c the advantage
clip, weights the two: loss = c * mean((r L+ + (1 - r) L-) / b) + kl_beta * mean((v_theta - v_ref)^2).

The update: `nft_update` re-noises each selected sample at a random share of the rollout's flow times,
compares the trained adapter's velocity with the "old" sampling adapter's (and the reference's for
the KL term), accumulates gradients and steps the optimizer, then moves the EMA and "old" adapters. The "old" and
reference velocities come from the fixed-predictions pre-pass (rl/update.py; `NFTSettings.fixed` names them), so
the gradient micro-batches run the trained policy alone. No host sync in the gradient loop: the loss parts and the
non-finite checks stay on the device and are read once per optimizer step, so a GPU never waits for the host
between micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from solrl_engine.hw import training_attention
from solrl_engine.models.base import FlowModel
from solrl_engine.rl.adapters import OLD
from solrl_engine.rl.distributed import Dist
from solrl_engine.rl.full import REF, TrainedWeights
from solrl_engine.rl.objectives import Objective
from solrl_engine.rl.update import Check, Predict, UpdateBatch, eager_predictions, optimizer_groups
from solrl_engine.sampling import seeded_noise


@dataclass(frozen=True)
class NFTSettings:
    """What the update reads of a run's config: the step budget and timestep share, the update's batching,
    the loss (beta, KL weight, advantage clip), the gradient clip and how the EMA and "old" adapters move."""

    full_steps: int
    timestep_fraction: float
    updates_per_iter: int
    train_batch_size: int
    beta: float
    kl_beta: float
    adv_clip: float
    grad_clip: float
    ema_decay_max: float
    old_decay_rate: float
    old_decay_max: float

    @property
    def fixed(self) -> tuple[str, ...]:
        """The predictions the loss needs from policies fixed during the update: the "old" policy's velocity, and
        the reference's while the KL term weighs anything."""
        return (OLD, REF) if self.kl_beta > 0 else (OLD,)

    @classmethod
    def from_config(cls, cfg: Any) -> NFTSettings:
        """The config's values of these fields (its defaults are the only ones: none are repeated here)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})



def _per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.dim())))


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor | None,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    beta: float = 1.0,
    kl_beta: float = 1e-4,
    adv_clip: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (scalar, differentiable through v_theta) and its parts (detached 0-dim tensors on the loss's device:
    reading them is the caller's host sync, once per optimizer step in the update). t is [B] flow time in (0, 1]."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    v_old = v_old.detach()
    r = ((advantages.clamp(-adv_clip, adv_clip) / adv_clip) / 2 + 0.5).clamp(0, 1)

    def branch(v: torch.Tensor) -> torch.Tensor:
        x0_pred = xt - tb * v
        with torch.no_grad():
            w = _per_sample((x0_pred.double() - x0.double()).abs()).clamp(min=1e-5)
        return _per_sample((x0_pred - x0) ** 2) / w.to(x0.dtype)

    pos = branch(beta * v_theta + (1 - beta) * v_old)
    neg = branch((1 + beta) * v_old - beta * v_theta)
    policy = (adv_clip * (r * pos / beta + (1 - r) * neg / beta)).mean()
    kl = _per_sample((v_theta - v_ref.detach()) ** 2).mean() if v_ref is not None else torch.zeros((), device=x0.device)
    loss = policy + kl_beta * kl
    return loss, {"policy_loss": policy.detach(), "kl": kl.detach(), "loss": loss.detach()}


def nft_update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
               c: NFTSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager],
               predict: Predict | None = None, compiled: Callable[[], contextlib.AbstractContextManager] | None = None
               ) -> dict[str, float]:  # fmt: skip
    """`updates_per_iter` optimizer steps over the selected samples x the chosen rollout timesteps
    (the official DiffusionNFT's gradient steps per epoch): the global batch is split at random
    into that many groups, each one step with gradients accumulated over its samples.

    The timesteps, the re-noising and the groups are drawn for the whole global batch (rows
    row0 .. row0 + len(x0) are this rank's), and each sample's loss is weighed by 1 / (its group's
    global size x timesteps), so the summed gradients equal a one-process run's. `sigmas` are the
    rollout's flow times at the full step budget, `iteration` the number of iterations done
    before this one, `sel` (a Selection) names prompts and seeds in non-finite errors. `predict` makes the fixed
    predictions (default: `eager_predictions` at the training micro-batch); `compiled` switches the policy's
    compiled blocks in for the gradient micro-batches, forward and backward (sampling.compile.CompiledBlocks.active;
    None: eager). Attention runs on the kernels hw.training_attention allows (not cuDNN's, which failed FLUX.1's
    update on an H200)."""
    predict = predict or eager_predictions(model, adapters, autocast, c.train_batch_size)
    with training_attention():
        return _nft_update(model, adapters, opt, batch, c, dist, autocast, predict,
                           compiled or contextlib.nullcontext)  # fmt: skip


def _nft_update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
                c: NFTSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager],
                predict: Predict, compiled: Callable[[], contextlib.AbstractContextManager]
                ) -> dict[str, float]:  # fmt: skip
    x0, cond, adv, gen = batch.x0, batch.cond, batch.adv, batch.gen
    b_global, row0, iteration = batch.b_global, batch.row0, batch.iteration
    sig, device = batch.sigmas, x0.device  # the rollout times, t in (0, 1]
    n_t = max(1, int(c.full_steps * c.timestep_fraction))
    b = x0.shape[0]
    rows = slice(row0, row0 + b)
    perms = torch.stack([torch.randperm(c.full_steps, generator=gen)[:n_t] for _ in range(b_global)])[rows]
    noise_seeds = torch.randint(0, 2**62, (b_global, n_t), generator=gen)[rows]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, policy loss, KL: read once, at the end
    tbs = c.train_batch_size
    n_groups = max(1, c.updates_per_iter)

    def slot(rows: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Timestep slot `j` of this rank's `rows`: their re-noised x_t, flow times t, and the fixed predictions
        at them, in batches as large as the predictor takes."""
        rd = rows.to(device)
        xb = x0[rd]
        t = sig[perms[rows, j]].to(device)
        noise = seeded_noise(noise_seeds[rows, j].tolist(), tuple(xb.shape[1:]), device, xb.dtype)
        tb = t.view(-1, *([1] * (xb.dim() - 1))).to(xb.dtype)
        xt = (1 - tb) * xb + tb * noise
        return xt, t, {name: predict(name, xt, t, cond[rd]) for name in c.fixed}

    def accumulate(rows: torch.Tensor, real: int, group: int) -> list[Check]:
        nonlocal totals
        weight = 1.0 / (group * n_t)
        checks: list[Check] = []
        for j in range(n_t):
            xt, t, fixed = slot(rows, j)  # (its no-grad predictions switch compiled forms of their own in and out)
            with compiled():  # the backward too: a recomputed (checkpointed) block runs its forward again
                for s in range(0, len(rows), tbs):
                    n = min(tbs, real - s)  # this micro-batch's rows that count
                    ixd = rows[s : s + tbs].to(device)
                    with autocast():
                        v = model.velocity(xt[s : s + tbs], t[s : s + tbs], cond[ixd]).float()
                    if n <= 0:  # padding only: the backward's collectives, adding exact zeros to the gradients
                        (v.sum() * 0.0).backward()
                        continue
                    sl, ix = slice(s, s + n), rows[s : s + n]
                    ref = fixed[REF][sl].float() if REF in fixed else None
                    loss, st = nft_loss(v[:n], fixed[OLD][sl].float(), ref, x0[ixd[:n]].float(), xt[sl].float(),
                                        t[sl], adv[ix.to(adv.device)], c.beta, c.kl_beta, c.adv_clip)  # fmt: skip
                    (loss * (n * weight)).backward()
                    parts = torch.stack([st["loss"], st["policy_loss"], st["kl"]]).double()
                    totals += parts * (n * weight / n_groups)
                    where = f"the velocities at t={sig[perms[ix, j]].tolist()}"  # (host values: no sync)
                    checks.append((where, ix, ~torch.isfinite(v[:n].detach()).flatten(1).all(dim=1),
                                   ~torch.isfinite(loss)))  # fmt: skip
        return checks

    gn, groups = optimizer_groups(adapters, opt, batch, dist, c.updates_per_iter, c.grad_clip, c.ema_decay_max,
                                  accumulate)  # fmt: skip
    totals = dist.sum_data_(totals).cpu()
    d = adapters.update_old((iteration + 1) * groups, c.old_decay_rate, c.old_decay_max)
    loss, policy, kl = totals.tolist()
    return {"loss": loss, "policy_loss": policy, "kl": kl, "grad_norm": gn, "old_decay": d}


OBJECTIVE = Objective("nft", NFTSettings, nft_update)
