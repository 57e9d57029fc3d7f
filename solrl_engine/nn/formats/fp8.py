"""FP8 E4M3 in a QuantLinear: codes [out, in] and one FP32 scale per output channel (row-wise, W8A8 or W8A16)."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.nn.formats import RowScaledLinear
from solrl_engine.quant.fp8 import FP8Tensor


class FP8Linear(RowScaledLinear):
    format = "fp8"
    codes, code_dtype, tensor_cls = "w_data", torch.float8_e4m3fn, FP8Tensor

    def quantize_rowwise(self, w: torch.Tensor) -> FP8Tensor:
        return kernels.fp8_quantize_rowwise(w)

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype, xq: FP8Tensor | None = None
               ) -> torch.Tensor:  # fmt: skip
        act = layer.recipe.quantize_activations
        return kernels.fp8_linear(x, self.stored(layer), layer.bias, act, backend, out, layer.kernel_tag, xq)


HANDLER = FP8Linear()
