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
from solrl_engine.rl.adapters import OLD
from solrl_engine.rl.full import TrainedWeights
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
