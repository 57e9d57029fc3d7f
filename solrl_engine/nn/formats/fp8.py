"""FP8 E4M3 in a QuantLinear: codes [out, in] and one FP32 scale per output channel (row-wise, W8A8 or W8A16)."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.nn.formats import LinearFormat
from solrl_engine.quant.fp8 import FP8Tensor


class FP8Linear(LinearFormat):
    format = "fp8"

    def buffers(self, layer: nn.Module, device: torch.device | str | None) -> None:
        o, i = layer.out_features, layer.in_features
        layer.register_buffer("w_data", torch.zeros(o, i, dtype=torch.float8_e4m3fn, device=device))
        layer.register_buffer("w_scale", torch.ones(o, 1, dtype=torch.float32, device=device))

    def stored(self, layer: nn.Module) -> FP8Tensor:
        return FP8Tensor(layer.w_data, layer.w_scale, torch.float32)

    def set_weight_(self, layer: nn.Module, w: torch.Tensor) -> None:
        q = kernels.fp8_quantize_rowwise(w)
        layer.w_data.copy_(q.data)
        layer.w_scale.copy_(q.scale)

    def weight(self, layer: nn.Module) -> torch.Tensor:
        return self.stored(layer).dequantize(torch.float32)

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype) -> torch.Tensor:
        act = layer.recipe.quantize_activations
        return kernels.fp8_linear(x, self.stored(layer), layer.bias, act, backend, out, layer.kernel_tag)


HANDLER = FP8Linear()
