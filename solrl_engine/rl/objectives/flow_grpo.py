"""Flow-GRPO (Liu et al. 2025) and Flow-GRPO-Fast as objectives: a clipped policy gradient on the SDE rollouts' per-step
log-probabilities (sampling/sde.py), with group-normalised advantages and a KL to the reference.

The loss of one SDE step j of a rollout, as the official flow_grpo writes it: with advantages A clamped to
[-adv_clip, adv_clip] and the ratio r = exp(log p_theta(x_{j+1} | x_j) - log p_old(x_{j+1} | x_j)),

    policy = mean(max(-A r, -A clamp(r, 1 - clip_range, 1 + clip_range)))
    kl     = mean(mean_dims((mean_theta - mean_ref)^2) / (2 std_j^2))        (std_j: the SDE's std_dev_t)
    loss   = policy + kl_beta kl

Flow-GRPO trains every SDE step of its rollouts (every step but the last); Flow-GRPO-Fast samples the SDE on a window
of `sde_window` steps (the rest Euler) and trains on those alone, far fewer forwards and backwards per sample.

The rollouts are sampled by the "old" policy, which this objective keeps equal to the trained one after every
update (the old adapter or weights copied, decay 0), so the ratio is 1 at each iteration's first optimizer step, as
in flow_grpo's on-policy sampling. The old log-probabilities and the reference means are fixed predictions
(rl/update.py's pre-pass, at the rollouts' batch through their compiled path); the gradient micro-batches run the
trained policy alone (with classifier-free guidance: its conditioned and unconditioned velocities, both with
gradients, as flow_grpo trains with cfg).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from solrl_engine.hw import training_attention
from solrl_engine.models.base import Conditioning, FlowModel
from solrl_engine.models.experts import guidance_at
from solrl_engine.rl.adapters import OLD
from solrl_engine.rl.distributed import Dist
from solrl_engine.rl.full import REF, TrainedWeights
from solrl_engine.rl.objectives import Objective
from solrl_engine.rl.update import Check, Predict, UpdateBatch, eager_predictions, optimizer_groups
from solrl_engine.sampling.sde import sde_log_prob, sde_std, sde_transition


@dataclass(frozen=True)
class FlowGRPOSettings:
    """What the update reads of a run's config: the step budget and the SDE's noise (the log-probabilities are the
    sampler's), the update's batching, the loss (ratio clip, advantage clip, KL weight), the gradient clip and the
    EMA's decay."""

    full_steps: int
    sde_noise_level: float
    updates_per_iter: int
    train_batch_size: int
    clip_range: float
    adv_clip: float
    kl_beta: float
    grad_clip: float
    ema_decay_max: float

    @property
    def fixed(self) -> tuple[str, ...]:
        """The old policy's velocities (its log-probabilities) and, while the KL weighs anything, the reference's."""
        return (OLD, REF) if self.kl_beta > 0 else (OLD,)

    @classmethod
    def from_config(cls, cfg: Any) -> FlowGRPOSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


def flow_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                   adv_clip: float, mean: torch.Tensor | None = None, ref_mean: torch.Tensor | None = None,
                   std: torch.Tensor | None = None, kl_beta: float = 0.0
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Loss of one step's rows (scalar, differentiable through log_prob and mean) and its parts (detached 0-dim
    tensors): log-probabilities [B], advantages [B]; `mean`, `ref_mean` the step's means and `std` [B, 1, ...] its
    std_dev_t, for the KL term (kl_beta > 0)."""
    adv = advantages.clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped, clipped).mean()
    if kl_beta > 0 and ref_mean is not None:
        dims = tuple(range(1, mean.dim()))
        kl = (((mean - ref_mean.detach()) ** 2).mean(dim=dims, keepdim=True) / (2 * std**2)).mean()
    else:
        kl = torch.zeros((), device=log_prob.device)
    loss = policy + kl_beta * kl
    parts = {"loss": loss.detach(), "policy_loss": policy.detach(), "kl": kl.detach(),
             "approx_kl": 0.5 * ((log_prob - old_log_prob) ** 2).mean().detach(),
             "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean().detach()}  # fmt: skip
    return loss, parts


def _guided(velocity: Callable[[Conditioning], torch.Tensor], cond: Conditioning, uncond: Conditioning | None,
            guidance: float, t: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The velocity as the rollouts sampled it: with classifier-free guidance against `uncond` when scale != 1 (a
    two-expert model's: each row's expert's scale at its flow time `t`)."""
    v = velocity(cond).float()
    if uncond is None or guidance == 1.0:
        return v
    vu = velocity(uncond.against(cond)).float()
    return vu + guidance_at(guidance, t, like=v) * (v - vu)


def flow_grpo_update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
                     c: FlowGRPOSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager],
                     predict: Predict | None = None,
                     compiled: Callable[[], contextlib.AbstractContextManager] | None = None
                     ) -> dict[str, float]:  # fmt: skip
    """`updates_per_iter` optimizer steps over the selected rollouts x their window's SDE steps: the global batch
    split at random into that many groups, each one step with gradients accumulated over its rows and steps, each
    (row, step) weighed 1 / (its group's global size x steps), so the summed gradients equal a one-process run's.
    Then the EMA moves and the old policy becomes the trained one. Same arguments as the nft update."""
    if batch.trace is None or batch.window is None:
        raise ValueError("flow_grpo's update needs the rollouts' SDE states (UpdateBatch.trace and .window)")
    predict = predict or eager_predictions(model, adapters, autocast, c.train_batch_size)
    with training_attention():
        return _update(model, adapters, opt, batch, c, dist, autocast, predict, compiled or contextlib.nullcontext)


def _update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
            c: FlowGRPOSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager],
            predict: Predict, compiled: Callable[[], contextlib.AbstractContextManager]
            ) -> dict[str, float]:  # fmt: skip
    trace, cond, adv = batch.trace, batch.cond, batch.adv
    (k0, k1) = batch.window
    device, dtype = batch.x0.device, batch.x0.dtype  # the model's inputs in the rollouts' dtype, as they sampled
    sig = torch.cat([batch.sigmas.float().cpu(), torch.zeros(1)])  # the full schedule, t = 1 .. 0
    sigma_max = float(sig[1])
    steps = k1 - k0
    totals = torch.zeros(5, dtype=torch.float64, device=device)  # loss, policy, KL, approx KL, clip fraction
    tbs = c.train_batch_size
    n_groups = max(1, c.updates_per_iter)

    def step_rows(rows: torch.Tensor, j: int) -> tuple[torch.Tensor, ...]:
        """Step j of the window at this rank's `rows`: x_j, x_{j+1}, their flow times, the step's std_dev_t, and the
        fixed predictions' old log-probabilities and reference means."""
        rd = rows.to(device)
        x, x_next = trace[rd, j].float(), trace[rd, j + 1].float()
        t, t_next = sig[k0 + j].expand(len(rows)).clone(), sig[k0 + j + 1].expand(len(rows)).clone()
        fixed = {}
        for name in c.fixed:
            v = _guided(lambda cc, name=name: predict(name, x.to(dtype), t.to(device), cc), cond[rd], batch.uncond,
                        batch.guidance, t)  # fmt: skip
            fixed[name] = sde_transition(x, v, t, t_next, sigma_max, c.sde_noise_level)
        mean_old, scale = fixed[OLD]
        old_lp = sde_log_prob(x_next, mean_old, scale)
        ref_mean = fixed[REF][0] if REF in fixed else None
        std = sde_std(t.to(device).view(-1, *([1] * (x.dim() - 1))), sigma_max, c.sde_noise_level)
        return x, x_next, t, t_next, std, old_lp, ref_mean

    def accumulate(rows: torch.Tensor, real: int, group: int) -> list[Check]:
        nonlocal totals
        weight = 1.0 / (group * steps)
        checks: list[Check] = []
        for j in range(steps):
            x, x_next, t, t_next, std, old_lp, ref_mean = step_rows(rows, j)
            with compiled():
                for s in range(0, len(rows), tbs):
                    n = min(tbs, real - s)
                    ixd = rows[s : s + tbs].to(device)
                    xs, ts = x[s : s + tbs].to(dtype), t[s : s + tbs].to(device)
                    with autocast():
                        v = _guided(lambda cc, xs=xs, ts=ts: model.velocity(xs, ts, cc), cond[ixd], batch.uncond,
                                    batch.guidance, ts)  # fmt: skip
                    if n <= 0:  # padding only: the backward's collectives, adding exact zeros
                        (v.sum() * 0.0).backward()
                        continue
                    mean, scale = sde_transition(x[s : s + n], v[:n], t[s : s + n], t_next[s : s + n], sigma_max,
                                                 c.sde_noise_level)  # fmt: skip
                    lp = sde_log_prob(x_next[s : s + n], mean, scale)
                    ix = rows[s : s + n]
                    loss, st = flow_grpo_loss(lp, old_lp[s : s + n], adv[ix.to(adv.device)].to(lp.device),
                                              c.clip_range, c.adv_clip, mean, None if ref_mean is None else
                                              ref_mean[s : s + n], std[s : s + n], c.kl_beta)  # fmt: skip
                    (loss * (n * weight)).backward()
                    parts = torch.stack([st[k] for k in ("loss", "policy_loss", "kl", "approx_kl", "clipfrac")])
                    totals += parts.double() * (n * weight / n_groups)
                    where = f"the velocities at SDE step {k0 + j} (t={float(sig[k0 + j]):.4f})"
                    checks.append((where, ix, ~torch.isfinite(v[:n].detach()).flatten(1).all(dim=1),
                                   ~torch.isfinite(loss)))  # fmt: skip
        return checks

    gn, _ = optimizer_groups(adapters, opt, batch, dist, c.updates_per_iter, c.grad_clip, c.ema_decay_max,
                             accumulate)  # fmt: skip
    totals = dist.sum_data_(totals).cpu()
    adapters.update_old(0, 0.0, 0.0)  # on-policy: the next rollouts sample the policy as trained now
    loss, policy, kl, approx_kl, clipfrac = totals.tolist()
    return {"loss": loss, "policy_loss": policy, "kl": kl, "approx_kl": approx_kl, "clipfrac": clipfrac,
            "grad_norm": gn, "sde_window_start": float(k0)}  # fmt: skip


FLOW_GRPO = Objective("flow_grpo", FlowGRPOSettings, flow_grpo_update)
FLOW_GRPO_FAST = Objective("flow_grpo_fast", FlowGRPOSettings, flow_grpo_update)
