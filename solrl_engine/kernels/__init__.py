"""Kernel ops behind one dispatch seam (reference | triton | cuda | cutlass, see `dispatch`), and one
capability table (`capability`) that they read.

Imports quant/, solrl_triton (the triton_kernels/ folder) and the extension, nothing above it.
"""

from solrl_engine.kernels.capability import (
    TENSOR_CORES,
    TensorCores,
    device_capability,
    formats_with_tensor_cores,
    gpu_like,
    hardware_plan,
    simulated_capability,
    tensor_cores,
)
from solrl_engine.kernels.dispatch import (
    BACKENDS,
    Run,
    backend_report,
    choose,
    requested_backend,
    runs,
    select,
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
    "TENSOR_CORES",
    "TensorCores",
    "backend_report",
    "choose",
    "device_capability",
    "formats_with_tensor_cores",
    "gpu_like",
    "hardware_plan",
    "requested_backend",
    "runs",
    "select",
    "simulated_capability",
    "tensor_cores",
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
