"""Each format's part in nn/: how a QuantLinear stores a weight in it (its buffers), writes one into them
(quantize-into, in place: compiled and captured graphs keep pointing at the same storage), decodes it for
inspection, and runs the linear. One module per format, each declaring `HANDLER`; QuantLinear delegates to its
recipe's format's handler instead of switching on names.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from solrl_engine.quant.formats import gather


class LinearFormat:
    """The base of a format's handler: the methods a QuantLinear delegates to (each takes the layer)."""

    format: str = ""

    def buffers(self, layer: nn.Module, device: torch.device | str | None) -> None:
        """Register the layer's weight buffers (zeros) for its in_features x out_features and recipe."""
        raise NotImplementedError

    def set_weight_(self, layer: nn.Module, w: torch.Tensor) -> None:
        """Write weight `w` ([out, in], on the layer's device) into the layer's buffers, in place."""
        raise NotImplementedError

    def stored(self, layer: nn.Module) -> object:
        """The layer's weight as its format's tensor (NVFP4Tensor, FP8Tensor, ...): views of its buffers."""
        raise NotImplementedError

    def weight(self, layer: nn.Module) -> torch.Tensor:
        """The stored weight decoded to FP32, in the layer's own basis."""
        raise NotImplementedError

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype, xq: Any = None
               ) -> torch.Tensor:  # fmt: skip
        """y = x W^T + b through `backend` (the layer's choice), as `out`. `x` arrives in its own dtype when the
        recipe quantizes activations, else already cast to the compute dtype. `xq`: x's row-wise codes made by its
        producer (nn.producers; only for a format with a row-wise activation quantize), None otherwise."""
        raise NotImplementedError


class RowScaledLinear(LinearFormat):
    """The storage of the 8-bit formats: codes [out, in] in `codes` (a buffer of dtype `code_dtype`) and one FP32
    scale per output channel (`w_scale`), written by the format's row-wise quantize; a subclass names them and
    runs its own GEMM."""

    codes: str = ""
    code_dtype: torch.dtype = torch.int8
    tensor_cls: type = object

    def quantize_rowwise(self, w: torch.Tensor) -> Any:
        raise NotImplementedError

    def produced(self, codes: torch.Tensor, scale: torch.Tensor) -> Any:
        """A producer's codes and scales of a layer's input as this format's tensor (what its GEMM takes)."""
        return self.tensor_cls(codes, scale, torch.float32)

    def buffers(self, layer: nn.Module, device: torch.device | str | None) -> None:
        o, i = layer.out_features, layer.in_features
        layer.register_buffer(self.codes, torch.zeros(o, i, dtype=self.code_dtype, device=device))
        layer.register_buffer("w_scale", torch.ones(o, 1, dtype=torch.float32, device=device))

    def stored(self, layer: nn.Module) -> Any:
        return self.tensor_cls(getattr(layer, self.codes), layer.w_scale, torch.float32)

    def set_weight_(self, layer: nn.Module, w: torch.Tensor) -> None:
        q = self.quantize_rowwise(w)
        getattr(layer, self.codes).copy_(q.data)
        layer.w_scale.copy_(q.scale)

    def weight(self, layer: nn.Module) -> torch.Tensor:
        return self.stored(layer).dequantize(torch.float32)


@functools.cache
def _handlers() -> dict[str, LinearFormat]:
    return gather("solrl_engine.nn.formats", "HANDLER")


def handlers() -> dict[str, LinearFormat]:
    """Format name -> its nn handler (nn/formats/<fmt>.py's HANDLER)."""
    return dict(_handlers())


def handler(fmt: str) -> LinearFormat:
    """The handler of format `fmt`; a clear error when no nn/formats module declares one."""
    table = _handlers()
    if fmt not in table:
        raise ValueError(f"format {fmt!r} has no nn handler (nn/formats/{fmt}.py); formats with one: {tuple(table)}")
    return table[fmt]
