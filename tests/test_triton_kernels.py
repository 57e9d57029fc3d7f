"""Triton kernels bit-exact against the reference (CPU interpreter here, the GPU when present).

Interpreter-checked: every path in solrl_triton (the triton_kernels/ folder: amax, quantize, quantize into buffers,
dequantize, fused fake-quant, FP8 row-wise). Rounding is done with integer bit operations in those
kernels, so the interpreter's wrong fp32->fp8/bf16 casts are not on any tested path.
"""

from __future__ import annotations

import pytest
import torch
from families import SHAPES, families

from solrl_engine import kernels
from solrl_engine.quant import fp8, nvfp4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
pytestmark = pytest.mark.usefixtures("triton_backend")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32),
    )


def _canon_nan(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_quantize_bit_exact(shape, dtype, device):
    assert kernels.select("nvfp4_quantize", device) == "triton"
    for kind, x in families(shape, seed=11):
        x = x.to(dtype)
        for amax in (None, 1.5):
            want = nvfp4.quantize(x, amax=amax)
            got = kernels.nvfp4_quantize(x.to(device), amax=amax)
            assert _same(got.qdata.cpu(), want.qdata), (kind, amax)
            assert _same(got.scale.cpu(), want.scale), (kind, amax)
            assert _same(got.global_scale.cpu(), want.global_scale), (kind, amax)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quantize_and_dequantize_bit_exact(shape, dtype, device):
    for kind, x in families(shape, seed=12):
        x = x.to(dtype)
        want = _canon_nan(nvfp4.fake_quantize(x))
        got = kernels.nvfp4_fake_quantize(x.to(device)).cpu()
        assert _same(_canon_nan(got), want), kind
        t = nvfp4.quantize(x)
        t_dev = nvfp4.NVFP4Tensor(t.qdata.to(device), t.scale.to(device), t.global_scale.to(device), dtype)
        deq = kernels.nvfp4_dequantize(t_dev).cpu()
        assert _same(_canon_nan(deq), want), kind


def test_quantize_into_keeps_storage(device):
    x = torch.randn(32, 64, device=device)
    t = kernels.nvfp4_quantize(x)
    ptrs = (t.qdata.data_ptr(), t.scale.data_ptr(), t.global_scale.data_ptr())
    y = torch.randn(32, 64, device=device) * 5
    kernels.nvfp4_quantize_into_(t, y)
    assert ptrs == (t.qdata.data_ptr(), t.scale.data_ptr(), t.global_scale.data_ptr())
    want = nvfp4.quantize(y.cpu())
    assert _same(t.qdata.cpu(), want.qdata) and _same(t.scale.cpu(), want.scale)
    assert _same(t.global_scale.cpu(), want.global_scale)


@pytest.mark.parametrize("shape", [(4, 16), (7, 100), (2, 3, 300), (3, 20000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rowwise_bit_exact(shape, dtype, device):
    for kind, x in families(shape, seed=13) if shape[-1] % 16 == 0 else [("gaussian", torch.randn(shape))]:
        x = x.to(dtype)
        want = fp8.quantize_rowwise(x)
        got = kernels.fp8_quantize_rowwise(x.to(device))
        assert _same(got.data.cpu(), want.data), kind
        assert _same(got.scale.cpu(), want.scale), kind


def test_amax_kernel_ignores_nonfinite(device):
    from solrl_triton import nvfp4 as tk

    x = torch.randn(1000, device=device)
    want = x.abs().max()
    x[5] = float("inf")
    x[6] = float("nan")
    assert tk.amax(x).item() == want.item()
    assert tk.amax(torch.zeros(0, device=device)).item() == 0.0


def test_triton_checks_inputs_like_the_reference(device):
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.nvfp4_quantize(torch.randn(3, 24, device=device))
    with pytest.raises(ValueError, match="amax"):
        kernels.nvfp4_fake_quantize(torch.randn(3, 16, device=device), amax=float("nan"))
