"""What a device can run fast: its compute capability (real, or simulated on a CPU) and THE tensor-core table.

Each format's kernel module declares its part (`KERNELS = FormatKernels(...)`: its tensor-core row and its GEMM
op); the table is gathered from those parts, the one statement of which low-precision GEMM formats have tensor
cores from which compute capability. The kernels' availability checks and the explore precision's hardware plan
both read it, so they cannot disagree. `SOLRL_SIMULATE_SM=90` (a test switch) makes the CPU count as a GPU of that
compute capability wherever the fast op has a CPU implementation (`torch._scaled_mm`, `torch._int_mm`, Triton
under TRITON_INTERPRET=1): the GPU's choices and paths then run, and are checked, on a CPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from solrl_engine.quant.formats import gather

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


@dataclass(frozen=True)
class FormatKernels:
    """A format's part in kernels/: its tensor cores (None for the policy's BF16, which has no separate row), the
    dispatch op its linear layers choose an implementation of (`dispatch.choose`; None: torch's own linear), its
    attention op (`explore_attention=<format>`; None: the attention rounding is emulated), and where a GPU runs its
    linear fast when that is not where its tensor cores start (NVFP4: Triton's in-kernel decode on Ada and Hopper)."""

    format: str
    tensor_cores: TensorCores | None
    linear_op: str | None
    attention_op: str | None = None
    # the compute capability from which a GPU runs this format's linear fast (a GPU implementation, not the
    # reference): its tensor cores' by default; None: every GPU (BF16)
    runs_from: tuple[int, int] | None = None

    @property
    def fast_from(self) -> tuple[int, int] | None:
        """Where a GPU runs the format's linear fast: `runs_from`, else its tensor cores' capability."""
        return self.runs_from or (self.tensor_cores.needs if self.tensor_cores else None)


@functools.cache
def format_kernels() -> dict[str, FormatKernels]:
    """Format name -> its kernels part (kernels/<fmt>.py's KERNELS)."""
    return gather("solrl_engine.kernels", "KERNELS")


# Format -> its tensor cores, fastest first: filled from the parts once (tensor_core_table), when
# solrl_engine.kernels finishes importing; a plain dict, so a layer's kernel choice traced by torch.compile reads it
# without calling into the gathering (an import inside a compiled region is a graph break).
_TABLE: dict[str, TensorCores] = {}


def tensor_core_table() -> dict[str, TensorCores]:
    """Format -> its tensor cores, fastest first (the hardware plan takes the first a device has): most nominal
    throughput, then the newest architecture. cuBLASLt's FP4 _scaled_mm has no CPU implementation;
    torch._scaled_mm runs row-wise FP8 and torch._int_mm INT8 on a CPU too."""
    if not _TABLE:
        rows = {f: k.tensor_cores for f, k in format_kernels().items() if k.tensor_cores is not None}
        _TABLE.update(sorted(rows.items(), key=lambda kv: (-kv[1].nominal_speedup, tuple(-v for v in kv[1].needs))))
    return _TABLE


def tensor_cores(device: torch.device | str, fmt: str) -> str | None:
    """None when `device` has `fmt`'s tensor cores (a tensor_core_table() key), else why not. A CPU under
    SOLRL_SIMULATE_SM counts as that GPU where the format's fast GEMM has a CPU implementation."""
    device, tc = torch.device(device), tensor_core_table()[fmt]
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
    return tuple(fmt for fmt, tc in tensor_core_table().items() if capability >= tc.needs)


def fastest_format(capability: tuple[int, int] | None) -> str:
    """The explore format the hardware plan gives a device: its fastest tensor-core format (NVFP4 on sm_100+,
    FP8 on sm_89+, INT8 on sm_80+), else emulated NVFP4 (a CPU included: a fidelity study's proxy)."""
    return next(iter(formats_with_tensor_cores(capability)), "nvfp4")
