"""Data parallelism on torch.distributed, launched by torchrun (gloo on CPU, nccl on GPUs).

    torchrun --nproc_per_node 8 --no-python solrl train CONFIG_SPEC ...

Every rank draws the same global prompts and seeds from the same generators (so the run depends on
`seed` alone, not on the world size), takes its contiguous share of the prompts (all N seeds of a
prompt on one rank, as the paper does), and gathers rewards so advantages and metrics are the
global ones; gradients are summed across ranks after each rank weighs its samples by the global
batch, so every rank applies the same update as a one-process run would (up to summation order).
Rank 0 alone writes metrics, plots, checkpoints and exports. A one-process run is world size 1
through the same code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    # the policy's base weights are FSDP2-sharded (rl/sharding.py): every forward of the policy is a collective,
    # so every rank must run the same number of them (the update pads its micro-batches, rank 0 never samples alone)
    sharded: bool = False
    # context parallelism (rl/context_parallel.py): groups of `cp` consecutive ranks split each forward's sequence
    # and hold the same samples; the data is split over the groups (dp_rank of dp_world)
    cp: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's share of the data: its context-parallel group's index."""
        return self.rank // self.cp

    @property
    def dp_world(self) -> int:
        """How many shares the data splits into: the number of context-parallel groups."""
        return self.world // self.cp

    @staticmethod
    def from_env(device_type: str) -> Dist:
        """The process group torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK),
        initialised once; world size 1 without it."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return Dist()
        import torch.distributed as td

        if not td.is_initialized():
            td.init_process_group("nccl" if device_type == "cuda" else "gloo")
        return Dist(td.get_rank(), td.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of n items (n must divide evenly): its context-parallel group's share."""
        if n % self.dp_world:
            groups = f" ({self.dp_world} groups of {self.cp} context-parallel ranks)" if self.cp > 1 else ""
            raise ValueError(f"{n} items do not split evenly over {self.world} ranks{groups}")
        per = n // self.dp_world
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every share's rows, concatenated in rank order (equal row counts); a context-parallel group's rows once."""
        if self.world == 1:
            return x
        import torch.distributed as td

        parts = [torch.empty_like(x) for _ in range(self.world)]
        td.all_gather(parts, x.contiguous())
        return torch.cat(parts[:: self.cp])

    def sum_data_(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum over the data's shares (a statistic of the samples: each context-parallel group's copy of
        its samples counted once). Gradients sum over every rank instead (`sum_grads_`): a context-parallel rank's
        gradient is its part of the sequence's."""
        return self.sum_(x).div_(self.cp) if self.cp > 1 else self.sum_(x)

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks."""
        if self.world > 1:
            import torch.distributed as td

            td.all_reduce(x, op=td.ReduceOp.SUM)
        return x

    def sum_grads_(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over ranks, flattened into one collective; sharded (DTensor) parameters are
        left out: FSDP2 already reduce-scattered theirs (rl/sharding.py)."""
        if self.world == 1:
            return
        from torch.distributed.tensor import DTensor

        params = [p for p in params if not isinstance(p, DTensor)]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # and whether each had a gradient: one that none of the ranks' micro-batches reached (a two-expert model's
        # expert whose timesteps no row drew) keeps none, so the optimizer skips it as one process would, rather
        # than stepping on a zero gradient (AdamW's momentum and weight decay would still move it)
        had = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
        flat = self.sum_(torch.cat([g.flatten().float() for g in grads] + [had]))
        i = 0
        for p, g, seen in zip(params, grads, flat[-len(params):].tolist(), strict=True):
            n = g.numel()
            p.grad = flat[i : i + n].view_as(g).to(g.dtype) if seen else None
            i += n

    def most(self, n: int, device: torch.device | str = "cpu") -> int:
        """The largest of every rank's `n` (how many micro-batches the rank with the most runs); `device` is
        where the collective's tensor lives (a GPU under nccl)."""
        if self.world == 1:
            return n
        import torch.distributed as td

        t = torch.tensor([n], dtype=torch.int64, device=device)
        td.all_reduce(t, op=td.ReduceOp.MAX)
        return int(t.item())

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (a decision every rank must share, e.g. a timed choice)."""
        if self.world == 1:
            return obj
        import torch.distributed as td

        box = [obj]
        td.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            td.barrier()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor; any other tensor as it is. (A DTensor's reduction read with
    bool() or item() gives this rank's value only: checks that must agree read the local part and agree.)"""
    if not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) weight gathered whole on every rank (a collective: every rank calls it in the same
    order); any other tensor as it is."""
    if not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
