"""The one tensor-core table: what the GEMMs' availability checks say and the explore format the hardware
plan gives each compute capability, read from the same rows."""

from __future__ import annotations

import pytest
import torch

from solrl_engine import kernels
from solrl_engine.kernels import capability

CPU = torch.device("cpu")


def test_the_table_is_fastest_first():
    assert list(kernels.TENSOR_CORES) == ["nvfp4", "fp8", "int8"]
    assert [t.nominal_speedup for t in kernels.TENSOR_CORES.values()] == [4.0, 2.0, 2.0]
    assert [(t.label, t.needs, t.cpu_op) for t in kernels.TENSOR_CORES.values()] == [
        ("FP4", (10, 0), False), ("FP8", (8, 9), True), ("INT8", (8, 0), True)]  # fmt: skip


@pytest.mark.parametrize(("cap", "formats", "plan"), [
    (None, (), "nvfp4"), ((7, 5), (), "nvfp4"), ((8, 0), ("int8",), "int8"), ((8, 6), ("int8",), "int8"),
    ((8, 9), ("fp8", "int8"), "fp8"), ((9, 0), ("fp8", "int8"), "fp8"),
    ((10, 0), ("nvfp4", "fp8", "int8"), "nvfp4"), ((12, 0), ("nvfp4", "fp8", "int8"), "nvfp4"),
])  # fmt: skip
def test_formats_and_the_hardware_plan_follow_the_table(cap, formats, plan):
    assert kernels.formats_with_tensor_cores(cap) == formats
    assert kernels.fastest_format(cap) == plan


@pytest.mark.parametrize(("sm", "fmt", "why"), [
    ("", "nvfp4", "FP4 tensor-core GEMMs run on CUDA devices, not cpu"),
    ("", "fp8", "FP8 tensor-core GEMMs run on CUDA devices, not cpu"),
    ("", "int8", "INT8 tensor-core GEMMs run on CUDA devices, not cpu"),
    ("100", "nvfp4", "FP4 tensor-core GEMMs run on CUDA devices, not cpu (simulated sm_100: no CPU implementation)"),
    ("90", "fp8", None),
    ("86", "fp8", "sm_86 has no FP8 tensor cores (needs sm_89+)"),
    ("86", "int8", None),
    ("75", "int8", "sm_75 has no INT8 tensor cores (needs sm_80+)"),
])  # fmt: skip
def test_tensor_cores_says_why_not(monkeypatch, sm, fmt, why):
    monkeypatch.setenv(capability.SIM_ENV, sm)
    assert kernels.tensor_cores(CPU, fmt) == why
    label = kernels.TENSOR_CORES[fmt].label
    assert kernels.tensor_cores("meta", fmt) == f"{label} tensor-core GEMMs run on CUDA devices, not meta"


@pytest.mark.parametrize("sm", ["", "80", "90", "100"])
def test_the_gemms_read_the_table(monkeypatch, sm):
    """Each GEMM's `cuda` implementation is available exactly where the table says its format has tensor cores, but
    INT8's on sm_90+, where the Triton GEMM (available here: the interpreter) is taken instead, with that reason."""
    from solrl_engine.kernels import dispatch

    monkeypatch.setenv(capability.SIM_ENV, sm)
    for fmt in kernels.TENSOR_CORES:
        table = kernels.tensor_cores(CPU, fmt)
        why = dispatch.unavailable_reason("cuda", CPU, f"{fmt}_linear")
        if fmt == "int8" and sm in ("90", "100"):
            assert table is None and "the Triton GEMM with the fused epilogue runs instead" in why, why
            assert dispatch.unavailable_reason("triton", CPU, "int8_linear") is None
            continue
        assert (why is None) == (table is None) and (why or "").startswith(table or ""), (fmt, why)


def test_dispatch_keeps_the_names_it_held():
    from solrl_engine.kernels import dispatch

    assert dispatch.SIM_ENV == "SOLRL_SIMULATE_SM"
    assert dispatch.device_capability is capability.device_capability is kernels.device_capability
    assert dispatch.simulated_capability is capability.simulated_capability
    assert dispatch.gpu_like is capability.gpu_like
