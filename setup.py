"""Build script: the Python packages always; the CUDA extension (solrl_engine._C) only when a CUDA
PyTorch and nvcc are present, built through CMakeLists.txt. Metadata lives in pyproject.toml.

Build the extension on a GPU machine with:  pip install --no-build-isolation -e ".[cutlass]"
(--no-build-isolation so the build sees the installed CUDA PyTorch and the CUTLASS headers).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _cuda_extension_skip_reason() -> str | None:
    if os.environ.get("SOLRL_SKIP_EXTENSION"):
        return "SOLRL_SKIP_EXTENSION is set"
    try:
        import torch
    except ImportError:
        return "PyTorch is not importable while building (use --no-build-isolation to build the extension)"
    if torch.version.cuda is None:
        return "this PyTorch is a CPU build"
    if shutil.which("nvcc") is None:
        return "nvcc was not found on PATH"
    if shutil.which("cmake") is None:
        return "cmake was not found on PATH"
    return None


class CMakeBuild(build_ext):
    """Configure and build CMakeLists.txt's _C target into the package directory."""

    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        jobs = str(os.cpu_count() or 2)
        # torch's CMake adds gencode flags for TORCH_CUDA_ARCH_LIST (by default: this machine's
        # GPU); pin it to an arch the target already has so builds do not depend on the machine.
        env = {**os.environ, "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0")}
        subprocess.check_call(
            [
                "cmake", "-S", str(ROOT), "-B", str(build_dir), "-DSOLRL_BUILD_EXTENSION=ON",
                "-DCMAKE_BUILD_TYPE=Release", f"-DPython3_EXECUTABLE={sys.executable}",
                f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            ],
            env=env,
        )  # fmt: skip
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs], env=env)


def _ext_modules() -> list[Extension]:
    reason = _cuda_extension_skip_reason()
    if reason is not None:
        print(f"solrl-engine: skipping the CUDA extension: {reason}.")
        return []
    return [Extension("solrl_engine._C", sources=[])]


# The repository's triton_kernels/ folder installs as `solrl_triton`: the Triton project ships a
# `triton_kernels` package (vLLM and SGLang import it), and installing both would shadow one.
setup(
    packages=find_packages(include=["solrl_engine*"]) + ["solrl_triton"],
    package_dir={"solrl_triton": "triton_kernels"},
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": CMakeBuild},
)
