"""INT8 W8A8 kernels around `torch._int_mm`, bit-exact with solrl_engine.quant.int8:

- quantize_rowwise: one program per row; a first sweep finds the row's finite amax (and whether it
  holds a non-finite value), a second encodes: one launch instead of torch's five passes;
- scale_epilogue: float32(acc) * x_scale[m] * w_scale[n] (+ bias) -> out dtype in one pass over the
  INT32 accumulator (cuBLASLt's IMMA GEMM has no row-and-column-scaled epilogue of its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._numerics import EXACT, int8_encode, int8_row_scale, is_finite, load_f32, store_out
from .fp8 import launch_rowwise

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _int8_rowwise_kernel(x_ptr, q_ptr, scale_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         IN_BF16: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = rows[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    bad = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = load_f32(x_ptr + base + offs[None, :], rmask[:, None] & (offs < K)[None, :], IN_BF16)
        fin = is_finite(x)
        acc = tl.maximum(acc, tl.where(fin, tl.abs(x), 0.0))
        bad = tl.maximum(bad, tl.where(fin, 0, 1))
    s = int8_row_scale(tl.max(acc, axis=1), tl.max(bad, axis=1) > 0)
    tl.store(scale_ptr + rows, s, mask=rmask)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (offs < K)[None, :]
        x = load_f32(x_ptr + base + offs[None, :], m, IN_BF16)
        tl.store(q_ptr + base + offs[None, :], int8_encode(x, s), mask=m)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 codes [..., K], fp32 decode scales [..., 1])."""
    return launch_rowwise(_int8_rowwise_kernel, x, torch.int8, "INT8")


@triton.jit
def _epilogue_kernel(acc_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, BIAS_BF16: tl.constexpr,
                     OUT_KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    mask = mm[:, None] & mn[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    acc = tl.load(acc_ptr + offs, mask=mask, other=0).to(tl.float32)
    sx = tl.load(sx_ptr + rm, mask=mm, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=mn, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y = y + load_f32(b_ptr + rn, mn, BIAS_BF16)[None, :]
    store_out(out_ptr + offs, y, mask, OUT_KIND)


def _epilogue_operands(
    out: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What the scale epilogue reads and writes, as the kernels take it: the output (BF16 through its int16 bits),
    the row and channel scales flat in FP32, the bias (FP32 or BF16; None) and its pointer argument (BF16 as int16
    bits; the row scales stand in for a missing one, never read)."""
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    sx = x_scale.reshape(-1).float().contiguous()
    sw = w_scale.reshape(-1).float().contiguous()
    if bias is not None and bias.dtype not in (torch.float32, torch.bfloat16):
        bias = bias.float()
    b = None if bias is None else bias.contiguous()
    b_arg = sx if b is None else (b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    return dst, sx, sw, b, b_arg


def scale_epilogue(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """acc [M, N] int32 -> float32(acc) * x_scale[m] * w_scale[n] (+ bias) as out_dtype, one pass."""
    if out_dtype not in _OUT_KIND:
        raise TypeError(f"the INT8 epilogue writes float32, bfloat16 or float16; got {out_dtype}.")
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if m == 0 or n == 0:
        return out
    dst, sx, sw, b, b_arg = _epilogue_operands(out, x_scale, w_scale, bias)
    bm, bn = 32, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _epilogue_kernel[grid](acc.contiguous(), sx, sw, b_arg, dst, m, n, HAS_BIAS=b is not None,
                           BIAS_BF16=b is not None and b.dtype == torch.bfloat16, OUT_KIND=_OUT_KIND[out_dtype],
                           BM=bm, BN=bn, **EXACT)  # fmt: skip
    return out


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, sx_ptr, sw_ptr, b_bias_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                      BIAS_BF16: tl.constexpr, OUT_KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):  # fmt: skip
    """out[M, N] = float32(sum_k a[m, k] b[n, k]) * sx[m] * sw[n] (+ bias[n]): INT8 codes in, the INT32 sums exact
    in the tensor cores' accumulator (wgmma on sm_90, mma on sm_80), the scales and bias applied in registers and
    the result written once in the output dtype (no INT32 round trip through memory)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mm, mn = rm < M, rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * K
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * K
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :], mask=mm[:, None] & (kk < K)[None, :], other=0)
        b = tl.load(b_cols + kk[:, None], mask=(kk < K)[:, None] & mn[None, :], other=0)  # [BK, BN]: W^T's tile
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    sx = tl.load(sx_ptr + rm, mask=mm, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=mn, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y = y + load_f32(b_bias_ptr + rn, mn, BIAS_BF16)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    store_out(out_ptr + offs, y, mm[:, None] & mn[None, :], OUT_KIND)


def gemm(
    a: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """INT8 codes a [M, K] and w [N, K] with their row scales -> float32(a @ w.T) * x_scale[m] * w_scale[n] (+ bias)
    as out_dtype [M, N], in one kernel: the GEMM and `scale_epilogue` fused, bit-exact with it (the sums are exact
    integers, the epilogue rounds as the reference does: no contracted multiply-add)."""
    if out_dtype not in _OUT_KIND:
        raise TypeError(f"the INT8 GEMM writes float32, bfloat16 or float16; got {out_dtype}.")
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    dst, sx, sw, b, b_arg = _epilogue_operands(out, x_scale, w_scale, bias)
    # tiles for the tensor cores (an int8 dot needs K tiles of 32+); a short M (few tokens) takes a shorter tile
    bm = 64 if m <= 64 else 128
    bn, bk = 128, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int8_gemm_kernel[grid](a.contiguous(), w.contiguous(), sx, sw, b_arg, dst, m, n, k, HAS_BIAS=b is not None,
                            BIAS_BF16=b is not None and b.dtype == torch.bfloat16, OUT_KIND=_OUT_KIND[out_dtype],
                            BM=bm, BN=bn, BK=bk, num_warps=8 if bm == 128 else 4, num_stages=3,
                            **EXACT)  # fmt: skip
    return out
