"""INT8 in a QuantLinear: symmetric codes [out, in] and one FP32 scale per output channel (W8A8 only)."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.nn.formats import RowScaledLinear
from solrl_engine.quant.int8 import Int8Tensor


class Int8Linear(RowScaledLinear):
    format = "int8"
    codes, code_dtype, tensor_cls = "w_int8", torch.int8, Int8Tensor

    def quantize_rowwise(self, w: torch.Tensor) -> Int8Tensor:
        return kernels.int8_quantize_rowwise(w)

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype, xq: Int8Tensor | None = None
               ) -> torch.Tensor:  # fmt: skip
        return kernels.int8_linear(x, self.stored(layer), layer.bias, backend, out, layer.kernel_tag, xq)


HANDLER = Int8Linear()
