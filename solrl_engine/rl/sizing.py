"""The update's sizes from the device: `train_batch_size=auto` and `gradient_checkpointing=auto`, resolved once at
start from the memory plan (rl/memplan.py), and the recompute of as many repeated blocks as that needs.

Why: a micro-batch fixed for an 80 GB GPU, with every block recomputed, ran SANA-1.6B's update at an 11 GiB peak
on a 141 GiB H200; the micro-batch sets how well the GPU is used, and recomputing every block costs a forward's
worth of the backward. The update needs neither where the memory allows: auto takes the largest micro-batch (up to
a rank's rows of one timestep slot, all that one forward can take) that fits HEADROOM of the device without
recompute; where not even one sample fits, one sample with the first blocks recomputed, as few as fit. An explicit
value always wins (and auto sizes the other one around it). Micro-batch and recompute change memory and speed,
not the update's result: gradients accumulate over micro-batches, and a recomputed block computes what it did.

The plan measures one sample's update activations with and without recompute on fake tensors; a micro-batch of b
with k of n blocks recomputed is priced as b x (plain - k/n x (plain - recomputed)), a little above the measured
value (a batch shares its constant part), so the choice errs towards fitting. On a CPU (no device memory to size
against) auto is train_batch_size 16 and no recompute, as where no plan can be made (with a warning).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from solrl_engine.rl.config import ConfigError, RLConfig

log = logging.getLogger("solrl_engine.rl")
HEADROOM = 0.9  # of a GPU's memory a plan may fill: the CUDA context, allocator fragmentation and kernels' workspaces
DEFAULT_TRAIN_BATCH = 16  # auto where nothing sizes it: a CPU, or a plan that cannot be made
AUTO = "auto"


class NothingFits(ConfigError):
    """No micro-batch and recompute fit the update; `short` says so in a line (what `solrl plan` shows)."""

    def __init__(self, short: str, message: str) -> None:
        super().__init__(message)
        self.short = short

    def smallest(self) -> UpdateSizes:
        """The smallest update (one sample, every block recomputed): what a plan shows where nothing fits."""
        return UpdateSizes(1, True, f"nothing fits ({self.short}): shown at one sample with every block recomputed")


@dataclass(frozen=True)
class UpdateSizes:
    """A run's resolved update sizes: the micro-batch, the repeated blocks recomputed in the backward (true: all;
    false: none; N: the first N), and why."""

    train_batch_size: int
    recompute: int | bool
    reason: str

    def apply(self, cfg: RLConfig) -> RLConfig:
        """`cfg` with these sizes as its values (what config.json and checkpoints record)."""
        return dataclasses.replace(cfg, train_batch_size=self.train_batch_size, gradient_checkpointing=self.recompute)


def rows_per_slot(cfg: RLConfig, world: int) -> int:
    """The most samples one forward of the update can take: a rank's rows of one optimizer group at one timestep."""
    per_rank = cfg.prompts_per_iter * cfg.k // max(world, 1)
    return max(1, -(-per_rank // cfg.updates_per_iter))


def recompute_count(value: int | bool, blocks: int) -> int:
    """Blocks recomputed for a resolved gradient_checkpointing value: true all, false none, N the first N."""
    if isinstance(value, bool):
        return blocks if value else 0
    return min(int(value), blocks)


def choose(fixed: float, plain: float, recomputed: float, blocks: int, budget: float, rows: int,
           train_batch: int | None = None, recompute: int | None = None) -> tuple[int, int] | None:  # fmt: skip
    """(micro-batch, blocks recomputed) whose update phase fits `budget`: `fixed` is the phase's memory without
    activations, `plain` / `recomputed` one sample's activations with none / every block recomputed. A given
    `train_batch` or `recompute` is kept; None when nothing fits."""
    per_block = (plain - recomputed) / blocks if blocks else 0.0

    def fits(b: int, k: int) -> bool:
        return fixed + b * (plain - k * per_block) <= budget

    ks = [recompute] if recompute is not None else list(range(blocks + 1))
    bs = [train_batch] if train_batch is not None else list(range(rows, 0, -1))
    if train_batch is None and recompute is None:  # no recompute at the largest micro-batch that allows it
        b = next((b for b in bs if fits(b, 0)), None)
        if b is not None:
            return b, 0
        bs = [1]
    for k in ks:  # the fewest blocks recomputed ...
        for b in bs:  # ... at the largest micro-batch
            if fits(b, k):
                return b, k
    return None


def defaults(cfg: RLConfig, why: str) -> UpdateSizes:
    """The config's sizes with auto as the documented defaults (16, no recompute): a CPU, or no plan."""
    tb, gc = cfg.train_batch_size, cfg.gradient_checkpointing
    return UpdateSizes(DEFAULT_TRAIN_BATCH if tb == AUTO else tb, False if gc == AUTO else gc, why)


def size_update(cfg: RLConfig, world: int, gpu_gib: float, fixed: float, plain: float, recomputed: float,
                blocks: int, advice: Sequence[str] = ()) -> UpdateSizes:  # fmt: skip
    """`cfg`'s update sizes on `world` GPUs of `gpu_gib` GiB, from its memory plan at one sample (rl/memplan.py's
    resolve_update_sizes): the update's memory besides activations (`fixed`), one sample's activations with none
    (`plain`) or every one of the `blocks` recomputed. Raises ConfigError, before any weight loads, when not even a
    micro-batch of one sample with every block recomputed fits; `advice` is the plan's, for that message."""
    tb, gc = cfg.train_batch_size, cfg.gradient_checkpointing
    budget, rows = HEADROOM * gpu_gib, rows_per_slot(cfg, world)
    given_k = None if gc == AUTO else recompute_count(gc, blocks)
    got = choose(fixed, plain, recomputed, blocks, budget, rows, None if tb == AUTO else tb, given_k)
    where = f"{world} x {gpu_gib:g} GiB" if world > 1 else f"{gpu_gib:g} GiB"
    if got is None:
        what = f"train_batch_size={tb}" if tb != AUTO else "a micro-batch of one sample"
        also = "" if gc == AUTO or given_k == blocks else f" with gradient_checkpointing={gc}"
        short = (f"{what}{also} does not fit the update in {HEADROOM:.0%} of {where}, even "
                 f"{'with every block recomputed' if gc == AUTO else 'so'}")  # fmt: skip
        raise NothingFits(short, f"config {cfg.name!r}: {short} (the update needs {fixed:.3g} GiB besides its "
                                 f"activations, one sample {plain:.3g} GiB of them, {recomputed:.3g} GiB recomputed): "
                                 + "; ".join([*advice[:3], "or set memory_check=false to start anyway"]))  # fmt: skip
    b, k = got
    value: int | bool = k == blocks if k in (0, blocks) else k
    act = b * (plain - k * (plain - recomputed) / blocks if blocks else plain)
    reason = (f"{'auto' if tb == AUTO else 'set'} micro-batch {b} of {rows} rows a slot, "
              f"{'auto' if gc == AUTO else 'set'} recompute of {k} of {blocks} blocks: update peak "
              f"{fixed + act:.3g} GiB of {budget:.3g} ({HEADROOM:.0%} of {where})")  # fmt: skip
    return UpdateSizes(b, value, reason)


def recompute_blocks(transformer: nn.Module, names: Sequence[str], value: int | bool) -> int:
    """Recompute the first `value` repeated blocks of `transformer` (true: all; false: none) in the backward, through
    diffusers' own checkpointing seam (each block called inside torch.utils.checkpoint, so a sharded block's
    hooks gather its weights again in the recompute); the others keep their activations. The count recomputed."""
    from solrl_engine.sampling.compile import repeated_blocks

    blocks = repeated_blocks(transformer, names)
    chosen = {id(b) for b in blocks[: recompute_count(value, len(blocks))]}
    if not chosen:
        if getattr(transformer, "gradient_checkpointing", False):
            transformer.disable_gradient_checkpointing()
        return 0

    def run(module: nn.Module, *args: object, **kwargs: object) -> object:
        if id(module) in chosen:
            return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)
        return module(*args, **kwargs)

    transformer.enable_gradient_checkpointing(run)
    return len(chosen)
