"""What a device can run fast: its compute capability (real, or simulated on a CPU) and THE tensor-core table.

The table is the one statement of which low-precision GEMM formats have tensor cores from which compute
capability; the kernels' availability checks and the explore precision's hardware plan both read it, so
they cannot disagree. `SOLRL_SIMULATE_SM=90` (a test switch) makes the CPU count as a GPU of that compute
capability wherever the fast op has a CPU implementation (`torch._scaled_mm`, `torch._int_mm`, Triton
under TRITON_INTERPRET=1): the GPU's choices and paths then run, and are checked, on a CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SIM_ENV = "SOLRL_SIMULATE_SM"


def simulated_capability() -> tuple[int, int] | None:
    """The compute capability SOLRL_SIMULATE_SM gives the CPU ("90" -> (9, 0)), or None when unset."""
    v = os.environ.get(SIM_ENV, "").strip().lower().removeprefix("sm_").removeprefix("sm")
    if not v:
        return None
    if not v.isdigit() or len(v) < 2:
        raise ValueError(f"{SIM_ENV}={v!r} is not a compute capability; write e.g. 80, 90 or 100 (or unset it).")
    return int(v[:-1]), int(v[-1])


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """A CUDA device's compute capability; the simulated one for a CPU under SOLRL_SIMULATE_SM; else None."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)
    if device.type == "cpu":
        return simulated_capability()
    return None


def gpu_like(device: torch.device | str) -> bool:
    """Whether dispatch treats `device` as a GPU: a CUDA device, or the CPU under SOLRL_SIMULATE_SM."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and simulated_capability() is not None)


@dataclass(frozen=True)
class TensorCores:
    """One format's tensor cores: `label` as messages name them, the compute capability they need, whether
    the fast GEMM also has a CPU implementation (so a CPU under SOLRL_SIMULATE_SM runs it), and the nominal
    GEMM throughput over BF16 on those tensor cores (an upper bound for a speedup, not a measurement)."""

    label: str
    needs: tuple[int, int]
    cpu_op: bool
    nominal_speedup: float


# Fastest first: the hardware plan takes the first format a device has. cuBLASLt's FP4 _scaled_mm has no
# CPU implementation; torch._scaled_mm runs row-wise FP8 and torch._int_mm INT8 on a CPU too.
TENSOR_CORES: dict[str, TensorCores] = {
    "nvfp4": TensorCores("FP4", (10, 0), cpu_op=False, nominal_speedup=4.0),
    "fp8": TensorCores("FP8", (8, 9), cpu_op=True, nominal_speedup=2.0),
    "int8": TensorCores("INT8", (8, 0), cpu_op=True, nominal_speedup=2.0),
}


def tensor_cores(device: torch.device | str, fmt: str) -> str | None:
    """None when `device` has `fmt`'s tensor cores (a TENSOR_CORES key), else why not. A CPU under
    SOLRL_SIMULATE_SM counts as that GPU where the format's fast GEMM has a CPU implementation."""
    device, tc = torch.device(device), TENSOR_CORES[fmt]
    cap = device_capability(device)
    if cap is None or (device.type != "cuda" and not tc.cpu_op):
        where = device.type if cap is None else f"{device.type} (simulated sm_{cap[0]}{cap[1]}: no CPU implementation)"
        return f"{tc.label} tensor-core GEMMs run on CUDA devices, not {where}"
    if cap < tc.needs:
        return f"sm_{cap[0]}{cap[1]} has no {tc.label} tensor cores (needs sm_{tc.needs[0]}{tc.needs[1]}+)"
    return None


def formats_with_tensor_cores(capability: tuple[int, int] | None) -> tuple[str, ...]:
    """The formats whose tensor cores a device of this compute capability has, fastest first (none for None)."""
    if capability is None:
        return ()
    return tuple(fmt for fmt, tc in TENSOR_CORES.items() if capability >= tc.needs)


def fastest_format(capability: tuple[int, int] | None) -> str:
    """The explore format the hardware plan gives a device: its fastest tensor-core format (NVFP4 on sm_100+,
    FP8 on sm_89+, INT8 on sm_80+), else emulated NVFP4 (a CPU included: a fidelity study's proxy)."""
    return next(iter(formats_with_tensor_cores(capability)), "nvfp4")
