"""Kernel ops behind one dispatch seam (reference | triton | cuda | cutlass, see `dispatch`), one module
per format (`nvfp4`, `fp8`, `int8`), and one capability table (`capability`) that they read.

Imports quant/, solrl_triton (the triton_kernels/ folder) and the extension, nothing above it.
"""

from solrl_engine.kernels._gemm import set_trace_quantize
from solrl_engine.kernels.capability import (
    FormatKernels,
    TensorCores,
    device_capability,
    fastest_format,
    format_kernels,
    formats_with_tensor_cores,
    gpu_like,
    simulated_capability,
    tensor_core_table,
    tensor_cores,
)
from solrl_engine.kernels.dispatch import (
    BACKENDS,
    Run,
    backend_report,
    choose,
    forget_run,
    requested_backend,
    runs,
    select,
)
from solrl_engine.kernels.fp8 import fp8_linear, fp8_quantize_rowwise
from solrl_engine.kernels.int8 import int8_linear, int8_quantize_rowwise
from solrl_engine.kernels.nvfp4 import (
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_linear,
    nvfp4_quantize,
    nvfp4_quantize_into_,
)
from solrl_engine.kernels.producers import adaln_quantize, gelu_quantize, glu_quantize, rms_quantize

# format -> its tensor cores, fastest first: gathered from each format module's KERNELS (capability)
TENSOR_CORES = tensor_core_table()

__all__ = [
    "BACKENDS",
    "Run",
    "TENSOR_CORES",
    "FormatKernels",
    "TensorCores",
    "format_kernels",
    "tensor_core_table",
    "backend_report",
    "choose",
    "device_capability",
    "formats_with_tensor_cores",
    "gpu_like",
    "fastest_format",
    "forget_run",
    "requested_backend",
    "runs",
    "select",
    "set_trace_quantize",
    "simulated_capability",
    "tensor_cores",
    "fp8_linear",
    "fp8_quantize_rowwise",
    "int8_linear",
    "int8_quantize_rowwise",
    "adaln_quantize",
    "gelu_quantize",
    "glu_quantize",
    "rms_quantize",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "nvfp4_linear",
    "nvfp4_quantize",
    "nvfp4_quantize_into_",
]
