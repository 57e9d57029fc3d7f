"""What this machine computes fast, and the run-time choices that follow from it: the device, the policy's
dtype, autocast, and whether inductor can compile on the CPU.

Why: the CPU quickstart should not train in FP32 on a CPU with BF16 units (AVX512-BF16, AMX-BF16), and
should not try inductor without a C++ compiler. Every decision here takes its facts as arguments (CPU
flags, torch's CPU capability), so each branch is testable on any machine; the defaults read them from
this one. A leaf: it imports nothing else of the engine (which explore precision is timed and chosen is
solrl_engine.explore.choice).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

# --- BF16 on the CPU --------------------------------------------------------------------------------


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo `flags`; empty where there is no such file)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, val = line.partition(":")
        if key.strip() == "flags":
            return frozenset(val.split())
    return frozenset()


@dataclass(frozen=True)
class CpuBF16:
    """Whether BF16 matmuls run natively on this CPU (`unit`: "AMX-BF16", "AVX512-BF16" or ""), and why."""

    native: bool
    unit: str
    reason: str


def cpu_bf16(
    flags: Iterable[str] | None = None,
    capability: str | None = None,
    machine: str | None = None,
    onednn: bool | None = None,
) -> CpuBF16:
    """Detect native BF16 on an x86 CPU: the avx512_bf16 / amx_bf16 flags, torch dispatching its
    AVX512 kernels (`torch.backends.cpu.get_cpu_capability()`; ATEN_CPU_CAPABILITY can lower it) and
    oneDNN (which runs the BF16 GEMMs). Without all three, BF16 is emulated and slower than FP32."""
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "x86", "i686"):
        return CpuBF16(False, "", f"{machine} CPU: native BF16 is detected on x86 only (AVX512-BF16, AMX-BF16)")
    fl = cpu_flags() if flags is None else frozenset(flags)
    cap = capability if capability is not None else torch.backends.cpu.get_cpu_capability()
    onednn = torch.backends.mkldnn.is_available() if onednn is None else onednn
    unit, flag = ("AMX-BF16", "amx_bf16") if "amx_bf16" in fl else ("AVX512-BF16", "avx512_bf16")
    if flag not in fl:
        return CpuBF16(False, "", "this CPU has neither AVX512-BF16 nor AMX-BF16 (no avx512_bf16 or amx_bf16 flag): "
                                  "BF16 would be emulated, slower than FP32")  # fmt: skip
    if "AVX512" not in cap.upper() and "AMX" not in cap.upper():
        return CpuBF16(False, unit, f"the CPU has {unit} but torch runs its {cap} kernels (ATEN_CPU_CAPABILITY?), "
                                    "where BF16 conversions are slow")  # fmt: skip
    if not onednn:
        return CpuBF16(False, unit, f"the CPU has {unit} but this torch has no oneDNN, which runs the BF16 GEMMs")
    return CpuBF16(True, unit, f"this CPU has {unit} ({flag}) and torch runs its {cap} kernels with oneDNN")


def auto_policy_dtype(device: torch.device | str, bf16: CpuBF16 | None = None) -> tuple[torch.dtype, str]:
    """policy_dtype=auto: BF16 on CUDA and on CPUs with BF16 units, FP32 elsewhere; and why.
    Either way LoRA weights and optimizer state stay FP32 (the trainer casts them)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16, "CUDA device: BF16 tensor cores"
    info = bf16 if bf16 is not None else cpu_bf16()
    if info.native:
        return torch.bfloat16, info.reason
    return torch.float32, info.reason


# --- torch.compile on the CPU -----------------------------------------------------------------------


def cxx_compiler(env: Mapping[str, str] | None = None, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The C++ compiler inductor's CPU backend would call ($CXX, else g++, clang++ or c++), or None."""
    env = os.environ if env is None else env
    for name in ([env["CXX"]] if env.get("CXX") else []) + ["g++", "clang++", "c++"]:
        path = which(name)
        if path:
            return path
    return None


def cpu_compile_available(compiler: str | None = "") -> tuple[bool, str]:
    """Whether torch.compile (inductor) can run on the CPU here, and why not when it cannot.
    `compiler` "" looks one up; None means there is none."""
    cxx = cxx_compiler() if compiler == "" else compiler
    if cxx is None:
        return False, "inductor needs a C++ compiler on the CPU and none was found (set CXX, or install g++)"
    return True, f"inductor with {cxx}"


# --- the run's device, policy dtype and autocast ---------------------------------------------------------


def host_memory_available_gib(meminfo: str | None = None) -> float | None:
    """The host memory the kernel says can be had without swapping (/proc/meminfo's MemAvailable), in GiB; None where
    it does not say (not Linux). A staged start-up loads the base there on every rank of a node at once."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20  # kB
    return None


def pick_device(setting: str = "auto") -> torch.device:
    """The device a `device` setting names ("auto": a GPU when there is one); a CUDA device that is not
    there is a ValueError saying why and what to set, before any model loads (not torch's assertion)."""
    dev = torch.device(setting if setting != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this PyTorch is a CPU build" if torch.version.cuda is None else "PyTorch sees no CUDA device"
        raise ValueError(f"device = {setting!r}, but {why}: set device=cpu (or auto, which takes a GPU when there "
                         "is one), or install a CUDA PyTorch")  # fmt: skip
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device = {setting!r}, but there are only {torch.cuda.device_count()} CUDA devices "
                         "(cuda:0 ..)")  # fmt: skip
    return dev


def policy_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The policy's (base weights') dtype for a `policy_dtype` setting, and why: auto is BF16 on CUDA and
    on CPUs with BF16 units (AVX512-BF16, AMX-BF16), FP32 on other CPUs, where BF16 is emulated and slower.
    LoRA weights and optimizer state are FP32 either way (the trainer casts them)."""
    if setting != "auto":
        return getattr(torch, setting), "set in the config (policy_dtype)"
    return auto_policy_dtype(device)


def autocast_for(device: torch.device, dtype: torch.dtype | None = None,
                 cache: bool = True) -> contextlib.AbstractContextManager:  # fmt: skip
    """BF16 autocast on CUDA, and on a CPU when the policy (`dtype`) is BF16; nothing elsewhere. `cache` False:
    autocast keeps no BF16 cast of a trainable weight for the rest of the forward (a sharded full fine-tuning
    run gathers its FP32 weights block by block; cached casts would pile up to the whole model in BF16).

    Why on the CPU: the FP32 LoRA branch beside BF16 base weights would otherwise run in FP32 with
    casts around it: measured on the tiny model (AVX512-BF16, 2 cores, batch 32) a LoRA policy's
    forward takes 123 ms without autocast, 70 ms with it, 106 ms in FP32. An FP32 policy keeps exact
    FP32 numerics on the CPU (no autocast)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    if device.type == "cpu" and dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def training_attention() -> contextlib.AbstractContextManager:
    """The attention kernels the update's forwards and backwards may use: every SDPA backend but cuDNN's.
    Why: on the second lent H200 (torch 2.11+cu130) FLUX.1-dev's update failed in cuDNN's attention graph
    (`mha_graph.execute(...).is_good()` under CUDA_LAUNCH_BLOCKING=1; without it, an illegal memory address that
    broke the CUDA context), with and without expandable segments; its eager rollout forwards ran. Flash and
    memory-efficient attention do the same math; rollouts keep PyTorch's own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
