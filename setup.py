"""Build script: the Python packages always; the CUDA extension (solrl_engine._C) only when a CUDA
PyTorch and nvcc are present. Metadata lives in pyproject.toml.
"""

import shutil

from setuptools import setup


def _cuda_extension_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "PyTorch is not importable while building (use --no-build-isolation to build the extension)"
    if torch.version.cuda is None:
        return "this PyTorch is a CPU build"
    if shutil.which("nvcc") is None:
        return "nvcc was not found on PATH"
    return None


def _ext_modules() -> list:
    reason = _cuda_extension_skip_reason()
    if reason is None:
        # csrc/ has no runtime kernels yet (the quantize and GEMM kernels come with the speed work);
        # CMakeLists.txt already compile-checks whatever .cu files it holds.
        reason = "csrc/ holds no extension kernels yet"
    print(f"solrl-engine: skipping the CUDA extension: {reason}.")
    return []


setup(ext_modules=_ext_modules())
