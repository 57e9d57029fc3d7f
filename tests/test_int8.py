"""INT8 W8A8 (the Ampere explore format): the reference numerics against their definition, the
Triton kernels bit for bit against the reference (interpreter on a CPU), the torch._int_mm path
against the reference, and the in-place requantize."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import HAS_TRITON
from families import SHAPES, families
from torch import nn

from solrl_engine.kernels import int8 as kint8
from solrl_engine.nn import quantize_model, requantize_
from solrl_engine.quant import QuantRecipe, int8

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install -e '.[dev]')")


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x).all(dim=-1)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_quantize_meets_its_definition(shape):
    for fam, x in families(shape, seed=len(shape) * 7 + shape[-1]):
        q = int8.quantize_rowwise(x)
        assert q.data.dtype == torch.int8 and q.scale.shape == (*shape[:-1], 1)
        assert int(q.data.min()) >= -127 and int(q.data.max()) <= 127, fam  # symmetric: -128 never used
        ok = _finite_rows(x)
        xf, s, c = x[ok], q.scale[ok], q.data[ok].float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        want = torch.where(amax == 0, torch.ones_like(amax), torch.clamp(amax / 127, min=int8.TINY))
        assert torch.equal(s, want), fam
        assert torch.equal(c, torch.round(torch.clamp(xf / s, -127, 127))), fam  # round half to even
        assert ((c * s - xf).abs() <= s / 2 * (1 + 1e-6)).all(), fam  # decode within half a step
        bad = ~ok
        if bad.any():  # a row with NaN/Inf decodes to NaN: never a finite stand-in
            assert torch.isnan(q.scale[bad]).all() and (q.data[bad] == 0).all(), fam
            assert torch.isnan(q.dequantize(torch.float32)[bad]).all()


def test_ties_round_to_even_and_zero_rows_get_scale_one():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5], [0.0] * 8])
    q = int8.quantize_rowwise(x)
    assert q.data[0].tolist() == [127, 0, 2, 2, 0, -2, 126, -126] and q.scale[0].item() == 1.0
    assert q.data[1].tolist() == [0] * 8 and q.scale[1].item() == 1.0
    with pytest.raises(ValueError, match="non-empty last dimension"):
        int8.quantize_rowwise(torch.zeros(3, 0))
    with pytest.raises(TypeError, match="floating-point"):
        int8.quantize_rowwise(torch.zeros(3, 4, dtype=torch.int32))


def test_the_reference_gemm_is_exact_integer_arithmetic_then_the_epilogue():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(9, 80, generator=g), torch.randn(24, 80, generator=g), torch.randn(24, generator=g)
    wq, xq = int8.quantize_rowwise(w), int8.quantize_rowwise(x)
    y = int8.linear(x, wq, b)
    acc = (xq.data.long() @ wq.data.long().t()).float()  # exact in int64, rounded once to FP32
    assert torch.equal(y, acc * xq.scale.reshape(-1, 1) * wq.scale.reshape(1, -1) + b)
    rel = (y - (x @ w.t() + b)).norm() / (x @ w.t() + b).norm()
    assert rel < 0.02  # 8 bits per operand: about 1% error on Gaussian data


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_quantize_is_bit_exact(shape, dtype):
    tr = pytest.importorskip("solrl_triton.int8")
    for fam, x in families(shape, seed=shape[-1]):
        x = x.to(dtype)
        q, s = tr.quantize_rowwise(x)
        ref = int8.quantize_rowwise(x)
        assert torch.equal(q, ref.data), (fam, dtype)
        assert torch.allclose(s, ref.scale, rtol=0, atol=0, equal_nan=True), (fam, dtype)


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_epilogue_is_bit_exact(out_dtype):
    tr = pytest.importorskip("solrl_triton.int8")
    g = torch.Generator().manual_seed(2)
    for m, n in [(1, 8), (33, 72), (100, 200)]:
        acc = torch.randint(-(2**30), 2**30, (m, n), generator=g, dtype=torch.int32)
        sx, sw = torch.rand(m, 1, generator=g) * 1e-3, torch.rand(n, 1, generator=g) * 1e-3
        sx[0] = float("nan")
        for bias in (None, torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()):
            got = tr.scale_epilogue(acc, sx, sw, bias, out_dtype)
            want = int8.scale_epilogue(acc, sx, sw, bias, out_dtype)
            assert got.dtype == out_dtype and torch.allclose(got.float(), want.float(), rtol=0, atol=0, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int_mm_path_matches_the_reference(monkeypatch, out_dtype):
    """torch._int_mm (oneDNN on a CPU, cuBLASLt IMMA on a GPU) accumulates exactly in INT32 and the
    epilogue does the reference's operations in its order: the same numbers (within one rounding of
    the output dtype, here none), NaN rows included."""
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "80")
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    for shape in [(1, 16), (7, 48), (3, 5, 128), (40, 1040)]:
        for fam, x in families(shape, seed=3):
            n = 24
            w = torch.randn(n, shape[-1])
            wq, b = int8.quantize_rowwise(w), torch.randn(n)
            got = kint8._cuda_int8_linear(x, wq, b, out_dtype)
            want = kint8._ref_int8_linear(x, wq, b, out_dtype)
            assert got.shape == (*shape[:-1], n) and got.dtype == out_dtype
            assert torch.allclose(got.float(), want.float(), rtol=0, atol=0, equal_nan=True), fam


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_gemm_with_its_epilogue_is_bit_exact(out_dtype):
    """The Triton INT8 GEMM (integer dot in the tensor cores' INT32 accumulator, scales and bias in its epilogue,
    one write in the output dtype) gives the reference's bits: exact integer sums, then the reference's roundings.
    Shapes cross the tiles' edges in M, N and K; codes reach +-127 at K up to 1040 (sums near 2^24); NaN rows."""
    tr = pytest.importorskip("solrl_triton.int8")
    g = torch.Generator().manual_seed(5)
    for m, n, k in [(1, 8, 16), (33, 72, 48), (70, 130, 1040), (129, 24, 200)]:
        for fam, x in families((m, k), seed=k):
            xq = int8.quantize_rowwise(x)
            wq = int8.quantize_rowwise(torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).reshape(-1, 1))
            for bias in (None, torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()):
                got = tr.gemm(xq.data, xq.scale, wq.data, wq.scale, bias, out_dtype)
                acc = (xq.data.double() @ wq.data.double().t()).to(torch.int32)  # exact integer sums
                want = int8.scale_epilogue(acc, xq.scale, wq.scale, bias, out_dtype)
                assert got.dtype == out_dtype and got.shape == (m, n)
                assert torch.allclose(got.float(), want.float(), rtol=0, atol=0, equal_nan=True), (fam, m, n, k)


@needs_triton
def test_hopper_int8_layers_take_the_triton_gemm_and_it_is_what_ran(monkeypatch):
    """At a simulated sm_90 (Triton under the interpreter) an INT8 layer chooses the Triton GEMM, passing over
    torch._int_mm with the reason, runs it (the fast-path record names it), matches the reference bit for bit,
    and under torch.compile takes the traced form (quantize as torch ops, the GEMM as one op) with no graph break;
    at sm_80 it keeps torch._int_mm."""
    from solrl_engine.nn import fast_path

    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    torch.manual_seed(0)
    src = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48))
    x = torch.randn(2, 9, 64)
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "80")
    ampere = quantize_model(copy.deepcopy(src), "int8")
    assert all(ln.startswith("cuda") for ln in (d.kernel for d in ampere.layers if d.quantized))
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    net = copy.deepcopy(src)
    rep = quantize_model(net, "int8")
    kernels = [d.kernel for d in rep.layers if d.quantized]
    assert len(kernels) == 2 and all(k.startswith("triton (default)") and "cuBLASLt's INT8 GEMM runs sm_80" in k
                                     for k in kernels), kernels  # fmt: skip
    with torch.no_grad():
        y = net(x)
    assert {r.impl for r in fast_path(net).layers.values()} == {"triton: INT8 tensor-core GEMM, scales and bias in "
                                                                 "its epilogue"}  # fmt: skip
    want = kint8._ref_int8_linear(torch.nn.functional.gelu(kint8._ref_int8_linear(
        src[0](x), int8.quantize_rowwise(src[1].weight), src[1].bias)), int8.quantize_rowwise(src[3].weight),
        src[3].bias)  # fmt: skip
    assert torch.equal(y, want)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    with torch.no_grad():
        got = torch.compile(net, backend="eager", fullgraph=True)(x)
    assert dict(counters["graph_break"]) == {} and torch.equal(got, want)
    torch._dynamo.reset()


def test_int8_layers_requantize_in_place_and_report(monkeypatch):
    monkeypatch.delenv("SOLRL_SIMULATE_SM", raising=False)
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    copy = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    copy.load_state_dict(src.state_dict())
    rep = quantize_model(copy, "int8")
    assert rep.quantized == ["0", "2"] and rep.recipe.name == "int8"
    before, after = rep.weight_bytes()
    assert after == 64 * 128 + 4 * 128 + 128 * 32 + 4 * 32 and before == 2 * (64 * 128 + 128 * 32)
    ptrs = [copy[0].w_int8.data_ptr(), copy[0].w_scale.data_ptr()]
    with torch.no_grad():
        src[0].weight.mul_(3.0)
    assert requantize_(copy, source=src) == 2
    assert [copy[0].w_int8.data_ptr(), copy[0].w_scale.data_ptr()] == ptrs  # same storage: graphs stay valid
    fresh = int8.quantize_rowwise(src[0].weight)
    assert torch.equal(copy[0].w_int8, fresh.data) and torch.equal(copy[0].w_scale, fresh.scale)
    torch.testing.assert_close(copy[0].weight, fresh.dequantize(torch.float32))
    y = copy(torch.randn(5, 64))
    assert y.shape == (5, 32) and torch.isfinite(y).all()


def test_int8_is_a_w8a8_recipe():
    with pytest.raises(ValueError, match="int8 has no weight-only recipe.*fp8_weight_only"):
        QuantRecipe("int8", quantize_activations=False)
    with pytest.raises(ValueError, match="apply to NVFP4 recipes only"):
        QuantRecipe("int8", rht=16)


# --- attention: SageAttention's recipe ----------------------------------------------------------------------------


def _qkv(b: int, h: int, n: int, m: int, d: int, seed: int, k_offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, m, d, generator=g), torch.randn(b, h, m, d,
                                                                                                       generator=g)
    return q, k + k_offset * torch.randn(1, h, 1, d, generator=g), v  # an offset per channel: what smoothing removes


def test_int8_attention_reference_is_close_to_exact_attention_and_smoothing_is_what_keeps_it_so():
    """The reference (INT8 Q, smoothed K per block, FP32 softmax, FP16 P V) against FP32 attention: about a percent
    on Gaussian data, and still so when K carries a large per-channel offset (softmax ignores it once subtracted),
    where quantizing the raw K loses most of its resolution to the offset."""
    for n, m, d in [(130, 70, 64), (7, 200, 16)]:
        for off in (0.0, 20.0):
            q, k, v = _qkv(2, 3, n, m, d, seed=n + d, k_offset=off)
            exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            got = int8.attention(q, k, v)
            assert got.shape == exact.shape and (got - exact).norm() / exact.norm() < 0.03, (n, m, d, off)
    q, k, v = _qkv(1, 2, 130, 70, 64, seed=1, k_offset=20.0)
    raw_k = int8.quantize_blocks(k, int8.K_BLOCK)  # no smoothing: the offset sets every block's scale
    kd = raw_k.data.float() * raw_k.scale.repeat_interleave(int8.K_BLOCK, -1)[..., :70, None]
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    unsmoothed = torch.nn.functional.scaled_dot_product_attention(q, kd, v)
    smoothed = torch.nn.functional.scaled_dot_product_attention(*int8.attention_rounding(q, k, v))
    assert (smoothed - exact).norm() < 0.5 * (unsmoothed - exact).norm()


def test_int8_attention_blocks_follow_the_row_rule():
    """Per-block codes: each block's scale is its amax / 127, codes round half to even, a block holding a NaN gets a
    NaN scale (codes 0), blocks of zeros get scale 1; the tail block is as long as the tokens left."""
    x = torch.randn(2, 3, 200, 16)
    x[0, 0, 70] = float("nan")
    x[1, 2, 128:] = 0.0
    t = int8.quantize_blocks(x, 64)
    assert t.data.shape == x.shape and t.scale.shape == (2, 3, 4)
    ref = int8.quantize_rowwise(x[0, 1, 64:128].reshape(1, -1))
    assert torch.equal(t.data[0, 1, 64:128].reshape(1, -1), ref.data) and t.scale[0, 1, 1] == ref.scale.squeeze()
    assert torch.isnan(t.scale[0, 0, 1]) and (t.data[0, 0, 64:128] == 0).all()
    assert t.scale[1, 2, 3] == 1.0 and t.scale[1, 2, 2] == 1.0  # the zero blocks (128-191 and the 8-token tail)


@needs_triton
def test_triton_int8_attention_matches_its_reference():
    """The Triton kernel (INT8 Q K^T on the tensor cores, online softmax, FP16 P V) against quant.int8.attention:
    the same integer scores; only the softmax's order and P's FP16 rounding differ. Query and key counts cross the
    128- and 64-token tiles; head dims 16 and 64; BF16 and FP32 outputs."""
    tr = pytest.importorskip("solrl_triton.attention")
    for n, m, d, dtype in [(130, 70, 64, torch.float32), (5, 200, 16, torch.bfloat16), (128, 64, 64, torch.float32)]:
        q, k, v = (t.to(dtype) for t in _qkv(1, 2, n, m, d, seed=d + n, k_offset=3.0))
        qt, kt = int8.quantize_blocks(q, int8.Q_BLOCK), int8.quantize_blocks(int8.smooth_k(k), int8.K_BLOCK)
        got = tr.int8_attention(qt.data, qt.scale, kt.data, kt.scale, v, d**-0.5, dtype)
        want = int8.attention(q, k, v)
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).abs().max() < 2e-2 * want.float().abs().max(), (n, m, d, dtype)


# the explore copy running INT8's attention kernel: tests/test_fp8_attention.py (one test for both formats)
