"""Linear-layer FLOPs of one forward, counted by hooks: which share of a denoiser's GEMM work a
quantized copy runs in low precision, and what that bounds its speedup to (`amdahl_bound`).

Counting by hooks, not by formula, gets every model right without knowing it: SD3's joint blocks run
their context projections over the text tokens only, FLUX's single blocks over text + image tokens,
SANA's 1x1 convolutions over every pixel of the latent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from solrl_engine.nn.quant_linear import QuantConv1x1, QuantLinear
from solrl_engine.nn.quantize import is_conv1x1
from solrl_engine.quant.formats import numerics


@dataclass
class LinearFlops:
    """FLOPs (2 x rows x in x out) of each linear layer in one forward, and in which format it ran."""

    layers: dict[str, int] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)  # "nvfp4", "nvfp4_weight_only", "fp8", ..., "high"

    @property
    def total(self) -> int:
        return sum(self.layers.values())

    def share(self, fmt: str = "nvfp4") -> float:
        """The share of all linear FLOPs that ran in `fmt` (0 when nothing ran)."""
        tot = self.total
        return sum(f for n, f in self.layers.items() if self.formats[n] == fmt) / tot if tot else 0.0

    def quantized_share(self) -> float:
        """The share of all linear FLOPs that ran in any quantized format (NVFP4, FP8 or INT8)."""
        tot = self.total
        return sum(f for n, f in self.layers.items() if self.formats[n] != "high") / tot if tot else 0.0

    def by_group(self) -> dict[str, int]:
        """FLOPs per layer group (`group_name`: the layer's name with its block index as *)."""
        out: dict[str, int] = {}
        for n, f in self.layers.items():
            g = group_name(n)
            out[g] = out.get(g, 0) + f
        return out


def group_name(name: str) -> str:
    """`transformer_blocks.3.ff.net.0.proj` -> `transformer_blocks.*.ff.net.0.proj`: the same layer of
    every block (only the block index becomes *; `net.0` and `net.2` stay apart), the unit a layer
    rule names: an fnmatch pattern matching exactly those layers."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            parts[i] = "*"
            break
    return ".".join(parts)


def _layer_format(m: nn.Module) -> str:
    if isinstance(m, QuantLinear):
        return m.recipe.name.split("+")[0] if numerics(m.recipe.format).quantized else "high"
    return "high"


def count_linear_flops(model: nn.Module, run: Callable[[], object]) -> LinearFlops:
    """Run `run()` (one forward of `model`, or anything that calls it) with hooks on every
    nn.Linear, QuantLinear and 1x1 convolution of `model`, and return each one's FLOPs."""
    out = LinearFlops()
    handles = []

    def hook(name: str, m: nn.Module, in_f: int, out_f: int, conv: bool) -> Callable:
        def fn(_m: nn.Module, inp: tuple[torch.Tensor, ...], _out: object) -> None:
            x = inp[0]
            rows = x.numel() // (x.shape[1] if conv and x.dim() == 4 else x.shape[-1])
            out.layers[name] = out.layers.get(name, 0) + 2 * rows * in_f * out_f
            out.formats[name] = _layer_format(m)

        return fn

    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            conv = isinstance(m, QuantConv1x1)
            handles.append(m.register_forward_hook(hook(name, m, m.in_features, m.out_features, conv)))
        elif type(m) is nn.Linear:
            handles.append(m.register_forward_hook(hook(name, m, m.in_features, m.out_features, False)))
        elif is_conv1x1(m):
            handles.append(m.register_forward_hook(hook(name, m, m.in_channels, m.out_channels, True)))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return out


def amdahl_bound(share: float, gemm_speedup: float) -> float:
    """The most a forward can gain when `share` of its GEMM FLOPs run `gemm_speedup` times faster and
    everything else (the other GEMMs, attention, norms) takes no time: 1 / ((1 - s) + s / r)."""
    if not 0.0 <= share <= 1.0 or gemm_speedup <= 0:
        raise ValueError(f"need 0 <= share <= 1 and gemm_speedup > 0; got {share}, {gemm_speedup}")
    return 1.0 / ((1.0 - share) + share / gemm_speedup)
