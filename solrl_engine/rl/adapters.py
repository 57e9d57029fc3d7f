"""LoRA adapters through PEFT on one shared base transformer: the trained adapter ("default"), the
sampling adapter ("old", an EMA of the trained one), the reference (adapters disabled), and an EMA of
the trained adapter for evaluation. One base copy of the weights serves all four.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from solrl_engine.rl.distributed import whole

TRAIN, OLD = "default", "old"


class LazyWeights(Mapping[str, torch.Tensor]):
    """name -> tensor, each made only when asked for (a LoRA-merged weight, a sharded weight gathered whole), so the
    explore copy's refresh holds one block's worth at a time, not a second copy of every weight. Under sharding
    each is a collective: every rank asks for the same names in the same order."""

    def __init__(self, names: Iterable[str], make: Callable[[str], torch.Tensor]) -> None:
        self._names = list(names)
        self._known = set(self._names)
        self._make = make

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class PolicySets:
    """What both kinds of trained weights share (LoraAdapters here, rl.full.FullWeights): switching the active
    policy for a block, and the moves of the "old" sampling policy and the EMA towards the trained weights.
    A subclass says which tensors those are (`_trained`, `_old`) and how to switch (`use`)."""

    ema: list[torch.Tensor]
    # whether saving (checkpoints through torch.distributed.checkpoint, exports gathered) needs every rank
    collective_io = False

    def use(self, which: str) -> None:
        raise NotImplementedError

    def _trained(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _old(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @contextlib.contextmanager
    def using(self, which: str) -> Iterator[None]:
        self.use(which)
        try:
            yield
        finally:
            self.use(TRAIN)

    @torch.no_grad()
    def update_old(self, step: int, rate: float = 0.001, max_decay: float = 0.5) -> float:
        """old <- d old + (1 - d) theta with d = min(rate * step, max_decay); returns d."""
        d = min(rate * step, max_decay)
        for o, p in zip(self._old(), self._trained(), strict=True):
            o.mul_(d).add_(p, alpha=1 - d)
        return d

    @torch.no_grad()
    def update_ema(self, step: int, max_decay: float = 0.9) -> None:
        d = min((1 + step) / (10 + step), max_decay)
        for e, p in zip(self.ema, self._trained(), strict=True):
            e.mul_(d).add_(p.detach(), alpha=1 - d)


class LoraAdapters(PolicySets):
    """Owns the LoRA state of `transformer` (a diffusers model with PEFT support)."""

    kind = "lora"  # train_mode=lora (rl/full.py holds train_mode=full)

    def __init__(self, transformer: nn.Module, rank: int, alpha: int, targets: tuple[str, ...]) -> None:
        try:
            from peft import LoraConfig
        except ImportError as e:  # pragma: no cover - peft is a core dependency
            raise ImportError("LoRA training needs peft: pip install peft") from e
        self.transformer = transformer
        transformer.requires_grad_(False)
        cfg = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets))
        try:
            transformer.add_adapter(cfg, adapter_name=TRAIN)
        except ValueError as e:
            raise ValueError(f"LoRA targets {targets} match no layer of {type(transformer).__name__}: {e}") from e
        with warnings.catch_warnings():  # a second adapter is the point here, not a mistake
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            transformer.add_adapter(cfg, adapter_name=OLD)
        self.layers = {n: m for n, m in transformer.named_modules() if hasattr(m, "lora_A") and TRAIN in m.lora_A}
        with torch.no_grad():
            for a, b in zip(self.params(OLD), self.params(TRAIN), strict=True):
                a.copy_(b)
        self.ema = [p.detach().clone() for p in self.params(TRAIN)]
        # one list every LoRA layer reads as its active adapters: a switch is one assignment, not a walk over the
        # layers (PEFT's set_adapter visits each and flips every adapter's requires_grad; ours never change: the
        # trained adapter always takes gradients, "old" never does)
        self._active: list[str] = [TRAIN]
        self._first = next(iter(self.layers.values()))
        self._share_switch()

    def params(self, adapter: str) -> list[nn.Parameter]:
        """The LoRA A and B matrices of `adapter`, in a fixed order."""
        out = []
        for m in self.layers.values():
            out += [m.lora_A[adapter].weight, m.lora_B[adapter].weight]
        return out

    def _share_switch(self) -> None:
        """Point every LoRA layer at the one active-adapter list (a walk, once, or after PEFT switched them itself)
        and set which adapter takes gradients."""
        self.transformer.enable_adapters()  # (PEFT's own: clears any layer's "disabled" flag)
        for m in self.layers.values():
            m._active_adapter = self._active  # what PEFT's active_adapters reads; PEFT's set_adapter replaces it
        for p in self.params(TRAIN):
            p.requires_grad_(True)
        for p in self.params(OLD):
            p.requires_grad_(False)

    def use(self, which: str) -> None:
        """Activate "default", "old" or "ref" (no adapter: the base alone). Only "default" ever takes gradients.
        One assignment to the list every layer reads; where PEFT's own set_adapter / disable_adapters replaced it,
        the list is shared again first."""
        if self._first._active_adapter is not self._active or self._first.disable_adapters:
            self._share_switch()
        self._active[:] = [] if which == "ref" else [which]

    def _trained(self) -> list[torch.Tensor]:
        return self.params(TRAIN)

    def _old(self) -> list[torch.Tensor]:
        return self.params(OLD)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Temporarily load the EMA into the trained adapter (for evaluation)."""
        live = [p.detach().clone() for p in self.params(TRAIN)]
        with torch.no_grad():
            for p, e in zip(self.params(TRAIN), self.ema, strict=True):
                p.copy_(e)
        try:
            with self.using(TRAIN):
                yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params(TRAIN), live, strict=True):
                    p.copy_(v)

    def merged_weights(self, adapter: str = OLD) -> LazyWeights:
        """{"<layer>.weight": base + scale * B A} for every LoRA layer (keys as in the base model), each merged
        when read (LazyWeights)."""

        @torch.no_grad()
        def merge(key: str) -> torch.Tensor:
            m = self.layers[key.removesuffix(".weight")]
            w = whole(m.base_layer.weight)  # sharding=fsdp: gathered one layer at a time (rl/sharding.py)
            return (w.float() + m.get_delta_weight(adapter).float()).to(w.dtype)

        return LazyWeights((f"{name}.weight" for name in self.layers), merge)

    def side_branch(self, name: str, adapter: str = OLD) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(A, B, scale) of one layer: the BF16 LoRA branch a quantized copy can add to its output."""
        m = self.layers[name]
        return m.lora_A[adapter].weight, m.lora_B[adapter].weight, float(m.scaling[adapter])

    def names(self) -> list[str]:
        """Names of the LoRA matrices, in the order of `params` ("<layer>.lora_A", "<layer>.lora_B")."""
        return [f"{n}.{ab}" for n in self.layers for ab in ("lora_A", "lora_B")]

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Named tensors of the trained, old and EMA adapters (readable by any tool: names are the
        layers' module names)."""
        named = self.names()
        return {
            TRAIN: {n: p.detach().cpu().clone() for n, p in zip(named, self.params(TRAIN), strict=True)},
            OLD: {n: p.detach().cpu().clone() for n, p in zip(named, self.params(OLD), strict=True)},
            "ema": {n: e.cpu().clone() for n, e in zip(named, self.ema, strict=True)},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Check every name and shape first, then copy (a mismatched checkpoint changes nothing)."""
        named = self.names()
        groups = ((TRAIN, self.params(TRAIN)), (OLD, self.params(OLD)), ("ema", self.ema))
        for key, params in groups:
            got = state[key]
            if set(got) != set(named):
                missing, extra = sorted(set(named) - set(got)), sorted(set(got) - set(named))
                raise ValueError(
                    f"checkpoint's {key} adapter does not match the model's LoRA layers: missing {missing[:3]}, "
                    f"unexpected {extra[:3]} (was it written with other lora_targets or another model?)"
                )
            for n, p in zip(named, params, strict=True):
                if got[n].shape != p.shape:
                    shapes = f"{tuple(got[n].shape)}, the model {tuple(p.shape)}"
                    raise ValueError(f"checkpoint's {key} {n} has shape {shapes}")
        for key, params in groups:
            for n, p in zip(named, params, strict=True):
                p.copy_(state[key][n])
