"""Kernel ops behind one dispatch seam (reference | triton | cuda | cutlass, see `dispatch`).

Imports quant/, solrl_triton (the triton_kernels/ folder) and the extension, nothing above it.
"""

from solrl_engine.kernels.dispatch import (
    BACKENDS,
    Run,
    backend_report,
    choose,
    device_capability,
    gpu_like,
    requested_backend,
    runs,
    select,
    simulated_capability,
)
from solrl_engine.kernels.linear import fp8_linear, int8_linear, nvfp4_linear
from solrl_engine.kernels.ops import (
    fp8_quantize_rowwise,
    int8_quantize_rowwise,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
    nvfp4_quantize_into_,
)

__all__ = [
    "BACKENDS",
    "Run",
    "backend_report",
    "choose",
    "device_capability",
    "gpu_like",
    "requested_backend",
    "runs",
    "select",
    "simulated_capability",
    "fp8_linear",
    "fp8_quantize_rowwise",
    "int8_linear",
    "int8_quantize_rowwise",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "nvfp4_linear",
    "nvfp4_quantize",
    "nvfp4_quantize_into_",
]
