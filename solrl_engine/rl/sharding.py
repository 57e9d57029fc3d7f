"""FSDP2 sharding of the policy over torchrun's ranks (`sharding=fsdp`): a LoRA run's frozen base weights, or
(train_mode=full) every trained weight, with its gradients, AdamW state and old / reference / EMA sets.

Why this shape: in a LoRA run the base weights are nearly all of the policy's memory and never change, while
the adapters (trained, "old", EMA and AdamW's state) are small and switched, averaged and saved every
iteration. So each repeated block and then the root are `fully_shard`-ed with the LoRA matrices left out
(`ignored_params`): the base weights live 1/world on each rank and are gathered block by block inside each
forward (and again in the backward), while the adapters stay whole on every rank, summed across ranks as in an
unsharded run, and saved by rank 0 in the same checkpoint format. A checkpoint therefore resumes on any number
of ranks (with the same `sharding`: a sharded policy samples with its LoRA unmerged, an unsharded one merged).

Full fine-tuning shards every weight instead (no parameter is left out): FSDP2 reduce-scatters the gradients,
summed (the divide factor 1 and a plain SUM), so each rank steps AdamW on its shard, and rl/full.py keeps its
old, reference and EMA sets as this rank's shards. Its checkpoints are `torch.distributed.checkpoint` files, each
rank writing its shards, sealed with rank 0's state in one manifest (store/checkpoint.py `save_sharded`); DCP
reshards on load, so they resume on any rank count. Exports gather each weight whole on every rank for rank 0.

What it asks of the rest: every forward of the policy is a collective, so every rank runs the same number
(rl/update.py pads its micro-batches, the end-of-run comparison runs on every rank); the policy samples eagerly
with its LoRA unmerged (a merged copy would be a whole second copy of the weights); the explore copy is built
before sharding and refreshed from weights gathered one layer at a time (rl/adapters.py `merged_weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from solrl_engine.rl.distributed import Dist
from solrl_engine.sampling.compile import repeated_blocks


def shard_policy(transformer: nn.Module, blocks: Sequence[str], keep: Iterable[nn.Parameter], dist: Dist,
                 device: torch.device, upcast: bool = False, group: int = 0) -> int:  # fmt: skip
    """`fully_shard` each repeated block of `transformer` (classes `blocks`), then the root, over all of `dist`'s
    ranks, leaving the parameters `keep` whole; marks `dist` sharded. Returns how many blocks were sharded (one
    process: none, nothing changes, and the run takes the same paths as a sharded one). `upcast` (full
    fine-tuning: FP32 trained weights) makes each block's weights FP32 just before it is sharded, so no rank ever
    holds the whole model in FP32. `group` > 0: HSDP, sharded within consecutive groups of that many ranks (a
    node's GPUs) and replicated across the groups (FSDP2 on a 2-D mesh: reduce-scatter inside a group,
    all-reduce across groups)."""
    found = repeated_blocks(transformer, blocks)
    if not found:
        raise ValueError(f"sharding=fsdp shards {type(transformer).__name__} by its repeated blocks {tuple(blocks)}, "
                         "and none was found: this model's spec needs `repeated_blocks`")  # fmt: skip
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if have < (2, 8):  # FSDP2 resharded its root after forward (a rank-0-only export then desynced ranks) from 2.8
        raise RuntimeError(f"sharding=fsdp needs torch >= 2.8 (this is {torch.__version__}): upgrade torch, or "
                           "use sharding=none")  # fmt: skip
    dist.sharded = True

    def fp32(m: nn.Module) -> None:
        if upcast:
            with torch.no_grad():
                for p in m.parameters():
                    if p.dtype != torch.float32:  # (the root's pass skips the sharded blocks' FP32 shards)
                        p.data = p.data.float()

    if dist.world == 1:
        fp32(transformer)
        return 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if group and (group > dist.world or dist.world % group):
        raise ValueError(f"sharding=hsdp: {dist.world} ranks do not split into groups of {group} (shard_group_size, "
                         "or the ranks per node): pick a divisor of the number of ranks")  # fmt: skip
    mesh = (init_device_mesh(device.type, (dist.world // group, group), mesh_dim_names=("replicate", "shard"))
            if group else init_device_mesh(device.type, (dist.world,)))  # fmt: skip
    ignored = set(keep)
    for b in found:
        fp32(b)
        fully_shard(b, mesh=mesh, ignored_params=ignored, reshard_after_forward=True)
    fp32(transformer)  # what the blocks left: the root's own weights (blocks' shards are FP32 already)
    # the root resharded after each forward too (FSDP2 keeps it gathered by default): rank 0 alone reads the
    # model's state dict for an export, which reshards it there only, and the next forwards would then disagree
    fully_shard(transformer, mesh=mesh, ignored_params=ignored, reshard_after_forward=True)
    for m in (*found, transformer):  # trained sharded weights (train_mode=full): gradients summed, not averaged,
        m.set_gradient_divide_factor(1.0)  # as every rank already weighs its samples by the global batch
        m.set_force_sum_reduction_for_comms(True)  # (a plain SUM: gloo refuses the pre-multiplied one)
    return len(found)


def settle_(modules: Iterable[nn.Module], device: torch.device, extra: list[torch.Tensor] | None = None) -> int:
    """After a staged start-up (rl/runtime.staged: the base loaded on the CPU, FSDP2 moving each block to `device` as
    it shards it), move what FSDP2 left where it was (the LoRA matrices it leaves out, buffers outside its blocks, and
    the tensors in `extra`, replaced in the list) to `device`, each parameter keeping its identity (the optimizer
    and the copies hold them); then check that every tensor of `modules` is on `device`, so a stray one fails here,
    naming it, rather than mid-run. Returns how many tensors moved."""
    from torch.distributed.tensor import DTensor

    def there(t: torch.Tensor) -> bool:
        return _on(t.device, device)

    moved = 0
    with torch.no_grad():
        for module in modules:
            for m in module.modules():
                for _, p in m.named_parameters(recurse=False):
                    if not isinstance(p, DTensor) and not there(p):
                        new = p.data.to(device)
                        if torch._has_compatible_shallow_copy_type(p.data, new):  # as nn.Module.to moves one
                            p.data = new
                        else:  # (another tensor type, as the meta device's: the same object, swapped)
                            torch.utils.swap_tensors(p, nn.Parameter(new, requires_grad=p.requires_grad))
                        moved += 1
                for name, b in m.named_buffers(recurse=False):
                    if not isinstance(b, DTensor) and not there(b):
                        m._buffers[name] = b.to(device)
                        moved += 1
        for i, t in enumerate(extra or []):
            if not there(t):
                extra[i] = t.to(device)  # type: ignore[index]
                moved += 1
    stray = elsewhere(modules, device)
    if stray:
        raise RuntimeError(f"after sharding, {len(stray)} tensors are not on {device}: {', '.join(stray[:4])}; this is "
                           "a bug of the staged start-up (rl/sharding.py): report it, and meanwhile set "
                           "sharding=none")  # fmt: skip
    return moved


def elsewhere(modules: Iterable[nn.Module], device: torch.device) -> list[str]:
    """"<name> (<device>)" of every parameter and buffer of `modules` (a sharded one: its local part) that is not on
    `device` (a device without an index: any of that type)."""
    from torch.distributed.tensor import DTensor

    out = []
    for module in modules:
        for n, t in [*module.named_parameters(), *module.named_buffers()]:
            d = (t.to_local() if isinstance(t, DTensor) else t).device
            if not _on(d, device):
                out.append(f"{n} ({d})")
    return out


def _on(d: torch.device, device: torch.device) -> bool:
    """Whether `d` is `device` (one without an index: any device of its type)."""
    return d.type == device.type and (device.index is None or d.index in (None, device.index))


def sharded_bytes(transformer: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's shards, bytes the same parameters hold whole): what sharding saved on this rank."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for p in transformer.parameters():
        if isinstance(p, DTensor):
            local += p.to_local().numel() * p.element_size()
            full += p.numel() * p.element_size()
    return local, full


class ShardedCopy:
    """The explore copy's repeated blocks split over the ranks (explore_sharding=shard): each tensor of a block (a
    quantized layer's codes and scales, a kept layer's weight) keeps this rank's rows only, and the whole block is
    gathered just before its forward (one all-gather of its bytes) and dropped after, as FSDP2 does for the policy.
    For when the whole copy does not fit beside the sharded policy (Wan2.2-A14B's two experts quantized: about
    26 GiB on each GPU, 3.3 on 8): its forwards are collectives, so it samples eagerly (no captured graph or compiled
    region can hold a gather; its `gathers` flag tells the sampler), and every rank runs as many of them as a sharded
    policy's. Tensors with fewer rows than ranks (a scalar scale) and the tensors outside the blocks stay whole.
    `whole(names)` gathers the blocks holding those names and keeps what is written into them (the refresh)."""

    def __init__(self, root: nn.Module, blocks: Sequence[str], dist: Dist) -> None:
        self.dist = dist
        found = repeated_blocks(root, blocks)
        if not found:
            raise ValueError(f"explore_sharding shards the copy by its repeated blocks {tuple(blocks)}, and none was "
                             f"found in {type(root).__name__}")  # fmt: skip
        names = {id(m): n for n, m in root.named_modules()}
        self.blocks = {names[id(b)]: b for b in found}
        # per block: (owning module, tensor name, is a parameter, whole shape, dtype) and this rank's rows
        self._parts: dict[str, list[tuple[nn.Module, str, bool, torch.Size, torch.dtype]]] = {}
        self._local: dict[str, list[torch.Tensor]] = {}
        self.local_bytes = self.whole_bytes = 0
        for name, b in self.blocks.items():
            self._parts[name], self._local[name] = [], []
            for m in b.modules():
                for key, t in [*m._parameters.items(), *m._buffers.items()]:
                    if t is None or t.dim() == 0 or t.shape[0] < dist.world:
                        continue
                    self._parts[name].append((m, key, key in m._parameters, t.shape, t.dtype))
                    self.whole_bytes += t.numel() * t.element_size()
            self._reshard(name, [self._tensor(m, k) for m, k, *_ in self._parts[name]])
            self.local_bytes += sum(t.numel() * t.element_size() for t in self._local[name])
            b.register_forward_pre_hook(lambda _m, _a, name=name: self._gather(name))
            b.register_forward_hook(lambda _m, _a, _o, name=name: self._drop(name))
        root.gathers = True  # (graphed.GraphedSampler: sampled eagerly)

    @staticmethod
    def _tensor(m: nn.Module, key: str) -> torch.Tensor:
        return m._parameters[key] if key in m._parameters else m._buffers[key]

    @staticmethod
    def _put(m: nn.Module, key: str, param: bool, t: torch.Tensor) -> None:
        if param:
            m._parameters[key].data = t
        else:
            m._buffers[key] = t

    def _rows(self, n: int) -> int:
        return -(-n // self.dist.world)  # this rank's rows of n, the last rank's padded

    def _reshard(self, name: str, whole: list[torch.Tensor]) -> None:
        """Keep this rank's rows of each whole tensor (padded to equal parts) and drop the rest."""
        local = []
        for (m, key, param, shape, _), t in zip(self._parts[name], whole, strict=True):
            per = self._rows(shape[0])
            part = t.detach()[self.dist.rank * per : (self.dist.rank + 1) * per]
            pad = per - part.shape[0]
            if pad:
                part = torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])
            local.append(part.contiguous().clone())
            self._put(m, key, param, t.new_empty((0, *shape[1:])))
        self._local[name] = local

    def _gather(self, name: str) -> None:
        """Every rank's rows of the block's tensors, in one all-gather of their bytes, put back whole."""
        import torch.distributed as td

        local = self._local[name]
        if not local:
            return
        # each tensor's bytes padded to 16, so every tensor starts where a view of its dtype may (a rank's share of
        # NVFP4's 1-D swizzled scales can be an odd number of bytes on 6 or 24 ranks)
        sizes = [t.numel() * t.element_size() for t in local]
        flat = torch.cat([x for t, n in zip(local, sizes, strict=True)
                          for x in (t.reshape(-1).view(torch.uint8), t.new_zeros(-n % 16, dtype=torch.uint8))])
        out = flat.new_empty(self.dist.world * flat.numel())
        td.all_gather_into_tensor(out, flat)  # (one buffer, rank after rank: no copy out of a list)
        parts = out.view(self.dist.world, flat.numel())
        offset = 0
        for (m, key, param, shape, dtype), t, n in zip(self._parts[name], local, sizes, strict=True):
            rows = parts[:, offset : offset + n].reshape(-1).view(dtype).view(-1, *t.shape[1:])
            self._put(m, key, param, rows[: shape[0]])
            offset += n + (-n % 16)

    def _drop(self, name: str) -> None:
        for m, key, param, shape, _ in self._parts[name]:
            self._put(m, key, param, self._tensor(m, key).new_empty((0, *shape[1:])))

    @contextlib.contextmanager
    def whole(self, names: Iterable[str]) -> Iterator[None]:
        """The blocks holding any of `names` (the copy's tensor names) gathered whole; what is written into them is
        kept (each rank keeps its rows of it). A collective: every rank calls it with the same names."""
        names = list(names)
        hit = [b for b in self.blocks if any(n == b or n.startswith(b + ".") for n in names)]
        for b in hit:
            self._gather(b)
        try:
            yield
        finally:
            for b in hit:
                self._reshard(b, [self._tensor(m, k) for m, k, *_ in self._parts[b]])
