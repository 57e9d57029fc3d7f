"""Full fine-tuning (train_mode=full): the DiffusionNFT update on every weight of the transformer, with the
same four policies LoRA training has, held as whole weight sets instead of adapters:

- the trained weights ("default"): the transformer's own parameters, in FP32 (as LoRA's are: AdamW on BF16
  weights loses updates below a weight's rounding step);
- the "old" sampling policy: an FP32 copy, moved towards the trained weights after every iteration by the
  same decay as LoRA's old adapter (a BF16 copy would round each small move away);
- the reference policy: the frozen base weights, kept in the dtype they were loaded in (the policy dtype),
  which is exactly what the base computes with, so the KL term is the same as LoRA's `adapters off`;
- an FP32 EMA of the trained weights, evaluated and exported.

Switching policy swaps each parameter's storage (`param.data`), never copies: the transformer computes with
whichever set is active. Under `sharding=fsdp` (`shard`) every set is this rank's shard of each weight, and
switching copies into the parameters' own shards (FSDP2 gathers from its own storage, so a swapped `.data` would
never be seen); the trained set waits in a stash meanwhile (4 more bytes per weight, over the ranks).
Per parameter that is 4 (trained) + 4 (old) + 4 (EMA) + 2 (reference, BF16) bytes,
plus AdamW's 8: 22 bytes against LoRA's 2 (docs/full-fine-tuning.md).

`FullWeights` presents what the trainer, the held-out evaluation and the explore copy use of
`rl.adapters.LoraAdapters`; `merged_weights` gives the old policy's every tensor, so the explore copy's
refresh re-quantizes its quantized layers and copies everything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from solrl_engine.rl.adapters import OLD, TRAIN, LazyWeights, LoraAdapters, PolicySets
from solrl_engine.rl.distributed import local

REF, EMA = "ref", "ema"


class FullWeights(PolicySets):
    """The trained, old, reference and EMA weight sets of `transformer` (every parameter is trained)."""

    kind = "full"

    def __init__(self, transformer: nn.Module, sharded: bool = False) -> None:
        """`sharded` (sharding=fsdp or hsdp): nothing is made now; rl/sharding.py upcasts the base to FP32 block by
        block as it shards it, and `shard` makes every set as this rank's shards, so no rank ever holds one whole."""
        self.transformer = transformer
        named = list(transformer.named_parameters())
        if not named:
            raise ValueError(f"{type(transformer).__name__} has no parameters to train")
        self._names = [n for n, _ in named]
        # the modules owning parameters, by name: what the explore copy must have a counterpart of
        self.layers = {n: m for n, m in transformer.named_modules() if any(True for _ in m.parameters(recurse=False))}
        self._ref_dtypes = [p.dtype for _, p in named]
        self._copying = False  # sharding=fsdp (`shard`): switching copies into the parameters' shards
        self._stash: list[torch.Tensor] = []
        self._active = ""
        if sharded:  # nothing held until `shard`: a reference kept here would keep each replaced weight alive
            self._params: list[nn.Parameter] = []
            self._sets: dict[str, list[torch.Tensor]] = {}
            self.ema = []
            for _, p in named:
                p.requires_grad_(True)
            return
        self._params = [p for _, p in named]
        with torch.no_grad():
            ref = [p.data for p in self._params]  # the loaded base, as it is (no copy)
            train = [t.float().clone() if t.dtype == torch.float32 else t.float() for t in ref]
            self._sets = {TRAIN: train, OLD: [t.clone() for t in train], REF: ref}
            self.ema = [t.clone() for t in train]
        self.use(TRAIN)

    @property
    def collective_io(self) -> bool:  # type: ignore[override]
        """Sharded: checkpoints (DCP, every rank its shards) and exports (gathered, rank 0 writes) need every rank."""
        return self._copying

    @torch.no_grad()
    def shard(self) -> None:
        """After the transformer's FP32 trained weights were sharded (rl/sharding.py): the old, reference and EMA
        sets are made as this rank's shards of each weight (from the trained ones, as at start: the reference is
        the base, whose FP32 upcast is exact), and switching copies. One process takes the same path, whole."""
        named = list(self.transformer.named_parameters())
        if [n for n, _ in named] != self._names:
            raise RuntimeError("sharding changed the transformer's parameter names")
        self._params = [p for _, p in named]
        live = [local(p.data) for p in self._params]  # a sharded one's shard: the storage FSDP2 gathers from
        self._sets = {TRAIN: live, OLD: [t.clone() for t in live],
                      REF: [t.to(d, copy=True) for t, d in zip(live, self._ref_dtypes, strict=True)]}  # fmt: skip
        self.ema = [t.clone() for t in live]
        self._stash = [torch.empty_like(t) for t in live]
        self._copying, self._active = True, TRAIN

    def params(self, which: str) -> list[nn.Parameter] | list[torch.Tensor]:
        """The trained parameters (TRAIN: what the optimizer steps) or the old policy's tensors (OLD)."""
        if which == TRAIN:
            return self._params
        return self._sets[which]

    def names(self) -> list[str]:
        """The parameters' names, in the order of `params`."""
        return list(self._names)

    @torch.no_grad()
    def _show(self, which: str, tensors: list[torch.Tensor]) -> None:
        """Make `tensors` (the set `which`) what the transformer computes with."""
        if not self._copying:
            for p, t in zip(self._params, tensors, strict=True):
                p.data = t
        elif which != self._active:
            live = self._sets[TRAIN]
            if self._active == TRAIN:  # the trained weights wait in the stash
                torch._foreach_copy_(self._stash, live)
            torch._foreach_copy_(live, self._stash if which == TRAIN else tensors)
        self._active = which

    def use(self, which: str) -> None:
        """Activate "default" (trained, takes gradients), "old" or "ref" (the frozen base)."""
        if which not in self._sets:
            raise ValueError(f"unknown weight set {which!r}: one of {sorted(self._sets)}")
        self._show(which, self._sets[which])
        for p in self._params:
            p.requires_grad_(which == TRAIN)

    def _trained(self) -> list[torch.Tensor]:
        return self._stash if self._copying and self._active != TRAIN else self._sets[TRAIN]

    def _old(self) -> list[torch.Tensor]:
        return self._sets[OLD]

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The EMA weights active (for evaluation and export); the trained ones back afterwards."""
        self._show(EMA, self.ema)
        for p in self._params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            self.use(TRAIN)

    def merged_weights(self, adapter: str = OLD) -> LazyWeights:
        """{"<parameter name>": tensor} of a weight set (default: the old policy's): every parameter, so a
        refreshed explore copy holds the whole old policy, not only some layers. Each is read when asked for
        (LazyWeights): sharded, gathered whole then, one weight at a time."""
        tensors = self.ema if adapter == EMA else self._trained() if adapter == TRAIN else self._sets[adapter]
        index = {n: i for i, n in enumerate(self._names)}

        @torch.no_grad()
        def read(name: str) -> torch.Tensor:
            return _whole(self._params[index[name]], tensors[index[name]])

        return LazyWeights(self._names, read)

    @torch.no_grad()
    def export_state(self, ema: bool = False, keep: bool = True) -> dict[str, torch.Tensor]:
        """The transformer's state dict with the trained (or EMA) weights, whole, on the CPU, in the dtypes the base
        was loaded in: what an export writes. Under sharding, a collective: every rank calls it, and the ranks that
        do not write (`keep` False) gather each weight in turn and drop it (an empty dict)."""
        tensors = self.ema if ema else self._trained()
        out = {}
        for n, p, t, d in zip(self._names, self._params, tensors, self._ref_dtypes, strict=True):
            w = _whole(p, t)
            if keep:
                out[n] = w.detach().to("cpu", d, copy=True).contiguous()
        if not keep:
            return {}
        for m_name, m in self.transformer.named_modules():  # the persistent buffers, as state_dict() has them
            for b_name, b in m.named_buffers(recurse=False):
                if b is not None and b_name not in m._non_persistent_buffers_set:
                    out[f"{m_name}.{b_name}".lstrip(".")] = b.detach().to("cpu", copy=True).contiguous()
        return out

    def side_branch(self, name: str, adapter: str = OLD) -> tuple[torch.Tensor, torch.Tensor, float]:
        raise ValueError("full fine-tuning has no LoRA branch to add to the explore copy: it always refreshes the "
                         "copy with the whole old policy (merge_lora must stay true with train_mode=full)")  # fmt: skip

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The trained, old and EMA weight sets by parameter name (the reference is the base model's weights), whole
        (sharded: gathered, a collective; a sharded run checkpoints through `sharded_state` instead)."""
        sets = ((TRAIN, self._trained()), (OLD, self._sets[OLD]), (EMA, self.ema))  # whole, gathered if sharded
        return {key: {n: _whole(p, t).detach().cpu().clone() for n, p, t in
                      zip(self._names, self._params, tensors, strict=True)} for key, tensors in sets}  # fmt: skip

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Check every name and shape first, then copy (a mismatched checkpoint changes nothing). Unsharded:
        a sharded run loads through `sharded_state`."""
        if self._copying and any(_is_dtensor(p) for p in self._params):
            raise RuntimeError("a sharded run's weight sets load through torch.distributed.checkpoint "
                               "(sharded_state), not a whole state dict")  # fmt: skip
        for key in (TRAIN, OLD, EMA):
            got = state.get(key)
            if got is None or set(got) != set(self._names):
                have = set(got or {})
                missing, extra = sorted(set(self._names) - have), sorted(have - set(self._names))
                raise ValueError(
                    f"checkpoint's {key} weights do not match the transformer's parameters: missing {missing[:3]}, "
                    f"unexpected {extra[:3]} (was it written by a LoRA run, train_mode=lora, or another model?)"
                )
            for n, p in zip(self._names, self._params, strict=True):
                if tuple(state[key][n].shape) != tuple(p.shape):
                    raise ValueError(f"checkpoint's {key} {n} has shape {tuple(state[key][n].shape)}, the model "
                                     f"{tuple(p.shape)}")  # fmt: skip
        for key, tensors in ((TRAIN, self._trained()), (OLD, self._sets[OLD]), (EMA, self.ema)):
            for n, t in zip(self._names, tensors, strict=True):
                t.copy_(state[key][n])

    def sharded_state(self, opt: torch.optim.Optimizer, with_opt: bool = True) -> dict[str, Any]:
        """The trained, old and EMA sets and AdamW's state as `torch.distributed.checkpoint` saves and loads them
        in place: each rank's shards, as DTensors on the tensors themselves (no copy; plain tensors in one
        process). DCP reshards on load, so a checkpoint resumes on any number of ranks; nothing is gathered.
        `with_opt` False leaves AdamW out (an optimizer that never stepped: asking for its state would step it)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sets = ((TRAIN, self._trained()), (OLD, self._sets[OLD]), (EMA, self.ema))
        weights = {key: {n: _as_dtensor(p, t) for n, p, t in zip(self._names, self._params, tensors, strict=True)}
                   for key, tensors in sets}  # fmt: skip
        return {"weights": weights, **({"opt": get_optimizer_state_dict(self.transformer, opt)} if with_opt else {})}

    def load_sharded_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """After `dcp.load` filled `sharded_state`'s dict: the weight sets are already in place; AdamW's state goes
        into `opt`."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if "opt" in state:
            set_optimizer_state_dict(self.transformer, opt, state["opt"])


def _whole(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`, this rank's shard of the sharded parameter `p`, gathered whole (a collective); else `t` as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    return t


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _as_dtensor(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`, this rank's shard of the sharded parameter `p`, as a DTensor on the same storage; `t` itself otherwise."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


TrainedWeights = LoraAdapters | FullWeights  # what a run trains (train_mode lora or full), one interface
