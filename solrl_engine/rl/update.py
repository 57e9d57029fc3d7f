"""What every objective's update shares (stage 4 of the trainer's step; the losses are rl/objectives/): the
selected samples it trains on (UpdateBatch) and the fixed predictions it needs.

Why in two passes: the "old" and reference policies do not change during the update, so what a loss needs of
them (its fixed predictions, its settings' `fixed`) is computed first, without gradients, at the rollouts' batch
and through their compiled path (`fixed_predictions`), and the gradient micro-batches run the trained policy
alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from solrl_engine.models.base import Conditioning, FlowModel
from solrl_engine.rl.adapters import OLD, TRAIN
from solrl_engine.rl.distributed import Dist, local
from solrl_engine.rl.full import TrainedWeights
from solrl_engine.rl.guards import nonfinite_rows, raise_collective
from solrl_engine.sampling.rollouts import Rollouts

# (which policy, x, t, cond) -> that policy's velocity at those rows, without gradients: how the update gets a
# fixed prediction (`which` is OLD or REF)
Predict = Callable[[str, torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]


@dataclass
class UpdateBatch:
    """One iteration's selected samples on this rank and what their update draws from: the samples `x0` and
    their conditioning, advantages, the rollout's flow times at the full step budget, the run's generator,
    the global batch size and this rank's first row in it, the iterations done before this one, (for
    non-finite errors) the Selection that names prompts and seeds, and for an SDE objective the rollouts' SDE states
    `trace` [b, W + 1, ...] on the steps `window` [k0, k1) and the guidance they were sampled with (`uncond`, one
    row, and its scale; None and 1.0 without classifier-free guidance)."""

    x0: torch.Tensor
    cond: Conditioning
    adv: torch.Tensor
    sigmas: torch.Tensor
    gen: torch.Generator
    b_global: int
    row0: int
    iteration: int
    sel: Any = None
    trace: torch.Tensor | None = None
    window: tuple[int, int] | None = None
    uncond: Conditioning | None = None
    guidance: float = 1.0


def fixed_predictions(rollouts: Rollouts, adapters: TrainedWeights, old_copy: torch.nn.Module | None = None
                      ) -> Predict:  # fmt: skip
    """The trainer's fixed predictions: the "old" policy as its rollouts sample it (the merged copy `old_copy` when
    there is one, else the policy with its old adapter or weights active) and the reference (LoRA: adapters off;
    full fine-tuning: the base weights swapped in), through the rollouts' compiled (GPU: graph-captured) path at
    their batch size (Rollouts.predict)."""

    def predict(which: str, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        if which == OLD and old_copy is not None:
            return rollouts.predict(x, t, cond, transformer=old_copy, tag="old-merged")
        with adapters.using(which):
            return rollouts.predict(x, t, cond, tag=which)

    return predict


def eager_predictions(model: FlowModel, adapters: TrainedWeights,
                      autocast: Callable[[], contextlib.AbstractContextManager], batch_size: int | None = None
                      ) -> Predict:  # fmt: skip
    """Fixed predictions of the policy itself, eagerly, its adapter switched (`batch_size` rows a forward; None:
    all at once): for callers without rollouts (a benchmark of the update alone) and as the tests' reference."""

    @torch.no_grad()
    def predict(which: str, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        bs = batch_size or len(x)
        with autocast(), adapters.using(which):
            return torch.cat([model.velocity(x[i : i + bs], t[i : i + bs], cond[i : i + bs])
                              for i in range(0, len(x), bs)])  # fmt: skip

    return predict


# one micro-batch's verdicts, read back once per optimizer step: (where it ran, e.g. "the velocities at t=0.5", its
# rows of this rank's batch, each row's non-finite flag, the loss's non-finite flag)
Check = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]


def optimizer_groups(adapters: TrainedWeights, opt: torch.optim.Optimizer, batch: UpdateBatch, dist: Dist,
                     updates_per_iter: int, grad_clip: float, ema_decay_max: float,
                     accumulate: Callable[[torch.Tensor, int, int], list[Check]]) -> tuple[float, int]:  # fmt: skip
    """The optimizer steps an objective's update takes, its loss left to `accumulate`: the global batch split at random
    (from the batch's generator) into `updates_per_iter` groups, each one step with gradients accumulated over its
    rows. `accumulate(rows, real, group_size)` runs the forwards and backwards of this rank's rows of a group (sharded:
    padded past `real` with row 0, so every rank makes as many collectives; padding must add exact zeros), weighing
    each row 1 / group_size (the group's global size) times its own share, and returns its Checks. Then: gradients
    summed over ranks, one host sync for every check and the gradients' finiteness (a NonFiniteError naming prompts
    and seeds, collectively), the clip, the step, the EMA. Returns (the last gradient norm, the number of groups)."""
    b_global, row0, b = batch.b_global, batch.row0, len(batch.x0)
    device = batch.x0.device
    groups = [torch.arange(b_global)]
    if updates_per_iter > 1:
        groups = list(torch.randperm(b_global, generator=batch.gen).tensor_split(updates_per_iter))
    gn: torch.Tensor | float = 0.0
    for g, members in enumerate(groups):
        mine = members[(members >= row0) & (members < row0 + b)] - row0  # this rank's rows of the group
        opt.zero_grad(set_to_none=True)
        rows, real = mine, len(mine)
        if dist.sharded:  # every rank makes as many forwards and backwards (collectives) as the busiest one
            rows = torch.cat([mine, torch.zeros(dist.most(real, device) - real, dtype=mine.dtype)])
        checks = accumulate(rows, real, len(members))
        params = adapters.params(TRAIN)
        dist.sum_grads_(params)
        grads = [local(p.grad) for p in params if p.grad is not None]
        grad_bad = (~torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).any() if grads
                    else torch.zeros((), dtype=torch.bool, device=device))  # fmt: skip
        flags = torch.cat([torch.cat([r, ls.view(1)]) for _, _, r, ls in checks] + [grad_bad.view(1)]).tolist()
        raise_collective(first_problem(checks, flags, batch.sel), dist, device)
        raise_collective(("the gradients", "after accumulation over the batch") if flags[-1] else None,
                         dist if dist.sharded else None, device)  # fmt: skip
        gn = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        adapters.update_ema(batch.iteration * len(groups) + g + 1, ema_decay_max)
    return float(gn), len(groups)


def first_problem(checks: list[Check], flags: list[bool], sel: Any) -> tuple[str, str] | None:
    """The first non-finite prediction or loss of a group's micro-batches, in the order they ran, as (stage, detail)
    naming prompts and seeds where `sel` (a Selection) says them; `flags`: each check's rows, then its loss."""
    at = 0
    for where, ix, rows, _ in checks:
        bad, loss_bad = flags[at : at + len(rows)], flags[at + len(rows)]
        at += len(rows) + 1
        if any(bad) and sel is not None:
            names = ([sel.flat_prompts[i] for i in ix.tolist()], [sel.flat_seeds[i] for i in ix.tolist()])
            return where, nonfinite_rows(bad, *names)
        if loss_bad:
            return "the loss", f"samples {ix.tolist()} of a rank's batch ({where})"
    return None
