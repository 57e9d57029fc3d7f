"""BF16 in a QuantLinear: the weight as it is (a full-precision copy's layers), run by torch's own linear."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine.nn.formats import LinearFormat


class BF16Linear(LinearFormat):
    format = "bf16"

    def buffers(self, layer: nn.Module, device: torch.device | str | None) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.register_buffer("w_bf16", torch.zeros(shape, dtype=torch.bfloat16, device=device))

    def set_weight_(self, layer: nn.Module, w: torch.Tensor) -> None:
        layer.w_bf16.copy_(w)

    def stored(self, layer: nn.Module) -> torch.Tensor:
        return layer.w_bf16

    def weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.w_bf16.float()

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype) -> torch.Tensor:
        b = None if layer.bias is None else layer.bias.to(out)
        return nn.functional.linear(x, layer.w_bf16.to(out), b)


HANDLER = BF16Linear()
