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
whichever set is active. Per parameter that is 4 (trained) + 4 (old) + 4 (EMA) + 2 (reference, BF16) bytes,
plus AdamW's 8: 22 bytes against LoRA's 2 (docs/full-fine-tuning.md).

`FullWeights` presents what the trainer, the held-out evaluation and the explore copy use of
`rl.adapters.LoraAdapters`; `merged_weights` gives the old policy's every tensor, so the explore copy's
refresh re-quantizes its quantized layers and copies everything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters, PolicySets

REF, EMA = "ref", "ema"


class FullWeights(PolicySets):
    """The trained, old, reference and EMA weight sets of `transformer` (every parameter is trained)."""

    kind = "full"

    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer
        named = list(transformer.named_parameters())
        if not named:
            raise ValueError(f"{type(transformer).__name__} has no parameters to train")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # the modules owning parameters, by name: what the explore copy must have a counterpart of
        self.layers = {n: m for n, m in transformer.named_modules() if any(True for _ in m.parameters(recurse=False))}
        with torch.no_grad():
            ref = [p.data for p in self._params]  # the loaded base, as it is (no copy)
            train = [t.float().clone() if t.dtype == torch.float32 else t.float() for t in ref]
            self._sets: dict[str, list[torch.Tensor]] = {
                TRAIN: train,
                OLD: [t.clone() for t in train],
                REF: ref,
            }
        self.ema = [t.clone() for t in train]
        self._active = ""
        self.use(TRAIN)

    def params(self, which: str) -> list[nn.Parameter] | list[torch.Tensor]:
        """The trained parameters (TRAIN: what the optimizer steps) or the old policy's tensors (OLD)."""
        if which == TRAIN:
            return self._params
        return self._sets[which]

    def names(self) -> list[str]:
        """The parameters' names, in the order of `params`."""
        return list(self._names)

    def _point(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self._params, tensors, strict=True):
            p.data = t

    def use(self, which: str) -> None:
        """Activate "default" (trained, takes gradients), "old" or "ref" (the frozen base)."""
        if which not in self._sets:
            raise ValueError(f"unknown weight set {which!r}: one of {sorted(self._sets)}")
        self._point(self._sets[which])
        for p in self._params:
            p.requires_grad_(which == TRAIN)
        self._active = which

    def _trained(self) -> list[torch.Tensor]:
        return self._sets[TRAIN]

    def _old(self) -> list[torch.Tensor]:
        return self._sets[OLD]

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The EMA weights active (for evaluation and export); the trained ones back afterwards."""
        self._point(self.ema)
        for p in self._params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            self.use(TRAIN)

    @torch.no_grad()
    def merged_weights(self, adapter: str = OLD) -> dict[str, torch.Tensor]:
        """{"<parameter name>": tensor} of a weight set (default: the old policy's): every parameter, so a
        refreshed explore copy holds the whole old policy, not only some layers."""
        tensors = self.ema if adapter == EMA else self._sets[adapter]
        return dict(zip(self._names, tensors, strict=True))

    def side_branch(self, name: str, adapter: str = OLD) -> tuple[torch.Tensor, torch.Tensor, float]:
        raise ValueError("full fine-tuning has no LoRA branch to add to the explore copy: it always refreshes the "
                         "copy with the whole old policy (merge_lora must stay true with train_mode=full)")  # fmt: skip

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The trained, old and EMA weight sets by parameter name (the reference is the base model's weights)."""
        named = self._names
        return {
            TRAIN: {n: t.detach().cpu().clone() for n, t in zip(named, self._sets[TRAIN], strict=True)},
            OLD: {n: t.detach().cpu().clone() for n, t in zip(named, self._sets[OLD], strict=True)},
            EMA: {n: t.cpu().clone() for n, t in zip(named, self.ema, strict=True)},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Check every name and shape first, then copy (a mismatched checkpoint changes nothing)."""
        groups = ((TRAIN, self._sets[TRAIN]), (OLD, self._sets[OLD]), (EMA, self.ema))
        for key, tensors in groups:
            got = state.get(key)
            if got is None or set(got) != set(self._names):
                have = set(got or {})
                missing, extra = sorted(set(self._names) - have), sorted(have - set(self._names))
                raise ValueError(
                    f"checkpoint's {key} weights do not match the transformer's parameters: missing {missing[:3]}, "
                    f"unexpected {extra[:3]} (was it written by a LoRA run, train_mode=lora, or another model?)"
                )
            for n, t in zip(self._names, tensors, strict=True):
                if got[n].shape != t.shape:
                    raise ValueError(f"checkpoint's {key} {n} has shape {tuple(got[n].shape)}, the model "
                                     f"{tuple(t.shape)}")  # fmt: skip
        for key, tensors in groups:
            for n, t in zip(self._names, tensors, strict=True):
                t.copy_(state[key][n])


TrainedWeights = LoraAdapters | FullWeights  # what a run trains (train_mode lora or full), one interface
