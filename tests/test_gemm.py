"""Quantized GEMMs (solrl_engine.kernels.nvfp4, .fp8) against the reference, on fresh data of every family.

Here: the Triton W4A4 and W4A16 kernels in the CPU interpreter (on the GPU when present), the FP8
`_scaled_mm` path (torch runs row-wise `_scaled_mm` on CPU too), and the cuBLASLt FP4 operand layout.
The FP4 `_scaled_mm` call itself needs sm_100 and is never executed here.
"""

from __future__ import annotations

import pytest
import torch
from families import families

from solrl_engine import kernels
from solrl_engine.kernels import dispatch
from solrl_engine.kernels import fp8 as kfp8
from solrl_engine.kernels import nvfp4 as knvfp4
from solrl_engine.quant import fp8, nvfp4

GEMM_SHAPES = [(1, 16, 32), (7, 48, 64), (33, 40, 160), (64, 96, 256)]  # (M, N, K): ragged tiles too


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Same NaN and Inf pattern; elsewhere |got - want| <= rtol * max|want| per row (accumulation
    order and output rounding differ, the products do not)."""
    got, want = got.float().cpu(), want.float().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[got.isinf()], want[want.isinf()])
    ok = want.isfinite()
    scale = torch.where(ok, want, 0.0).abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = ((got - want).abs() / scale)[ok]
    assert err.numel() == 0 or err.max() <= rtol, err.max()


def _operands(m: int, n: int, k: int, seed: int):
    xs = dict(families((m, k), seed))
    ws = dict(families((n, k), seed + 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return xs, ws, bias


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("mnk", GEMM_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_w4a4_matches_reference(mnk, dtype, device):
    m, n, k = mnk
    xs, ws, bias = _operands(m, n, k, seed=sum(mnk))
    assert kernels.select("nvfp4_linear", device) in ("triton", "cuda")
    for kind in xs:
        if kind == "tiny":  # 1e-38 inputs: outputs underflow in every dtype, nothing to compare
            continue
        x, w = xs[kind].to(dtype), nvfp4.quantize(ws["gaussian" if kind == "nonfinite" else kind])
        want = knvfp4._ref_nvfp4_linear(x, w, bias, True)
        got = knvfp4._tr_nvfp4_linear(x.to(device), _to(w, device), bias.to(device), True)
        assert got.dtype == dtype and got.shape == (m, n)
        _close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("mnk", GEMM_SHAPES + [(5, 40, 512)])  # K=512: split-K partial sums
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_w4a16_matches_reference(mnk, dtype, device):
    m, n, k = mnk
    xs, ws, bias = _operands(m, n, k, seed=3 * sum(mnk))
    for kind in ("gaussian", "outlier_channels", "decades", "zero_blocks", "ties"):
        x, w = xs[kind].to(dtype), nvfp4.quantize(ws[kind])
        for b in (bias, None):
            want = knvfp4._ref_nvfp4_linear(x, w, b, False)
            got = knvfp4._tr_nvfp4_linear(x.to(device), _to(w, device), None if b is None else b.to(device), False)
            _close(got, want, 1e-2)


def _to(t: nvfp4.NVFP4Tensor, device: torch.device) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(t.qdata.to(device), t.scale.to(device), t.global_scale.to(device), t.orig_dtype)


@pytest.mark.usefixtures("triton_backend")
def test_w4a16_keeps_fp32_activations_exact():
    """FP32 activations would be rounded by the BF16 kernel, so that case stays on the reference."""
    x = torch.randn(4, 64)
    w = nvfp4.quantize(torch.randn(32, 64))
    assert torch.equal(knvfp4._tr_nvfp4_linear(x, w, None, False), knvfp4._ref_nvfp4_linear(x, w, None, False))


@pytest.mark.usefixtures("triton_backend")
def test_gemm_rejects_bad_operands():
    from solrl_triton import gemm

    a = nvfp4.quantize(torch.randn(8, 64))
    b = nvfp4.quantize(torch.randn(16, 32))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        gemm.w4a4_gemm(a.qdata, a.scale, a.global_scale, b.qdata, b.scale, b.global_scale)
    with pytest.raises(ValueError, match="not swizzled"):
        gemm.w4a4_gemm(a.qdata, nvfp4.swizzle_scales(a.scale), a.global_scale, a.qdata, a.scale, a.global_scale)
    with pytest.raises(ValueError, match="bfloat16/float16 activations"):
        gemm.w4a16_gemm(torch.randn(8, 32), b.qdata, b.scale, b.global_scale)


@pytest.mark.parametrize("mnk", [(7, 48, 64), (64, 96, 256), (5, 40, 24)])  # K=24: not 16-aligned, reference
def test_fp8_scaled_mm_matches_reference(mnk):
    m, n, k = mnk
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).bfloat16()
    x[0, : k // 4] *= 200.0  # outlier token: per-token scales must absorb it
    w = fp8.quantize_rowwise(torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k))
    bias = torch.randn(n, generator=g)
    for b in (bias, None):
        want = kfp8._ref_fp8_linear(x, w, b, True)
        got = kfp8._cuda_fp8_linear(x, w, b, True)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        _close(got, want, 1e-2)
    # FP32 activations (a LayerNorm's output under CUDA autocast) are quantized from FP32 and take the
    # same GEMM (cuBLASLt row-wise writes BF16; the caller's out_dtype is cast from it), not the reference
    xf = x.float()
    for out in (torch.bfloat16, torch.float32):
        got = kfp8._cuda_fp8_linear(xf, w, bias, True, out)
        assert got.dtype == out
        _close(got, kfp8._ref_fp8_linear(xf, w, bias, True, out), 1e-2)
        if k % 16 == 0:  # same codes from FP32 and from its BF16 copy: the same BF16 GEMM result
            assert torch.equal(got.bfloat16(), kfp8._cuda_fp8_linear(x, w, bias, True))


def test_fp4_scaled_mm_operands_are_cublas_layout():
    t = nvfp4.quantize(torch.randn(130, 96))
    data, scales = knvfp4.scaled_mm_fp4_operands(t)
    assert data.dtype == torch.float4_e2m1fn_x2 and data.shape == (130, 48)
    assert torch.equal(data.view(torch.uint8), t.qdata)
    assert scales.dtype == torch.float8_e4m3fn and scales.numel() == 256 * 8  # rows to 128, blocks to 4
    back = nvfp4.unswizzle_scales(scales, 130, 6)
    assert torch.equal(back.view(torch.uint8), t.scale.view(torch.uint8))


def test_cuda_gemms_say_why_they_cannot_run_here():
    cpu = torch.device("cpu")
    assert "CUDA" in dispatch.unavailable_reason("cuda", cpu, "nvfp4_linear")
    assert "CUDA" in dispatch.unavailable_reason("cuda", cpu, "fp8_linear")
    assert dispatch.select("nvfp4_linear", cpu) == "reference"
    assert dispatch.select("fp8_linear", cpu) == "reference"
