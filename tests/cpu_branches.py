"""Both branches of the CPU runtime's BF16 detection, on any machine.

The policy dtype that `policy_dtype=auto` picks on a CPU depends on the CPU (hw.cpu_bf16: BF16 where
it has AVX512-BF16 or AMX-BF16 units, FP32 elsewhere), so a test of the trainer that hard-codes one
of them passes on some machines and fails on others. Tests that depend on it force the detection
both ways instead (where the CPU has no BF16 units, BF16 is emulated: slower, but the same numbers)
and take their expectations and tolerances from the dtype that results.
"""

from __future__ import annotations

import pytest
import torch

from solrl_engine import hw

BRANCHES = ("fp32", "bf16")  # pytest ids: the detection forced to "no BF16 units" / "BF16 units"


def force_cpu_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> torch.dtype:
    """Make hw.cpu_bf16 report native BF16 (or not) for one test; returns the policy dtype that
    `policy_dtype=auto` then resolves to on the CPU."""
    unit = "AVX512-BF16" if native else ""
    why = f"forced by the test: {'BF16 units' if native else 'no BF16 units'}"
    monkeypatch.setattr(hw, "cpu_bf16", lambda *a, **k: hw.CpuBF16(native, unit, why))
    dtype, _ = hw.auto_policy_dtype("cpu")
    assert dtype == (torch.bfloat16 if native else torch.float32), "hw.auto_policy_dtype no longer reads hw.cpu_bf16"
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' / 'bfloat16', as run summaries name the policy's precision."""
    return str(dtype).removeprefix("torch.")


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """pytest.approx's rel/abs for one quantity computed two ways (other batch split, other rank
    count, other caller) by a policy in `dtype`: FP32 agrees to rounding noise; BF16 (8 bits of
    mantissa, relative step 2**-8) to a few of its steps."""
    return {"rel": 1e-4, "abs": 1e-6} if dtype == torch.float32 else {"rel": 2e-2, "abs": 1e-4}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise agreement of two results of a policy in `dtype`: FP32 to 1e-5; BF16 to a few of
    its steps (2**-8 relative) at the tensor's own scale, since a BF16 output carries rounding
    relative to its largest values, not to each element."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    scale = want.float().square().mean().sqrt().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * max(scale, 1e-6))
