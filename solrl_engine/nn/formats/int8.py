"""INT8 in a QuantLinear: symmetric codes [out, in] and one FP32 scale per output channel (W8A8 only)."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.nn.formats import LinearFormat
from solrl_engine.quant.int8 import Int8Tensor


class Int8Linear(LinearFormat):
    format = "int8"

    def buffers(self, layer: nn.Module, device: torch.device | str | None) -> None:
        o, i = layer.out_features, layer.in_features
        layer.register_buffer("w_int8", torch.zeros(o, i, dtype=torch.int8, device=device))
        layer.register_buffer("w_scale", torch.ones(o, 1, dtype=torch.float32, device=device))

    def stored(self, layer: nn.Module) -> Int8Tensor:
        return Int8Tensor(layer.w_int8, layer.w_scale, torch.float32)

    def set_weight_(self, layer: nn.Module, w: torch.Tensor) -> None:
        q = kernels.int8_quantize_rowwise(w)
        layer.w_int8.copy_(q.data)
        layer.w_scale.copy_(q.scale)

    def weight(self, layer: nn.Module) -> torch.Tensor:
        return self.stored(layer).dequantize(torch.float32)

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype) -> torch.Tensor:
        return kernels.int8_linear(x, self.stored(layer), layer.bias, backend, out, layer.kernel_tag)


HANDLER = Int8Linear()
