"""Formats as handlers: one name per number format keys its part in each layer that knows about it.

Each layer holds its part of a format in the format's own module and declares it under one attribute:
quant/<fmt>.py `NUMERICS` (this file's `Numerics`: what the format is), kernels/<fmt>.py `KERNELS` (its ops and
tensor-core row), nn/formats/<fmt>.py `HANDLER` (its buffers, quantize-into and linear), models/formats/<fmt>.py
`RULE` (the explore copy's default layer rule). `gather` finds them by importing the layer's modules, so every
table of formats derives from these parts, and adding a format adds its modules and tests, nothing else.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Numerics:
    """What a number format is, for the layers that choose between formats.

    name: the one name every layer keys this format by ("fp8").
    label: how messages name it ("FP8 E4M3").
    bits: bits per stored weight element; `stored_bytes` counts the exact storage (scales included).
    quantized: False for the policy's own precision (BF16): a copy in it is a full-precision copy.
    weight_only: whether a weight-only recipe (`<name>_weight_only`: activations left in BF16) exists.
    k_multiple: in_features must be a multiple of this (NVFP4's 16-element blocks); other layers stay BF16.
    options: the QuantRecipe fields that apply to this format only (NVFP4's rht, four_over_six, lowrank).
    recipes: named recipes beyond `<name>` and `<name>_weight_only`: name -> QuantRecipe changes.
    stored_bytes: (in_features, out_features) -> bytes of a weight stored in this format, scales included.
    attention: the emulated rounding of attention's q, k and v for `explore_attention=<name>` ((q, k, v), each
        [..., tokens, head_dim] -> the three as attention then uses them), None where the format has none.
    rowwise: the per-row quantize of this format's activations (x [..., K] -> codes and [..., 1] scales, as its
        linears quantize their input), None where its linears take no row-wise codes: what a producer emits
        for them (quant.producers).
    """

    name: str
    label: str
    bits: int
    stored_bytes: Callable[[int, int], int]
    quantized: bool = True
    weight_only: bool = True
    k_multiple: int = 1
    options: tuple[str, ...] = ()
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    rowwise: Callable[[torch.Tensor], Any] | None = None

    @property
    def recipe_names(self) -> tuple[str, ...]:
        """Every named recipe of this format: `<name>`, `<name>_weight_only` where allowed, then the extra ones."""
        if not self.quantized:
            return (self.name,)
        return (self.name, *((f"{self.name}_weight_only",) if self.weight_only else ()), *self.recipes)


def gather(package: str, attr: str) -> dict[str, Any]:
    """Format name -> the `attr` part that the modules of `package` declare (each part carries its format's name
    as `.format`, a Numerics as `.name`). Public modules only; a format declared twice is an error."""
    pkg = importlib.import_module(package)
    out: dict[str, Any] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        part = getattr(importlib.import_module(f"{package}.{info.name}"), attr, None)
        if part is None:
            continue
        key = getattr(part, "format", None) or part.name
        if key in out:
            raise RuntimeError(f"format {key!r} declares its {attr} twice in {package}")
        out[key] = part
    return out


@functools.cache
def _numerics() -> dict[str, Numerics]:
    got = gather("solrl_engine.quant", "NUMERICS")
    return dict(sorted(got.items(), key=lambda kv: (kv[1].bits, kv[0])))  # fewest bits first, then by name


def all_numerics() -> dict[str, Numerics]:
    """Every format's Numerics, name -> Numerics, fewest bits first."""
    return dict(_numerics())


def numerics(name: str) -> Numerics:
    """The Numerics of format `name`; a clear error naming the formats otherwise."""
    table = _numerics()
    if name not in table:
        raise ValueError(f"unknown quantization format {name!r}; choose one of {tuple(table)}.")
    return table[name]


def format_names() -> tuple[str, ...]:
    """The formats' names, fewest bits first ("nvfp4", "fp8", "int8", "bf16")."""
    return tuple(_numerics())


def rowwise_formats() -> tuple[str, ...]:
    """The formats whose linears take row-wise activation codes a producer can emit (`Numerics.rowwise`)."""
    return tuple(n for n, f in _numerics().items() if f.rowwise is not None)


def attention_formats() -> tuple[str, ...]:
    """What `explore_attention` may say: "bf16" (as the policy) and every format with an attention rounding."""
    return ("bf16", *(n for n, f in _numerics().items() if f.attention is not None))
