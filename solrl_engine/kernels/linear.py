"""The quantized linears by their former address: each format's GEMM now lives in its own module
(kernels.nvfp4, kernels.fp8, kernels.int8; shared glue in kernels._gemm). Kept so that
`solrl_engine.kernels.linear.<name>` still imports; new code imports from `solrl_engine.kernels`."""

from __future__ import annotations

from typing import Any

from solrl_engine.kernels import _gemm
from solrl_engine.kernels._gemm import PASSED_OVER_HINT, WEIGHT_ONLY_HINT, set_trace_quantize, traced
from solrl_engine.kernels.fp8 import fp8_linear, traced_fp8_linear
from solrl_engine.kernels.int8 import MIN_INT_MM_ROWS, int8_linear, traced_int8_linear
from solrl_engine.kernels.nvfp4 import (
    nvfp4_activation_operands,
    nvfp4_linear,
    scaled_mm_fp4_operands,
    traced_nvfp4_linear,
)

__all__ = [
    "MIN_INT_MM_ROWS",
    "PASSED_OVER_HINT",
    "WEIGHT_ONLY_HINT",
    "fp8_linear",
    "int8_linear",
    "nvfp4_activation_operands",
    "nvfp4_linear",
    "scaled_mm_fp4_operands",
    "set_trace_quantize",
    "traced",
    "traced_fp8_linear",
    "traced_int8_linear",
    "traced_nvfp4_linear",
]


def __getattr__(name: str) -> Any:
    """TRACE_QUANTIZE read live from its one home (a copy here would go stale after set_trace_quantize)."""
    if name == "TRACE_QUANTIZE":
        return _gemm.TRACE_QUANTIZE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
