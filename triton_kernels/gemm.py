"""NVFP4 GEMMs for GPUs without FP4 tensor cores (Hopper, Ada): decode in the kernel, FP16 MMA.

y = (A B^T) * g_a * g_b (+ bias), with B = NVFP4 weights [N, K] and A either NVFP4 activations
[M, K] (W4A4) or plain BF16/FP16 activations (W4A16, the weight-only kernel for small M).

Why FP16 tensor cores and not BF16: every decoded value e2m1 * e4m3 has at most 6 significant bits,
so it is exact in FP16 as in BF16, and FP16 lets the decode be a few integer ops (the E2M1 code
and the E4M3 scale drop straight into FP16 bit fields, see `_load_fp4`); the MMA is as fast. The
products are exact, so only FP32 accumulation order (and FMA contraction in the epilogue) differ
from the reference (solrl_engine.kernels.nvfp4 `_ref_nvfp4_linear`, FP32 matmul of the same
values).

Packed codes are read as 32-bit words: word j of a row holds elements 8j..8j+7 (byte i: element 2i
in the low nibble, 2i+1 in the high one), all in one 16-element scale block. A dot product does not
care about the order of K, so each K tile is 8 MMAs, one per nibble position of the words, with A
and B permuted alike: two elements decoded per 32-bit integer op, no interleave in registers.
`bench/sass.py` counts the resulting main-loop instructions for sm_90a without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._numerics import store_out

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Decoded operands carry a power-of-two offset that the epilogue takes back out (exact):
# a code decodes to e2m1 * 2^-14 and a scale to e4m3 * 2^7, so a value is e2m1 * e4m3 * 2^-7.
UNIT = 128.0
_UNIT = tl.constexpr(UNIT)
# _load_fp4's 8 tiles, in order, hold elements 8j + 0, 4, 1, 5, 2, 6, 3, 7 of word j
_ELEM_OF_TILE = tl.constexpr((0, 4, 1, 5, 2, 6, 3, 7))


@triton.jit
def _half_pair(w, s: tl.constexpr):
    """Two FP16 codes from int32 words: nibbles at bits s and s + 16 land in the low and high
    halves as e2m1 * 2^-14 (see _load_fp4); 2 elements per 32-bit op."""
    t = w >> s
    r = ((t << 9) & 0x0E000E00) | ((t << 12) & -2147450880)  # -2147450880: 0x80008000 as int32
    return r.to(tl.int16).to(tl.float16, bitcast=True), (r >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _load_fp4(q_ptr, s_ptr, rows, rmask, k0, KH, KB, BR: tl.constexpr, BKH: tl.constexpr):
    """Decode bytes [k0, k0 + BKH) of rows `rows` of a packed NVFP4 matrix into 8 FP16 tiles
    [BR, BKH / 4] holding e2m1 * e4m3 * 2^-7 exactly, one per nibble position of a 32-bit word.

    A dot product does not care about the order of K, so the tiles are K-permuted the same way for
    both operands and each feeds its own MMA. Codes: the E2M1 bits dropped into FP16's
    exponent/mantissa fields are e2m1 * 2^-14 (the 0.5 code lands on an FP16 subnormal), two per
    32-bit op. Scales: one E4M3 byte per 8 bytes (two words); its bits << 7 are e4m3 * 2^-8 in
    FP16 (subnormals too), times 2^15 is e4m3 * 2^7 (at most 57344). Products have at most 6
    significant bits and lie in [2^-17, 21], so FP16 holds them exactly. A NaN scale stays NaN.
    """
    NW: tl.constexpr = BKH // 4
    word = k0 // 4 + tl.arange(0, NW)
    m = rmask[:, None] & (word[None, :] < KH // 4)
    w = tl.load(q_ptr + rows[:, None] * (KH // 4) + word[None, :], mask=m, other=0)
    sb = tl.load(s_ptr + rows[:, None] * KB + word[None, :] // 2, mask=m, other=0).to(tl.int32) & 0x7F
    sc = tl.where(sb == 0x7F, 0x7E00, sb << 7).to(tl.int16).to(tl.float16, bitcast=True)  # 0x7E00: NaN
    sc = (sc * 32768.0).to(tl.float16)
    a0, a1 = _half_pair(w, 0)
    b0, b1 = _half_pair(w, 4)
    c0, c1 = _half_pair(w, 8)
    d0, d1 = _half_pair(w, 12)
    return a0 * sc, a1 * sc, b0 * sc, b1 * sc, c0 * sc, c1 * sc, d0 * sc, d1 * sc


@triton.jit
def _epilogue(acc, out_ptr, bias_ptr, ga_ptr, gb_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr, OUT_KIND: tl.constexpr):
    acc = acc * (tl.load(ga_ptr) * tl.load(gb_ptr) * (_UNIT * _UNIT))
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    store_out(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask, OUT_KIND)


@triton.jit
def _w4a4_kernel(
    aq_ptr, as_ptr, ga_ptr, bq_ptr, bs_ptr, gb_ptr, bias_ptr, out_ptr,
    M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_KIND: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # Grouped ordering: programs sharing B tiles run together (L2 reuse).
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    KH = K // 2
    KB = K // 16
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KH, BK // 2):
        a = _load_fp4(aq_ptr, as_ptr, rm.to(tl.int64), rm < M, k0, KH, KB, BM, BK // 2)
        b = _load_fp4(bq_ptr, bs_ptr, rn.to(tl.int64), rn < N, k0, KH, KB, BN, BK // 2)
        for t in tl.static_range(8):
            acc = tl.dot(a[t], tl.trans(b[t]), acc)
    _epilogue(acc, out_ptr, bias_ptr, ga_ptr, gb_ptr, rm, rn, M, N, HAS_BIAS, OUT_KIND)


@triton.jit
def _w4a16_kernel(
    x_ptr, bq_ptr, bs_ptr, gb_ptr, bias_ptr, out_ptr,
    M, N, K, K_SPLIT,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_KIND: tl.constexpr, PARTIAL: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Small-M weight-only GEMM; grid (N tiles, M tiles, split-K). With PARTIAL, raw FP32 partial
    sums go to out[split, M, N] and the caller reduces (deterministic, unlike atomics)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    KH = K // 2
    KB = K // 16
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    rows = rm.to(tl.int64)
    k_end = tl.minimum(KH, (pid_k + 1) * (K_SPLIT // 2))
    for k0 in range(pid_k * (K_SPLIT // 2), k_end, BK // 2):
        word = k0 // 4 + tl.arange(0, BK // 8)
        xm = (rm[:, None] < M) & (word[None, :] < k_end // 4)
        xw = x_ptr + rows[:, None] * K + 8 * word[None, :]  # element 8j + e pairs with tile _FP4_ORDER[e]
        b = _load_fp4(bq_ptr, bs_ptr, rn.to(tl.int64), rn < N, k0, KH, KB, BN, BK // 2)
        for t in tl.static_range(8):
            xt = tl.load(xw + _ELEM_OF_TILE[t], mask=xm, other=0.0)
            bt = tl.trans(b[t])
            if DOT_F32:  # the CPU interpreter's BF16 tl.dot is wrong; FP32 gives the same exact products
                acc = tl.dot(xt.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
            else:  # FP16 values are exact in BF16 too; the cast goes through FP32 (exact)
                acc = tl.dot(xt, bt.to(tl.float32).to(xt.dtype), acc)
    if PARTIAL:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=mask)
    else:
        acc = acc * (tl.load(gb_ptr) * _UNIT)  # activations carry no global scale
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        store_out(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask, OUT_KIND)


@triton.jit
def _splitk_reduce_kernel(part_ptr, gb_ptr, bias_ptr, out_ptr, MN, N, SPLIT, HAS_BIAS: tl.constexpr,
                          OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """out = (sum over splits of the partial sums) * g_b + bias, in a fixed order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sp in range(0, SPLIT):
        acc += tl.load(part_ptr + sp * MN + offs, mask=mask, other=0.0)
    acc = acc * (tl.load(gb_ptr) * _UNIT)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    store_out(out_ptr + offs, acc, mask, OUT_KIND)


def _w4a4_configs() -> list[triton.Config]:
    # Wide tiles amortize the decode (its cost grows with BM + BN, the MMA's with BM * BN). Chosen
    # from Triton 3.6 sm_90a SASS on CPU (instructions per K step, spills), not yet timed on a GPU:
    # 128x256 and 256x128 issue ~1.4 instructions per MMA cycle, 128x128 ~1.9.
    return [
        triton.Config({"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8}, num_warps=8, num_stages=st)
        for bm, bn, st in [(128, 256, 3), (256, 128, 3), (128, 128, 3), (128, 128, 4)]
    ]


_w4a4_tuned = triton.autotune(_w4a4_configs(), key=["M", "N", "K"])(_w4a4_kernel)


def _check_operand(q: torch.Tensor, s: torch.Tensor, name: str) -> tuple[int, int]:
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise ValueError(
            f"{name}: packed NVFP4 data must be a 2-D uint8 [rows, K/2] tensor; got {q.dtype} {tuple(q.shape)}."
        )
    rows, kh = q.shape
    if s.shape != (rows, kh // 8):
        raise ValueError(
            f"{name}: block scales must be [rows, K/16] = {(rows, kh // 8)} (row-major, not swizzled); "
            f"got {tuple(s.shape)}."
        )
    return rows, kh * 2


def _prep(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _words(q: torch.Tensor) -> torch.Tensor:
    """Packed codes as int32 words (4 bytes, 8 elements each): the kernels decode a word at a time."""
    return q.contiguous().view(torch.int32)


def _out(m: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype not in _OUT_KIND:
        raise TypeError(f"NVFP4 GEMM writes float32, bfloat16 or float16; got {dtype}.")
    out = torch.empty((m, n), dtype=dtype, device=device)
    return out, (out.view(torch.int16) if dtype == torch.bfloat16 else out)


def w4a4_gemm(
    a_q: torch.Tensor, a_s: torch.Tensor, a_g: torch.Tensor,
    b_q: torch.Tensor, b_s: torch.Tensor, b_g: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """(A B^T) g_a g_b + bias for NVFP4 A [M, K] and B [N, K] (packed data, E4M3 block scales, g)."""
    m, k = _check_operand(a_q, a_s, "A")
    n, kb = _check_operand(b_q, b_s, "B")
    if k != kb:
        raise ValueError(f"inner dimensions differ: A has K={k}, B has K={kb}.")
    out, dst = _out(m, n, out_dtype, a_q.device)
    if m == 0 or n == 0:
        return out
    ga = a_g.to(torch.float32).reshape(())
    gb = b_g.to(torch.float32).reshape(())
    args = (_words(a_q), _prep(a_s), ga, _words(b_q), _prep(b_s), gb, bias if bias is not None else gb, dst, m, n, k)
    flags = {"HAS_BIAS": bias is not None, "OUT_KIND": _OUT_KIND[out_dtype]}
    if _interpreting():
        bm, bn, bk = 32, 32, 128  # BK >= 128: each of the 8 MMAs per K tile needs K >= 16
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _w4a4_kernel[grid](*args, BM=bm, BN=bn, BK=bk, GROUP_M=4, **flags)
    else:

        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

        _w4a4_tuned[grid](*args, **flags)
    return out


def _w4a16_plan(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, BK, split-K, warps, stages): enough programs to fill an H100's 132 SMs at small M."""
    if _interpreting():
        return 16, 32, 128, (2 if k >= 256 else 1), 4, 1
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = 64, 256
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while tiles * split < 264 and k // (split * 2) >= 2 * bk:  # two waves, >= 2 K steps per split
        split *= 2
    return bm, bn, bk, split, 4, 4


def w4a16_gemm(
    x: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_g: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """(x B^T) g_b + bias for BF16/FP16 activations x [M, K] and NVFP4 weights B [N, K]."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"weight-only GEMM takes 2-D bfloat16/float16 activations; got {x.dtype} {tuple(x.shape)}.")
    n, k = _check_operand(b_q, b_s, "B")
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"inner dimensions differ: x has K={x.shape[1]}, B has K={k}.")
    out_dtype = out_dtype or x.dtype
    out, dst = _out(m, n, out_dtype, x.device)
    if m == 0 or n == 0:
        return out
    x = x.contiguous()
    gb = b_g.to(torch.float32).reshape(())
    bm, bn, bk, split, warps, stages = _w4a16_plan(m, n, k)
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    dot_f32 = _interpreting() and x.dtype == torch.bfloat16
    common = {"BM": bm, "BN": bn, "BK": bk, "DOT_F32": dot_f32, "num_warps": warps, "num_stages": stages}
    bq, bs = _words(b_q), _prep(b_s)
    if split == 1:
        b_arg = bias if bias is not None else gb
        flags = {"HAS_BIAS": bias is not None, "OUT_KIND": _OUT_KIND[out_dtype], "PARTIAL": False}
        _w4a16_kernel[grid](x, bq, bs, gb, b_arg, dst, m, n, k, k_split, **flags, **common)
        return out
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _w4a16_kernel[grid](x, bq, bs, gb, gb, part, m, n, k, k_split, HAS_BIAS=False, OUT_KIND=0, PARTIAL=True, **common)
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, gb, bias if bias is not None else gb, dst, m * n, n, split,
        HAS_BIAS=bias is not None, OUT_KIND=_OUT_KIND[out_dtype], BLOCK=block,
    )  # fmt: skip
    return out
