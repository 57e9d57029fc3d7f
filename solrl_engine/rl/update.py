"""The policy update of one iteration: DiffusionNFT's loss over the selected samples.

Stage 4 of the trainer's step (solrl_engine/rl/trainer.py), kept apart so the trainer reads as the
method: `nft_update` re-noises each selected sample at a random share of the rollout's flow times,
compares the trained adapter's velocity with the "old" sampling adapter's (and the reference's for
the KL term), accumulates gradients and steps the optimizer, then moves the EMA and "old" adapters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from solrl_engine.hw import training_attention
from solrl_engine.models.base import Conditioning, FlowModel
from solrl_engine.rl.adapters import OLD, TRAIN
from solrl_engine.rl.config import RLConfig
from solrl_engine.rl.distributed import Dist, local
from solrl_engine.rl.full import TrainedWeights
from solrl_engine.rl.guards import nonfinite_detail, raise_collective
from solrl_engine.rl.loss import nft_loss
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

    @classmethod
    def from_config(cls, cfg: RLConfig) -> NFTSettings:
        """The config's values of these fields (its defaults are the only ones: none are repeated here)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass
class UpdateBatch:
    """One iteration's selected samples on this rank and what their update draws from: the samples `x0` and
    their conditioning, advantages, the rollout's flow times at the full step budget, the run's generator,
    the global batch size and this rank's first row in it, the iterations done before this one, and (for
    non-finite errors) the Selection that names prompts and seeds."""

    x0: torch.Tensor
    cond: Conditioning
    adv: torch.Tensor
    sigmas: torch.Tensor
    gen: torch.Generator
    b_global: int
    row0: int
    iteration: int
    sel: Any = None


def nft_update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
               c: NFTSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager]
               ) -> dict[str, float]:  # fmt: skip
    """`updates_per_iter` optimizer steps over the selected samples x the chosen rollout timesteps
    (the official DiffusionNFT's gradient steps per epoch): the global batch is split at random
    into that many groups, each one step with gradients accumulated over its samples.

    The timesteps, the re-noising and the groups are drawn for the whole global batch (rows
    row0 .. row0 + len(x0) are this rank's), and each sample's loss is weighed by 1 / (its group's
    global size x timesteps), so the summed gradients equal a one-process run's. `sigmas` are the
    rollout's flow times at the full step budget, `iteration` the number of iterations done
    before this one, `sel` (a Selection) names prompts and seeds in non-finite errors. Attention runs
    on the kernels hw.training_attention allows (not cuDNN's, which failed FLUX.1's update on an H200)."""
    with training_attention():
        return _nft_update(model, adapters, opt, batch, c, dist, autocast)


def _nft_update(model: FlowModel, adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch,
                c: NFTSettings, dist: Dist, autocast: Callable[[], contextlib.AbstractContextManager]
                ) -> dict[str, float]:  # fmt: skip
    x0, cond, adv, gen, sel = batch.x0, batch.cond, batch.adv, batch.gen, batch.sel
    b_global, row0, iteration = batch.b_global, batch.row0, batch.iteration
    sig, device = batch.sigmas, x0.device  # the rollout times, t in (0, 1]
    n_t = max(1, int(c.full_steps * c.timestep_fraction))
    b = x0.shape[0]
    rows = slice(row0, row0 + b)
    perms = torch.stack([torch.randperm(c.full_steps, generator=gen)[:n_t] for _ in range(b_global)])[rows]
    noise_seeds = torch.randint(0, 2**62, (b_global, n_t), generator=gen)[rows]
    groups = [torch.arange(b_global)]
    if c.updates_per_iter > 1:
        groups = list(torch.randperm(b_global, generator=gen).tensor_split(c.updates_per_iter))
    totals = torch.zeros(3, dtype=torch.float64)
    gn = 0.0

    def micro(ix: torch.Tensor, j: int) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, torch.Tensor]:
        """One micro-batch (rows `ix` of this rank, timestep slot `j`): (loss, its parts, velocity, t)."""
        xb, cb, ab = x0[ix.to(x0.device)], cond[ix.to(x0.device)], adv[ix.to(adv.device)]
        t = sig[perms[ix, j]].to(device)
        noise = seeded_noise(noise_seeds[ix, j].tolist(), tuple(xb.shape[1:]), device, xb.dtype)
        tb = t.view(-1, *([1] * (xb.dim() - 1))).to(xb.dtype)
        xt = (1 - tb) * xb + tb * noise
        with torch.no_grad(), autocast():
            with adapters.using(OLD):
                v_old = model.velocity(xt, t, cb).float()
            with adapters.using("ref"):
                v_ref = model.velocity(xt, t, cb).float() if c.kl_beta > 0 else None
        with autocast():
            v = model.velocity(xt, t, cb).float()
        loss, st = nft_loss(v, v_old, v_ref, xb.float(), xt.float(), t, ab, c.beta, c.kl_beta, c.adv_clip)
        return loss, st, v, t

    for g, members in enumerate(groups):
        mine = members[(members >= row0) & (members < row0 + b)] - row0  # this rank's rows of the group
        weight = 1.0 / (len(members) * n_t)
        opt.zero_grad(set_to_none=True)
        problem = None  # the first non-finite velocity or loss on this rank: (stage, detail)
        runs = n_t * -(-len(mine) // c.train_batch_size)  # this rank's micro-batches in the group
        # a sharded policy's forwards and backwards are collectives: agreed before the first, every rank runs the
        # busiest rank's count, padded with micro-batches that weigh nothing
        pad = dist.most(runs, device) - runs if dist.sharded else 0
        for j in range(n_t):
            for s in range(0, len(mine), c.train_batch_size):
                ix = mine[s : s + c.train_batch_size]
                loss, st, v, t = micro(ix, j)
                if problem is None and sel is not None:
                    names = ([sel.flat_prompts[i] for i in ix], [sel.flat_seeds[i] for i in ix])
                    bad = nonfinite_detail(v, *names)
                    problem = None if bad is None else (f"the velocities at t={t.tolist()}", bad)
                if problem is None and not torch.isfinite(loss):
                    problem = ("the loss", f"samples {ix.tolist()} of a rank's batch")
                if problem is not None:
                    if dist.sharded:  # the backward gathers weights too: every rank runs as many
                        (loss * 0.0).backward()
                    continue  # the iteration's update is skipped (or the run stops) below
                (loss * (len(ix) * weight)).backward()
                parts = torch.tensor([st["loss"], st["policy_loss"], st["kl"]], dtype=torch.float64)
                totals += parts * (len(ix) * weight / len(groups))
        for _ in range(pad):
            loss = micro(torch.zeros(1, dtype=torch.long), 0)[0]
            (loss * 0.0).backward()  # adds exact zeros to the gradients (a non-finite one skips the step)
            if problem is None and not torch.isfinite(loss):
                problem = ("the loss", "a padding micro-batch (row 0 of a rank's batch)")
        raise_collective(problem, dist, device)  # once per group: ranks' loops differ in length
        params = adapters.params(TRAIN)
        dist.sum_grads_(params)
        finite = all(bool(torch.isfinite(local(p.grad)).all()) for p in params if p.grad is not None)
        # sharded: each rank checks its own shards of the gradients, and all agree (one collective)
        raise_collective(None if finite else ("the gradients", "after accumulation over the batch"),
                         dist if dist.sharded else None, device)  # fmt: skip
        gn = float(torch.nn.utils.clip_grad_norm_(params, c.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the optimizer-step count after this step (= iterations when updates_per_iter is 1)
        adapters.update_ema(iteration * len(groups) + g + 1, c.ema_decay_max)
    totals = dist.sum_(totals.to(device)).cpu()
    d = adapters.update_old((iteration + 1) * len(groups), c.old_decay_rate, c.old_decay_max)
    loss, policy, kl = totals.tolist()
    return {"loss": loss, "policy_loss": policy, "kl": kl, "grad_norm": gn, "old_decay": d}
