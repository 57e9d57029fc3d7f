"""Low-precision attention for the explore pass, one program per (128-query block, batch x head), online softmax
over 64-key blocks (FlashAttention's loop):
- INT8: SageAttention's recipe (INT8 Q K^T under per-block scales, K smoothed beforehand, softmax in FP32, P V on
  FP16 tensor cores). The reference is solrl_engine.quant.int8.attention; the tiles are its scale blocks (Q: 128
  tokens, K: 64), so the integer scores are the reference's exactly and only the softmax's summation order and P's
  FP16 rounding (of unnormalised values here) differ.
- FP8: Q K^T and P V both on the FP8 tensor cores (Q, K E4M3 per token, V per channel, P = exp(S - running max)
  encoded at 448 per key block, each block's P V added to an FP32 accumulator). The reference is
  solrl_engine.quant.fp8.attention, which runs the same key blocks; the sums' order and exp's last bit differ.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._numerics import fp8_encode, store_out

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BM, BN = 128, 64  # = solrl_engine.quant.int8's Q_BLOCK, K_BLOCK
MAX_HEAD_DIM = 256  # any head dim up to it: padded to a power of two in registers (SANA-Video's 112 runs at 128)


@triton.jit
def _scores(s, mn, b_ptr, rn, HAS_BIAS: tl.constexpr):
    """A key block's scores with the keys' additive bias (a key-padding mask) and the keys past M at -inf."""
    if HAS_BIAS:
        s = s + tl.load(b_ptr + rn, mask=mn, other=0.0)[None, :]
    return tl.where(mn[None, :], s, float("-inf"))


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One key block of the online softmax: (P = exp(S - running max), the old sums' rescale, the new max, the new
    sums). A row whose keys so far are all masked (max -inf) takes 0 as its max, so its P and rescale are 0, not
    NaN; a row masked throughout ends with sum 0 (NaN out, as exact attention)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _query_tile(q_ptr, N, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr):
    """This program's (batch x head, query rows, their mask, head-dim lanes, their mask, query codes [BM, DP]): the
    head dim padded to a power of two, the padded lanes loaded as 0 and never stored."""
    bh = tl.program_id(1).to(tl.int64)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rd = tl.arange(0, DP)
    mm, md = rm < N, rd < D
    q = tl.load(q_ptr + bh * N * D + rm.to(tl.int64)[:, None] * D + rd[None, :], mask=mm[:, None] & md[None, :],
                other=0)  # fmt: skip
    return bh, rm, mm, rd, md, q


@triton.jit
def _int8_attention_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, b_ptr, out_ptr, N, M, NQB, NKB, sm_scale,
                           D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           OUT_KIND: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    bh, rm, mm, rd, md, q = _query_tile(q_ptr, N, D, DP, BM)
    qs = tl.load(qs_ptr + bh * NQB + tl.program_id(0)) * sm_scale
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    for n0 in range(0, M, BN):
        rn = n0 + tl.arange(0, BN)
        mn = rn < M
        k = tl.load(k_ptr + bh * M * D + rn.to(tl.int64)[None, :] * D + rd[:, None], mask=mn[None, :] & md[:, None],
                    other=0)  # fmt: skip
        ks = tl.load(ks_ptr + bh * NKB + n0 // BN)
        s = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * (qs * ks)  # exact integer scores, then the scales
        p, alpha, m_new, l_i = _online_softmax(_scores(s, mn, b_ptr + bh * M, rn, HAS_BIAS), m_i, l_i)
        v = tl.load(v_ptr + bh * M * D + rn.to(tl.int64)[:, None] * D + rd[None, :], mask=mn[:, None] & md[None, :],
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v, out_dtype=tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    store_out(out_ptr + bh * N * D + rm.to(tl.int64)[:, None] * D + rd[None, :], out, mm[:, None] & md[None, :],
              OUT_KIND)  # fmt: skip


def padded_head_dim(d: int) -> int:
    """The head dim a kernel computes over: the next power of two, at least 32 (an 8-bit MMA's K step)."""
    return max(32, 1 << (d - 1).bit_length())


def _outputs(q_codes: torch.Tensor, k_codes: torch.Tensor, out_dtype: torch.dtype, label: str
             ) -> tuple[int, int, int, int, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(batch x heads, queries, keys, head dim, out [..., N, D] in `out_dtype`, what the kernel writes into: out, or
    its int16 view for BF16) of a call; a head dim the kernels do not take is refused."""
    *lead, n, d = q_codes.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"the {label} attention kernel takes head dims up to {MAX_HEAD_DIM}; got {d}")
    bh = math.prod(lead)
    out = torch.empty((*lead, n, d), dtype=out_dtype, device=q_codes.device)
    return bh, n, k_codes.shape[-2], d, out, out.view(torch.int16) if out_dtype == torch.bfloat16 else out


def _bias(key_bias: torch.Tensor | None, bh: int, m: int, unread: torch.Tensor) -> torch.Tensor:
    """The keys' additive bias as [bh, M] FP32; where there is none, `unread` (any FP32 tensor of the call) stands
    in for the pointer HAS_BIAS=False never reads, so no launch allocates a placeholder."""
    return unread if key_bias is None else key_bias.reshape(bh, m).float().contiguous()


def int8_attention(q_codes: torch.Tensor, q_scale: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                   v: torch.Tensor, sm_scale: float, out_dtype: torch.dtype, key_bias: torch.Tensor | None = None
                   ) -> torch.Tensor:  # fmt: skip
    """Attention of INT8 codes: q_codes [..., N, D] with one scale per 128 queries (q_scale [..., ceil(N/128)]),
    k_codes [..., M, D] (smoothed K) with one per 64 keys, v [..., M, D] (read as FP16), `key_bias` [..., M] added
    to every query's scores (a key-padding mask; -inf drops a key) -> out [..., N, D]."""
    bh, n, m, d, out, dst = _outputs(q_codes, k_codes, out_dtype, "INT8")
    if n == 0 or bh == 0:
        return out
    qs = q_scale.reshape(bh, -1).float().contiguous()
    ks = k_scale.reshape(bh, -1).float().contiguous()
    grid = (triton.cdiv(n, BM), bh)
    _int8_attention_kernel[grid](q_codes.reshape(bh, n, d).contiguous(), qs, k_codes.reshape(bh, m, d).contiguous(),
                                 ks, v.reshape(bh, m, d).to(torch.float16).contiguous(),
                                 _bias(key_bias, bh, m, qs), dst, n, m, qs.shape[1], ks.shape[1],
                                 float(sm_scale), D=d, DP=padded_head_dim(d), BM=BM, BN=BN,
                                 OUT_KIND=_OUT_KIND[out_dtype], HAS_BIAS=key_bias is not None,
                                 num_warps=4 if d <= 64 else 8, num_stages=2)  # fmt: skip
    return out


@triton.jit
def _fp8_attention_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, b_ptr, out_ptr, N, M, sm_scale,
                          P_ENC: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, OUT_KIND: tl.constexpr, HW_CAST: tl.constexpr,
                          HAS_BIAS: tl.constexpr):  # fmt: skip
    bh, rm, mm, rd, md, q = _query_tile(q_ptr, N, D, DP, BM)
    q = q.to(tl.float8e4nv, bitcast=True)
    qs = tl.load(qs_ptr + bh * N + rm, mask=mm, other=1.0) * sm_scale
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    for n0 in range(0, M, BN):
        rn = n0 + tl.arange(0, BN)
        mn = rn < M
        # K^T [D, BN] and V^T's tile [BN, D] are both read along their sum's dimension (K-major, as FP8 MMAs take it)
        k = tl.load(k_ptr + bh * M * D + rn.to(tl.int64)[None, :] * D + rd[:, None], mask=mn[None, :] & md[:, None],
                    other=0)  # fmt: skip
        ks = tl.load(ks_ptr + bh * M + rn, mask=mn, other=1.0)
        s = tl.dot(q, k.to(tl.float8e4nv, bitcast=True), out_dtype=tl.float32) * qs[:, None] * ks[None, :]
        p, alpha, m_new, l_i = _online_softmax(_scores(s, mn, b_ptr + bh * M, rn, HAS_BIAS), m_i, l_i)
        if HW_CAST:  # one cvt.rn.satfinite per two values: P * 448 lies in [0, 448], so it is fp8_encode's code
            pc = (p * P_ENC).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:  # the interpreter's fp32 -> e4m3 cast flushes subnormals: the bit-exact encode instead
            pc = fp8_encode(p, tl.full([BM], P_ENC, tl.float32)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        v = tl.load(v_ptr + bh * D * M + rd.to(tl.int64)[None, :] * M + rn[:, None], mask=mn[:, None] & md[None, :],
                    other=0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(pc, v.to(tl.float8e4nv, bitcast=True), out_dtype=tl.float32)
        m_i = m_new
    vs = tl.load(vs_ptr + bh * D + rd, mask=md, other=1.0) / P_ENC
    out = acc * vs[None, :] / l_i[:, None]
    store_out(out_ptr + bh * N * D + rm.to(tl.int64)[:, None] * D + rd[None, :], out, mm[:, None] & md[None, :],
              OUT_KIND)  # fmt: skip


def fp8_attention(q_codes: torch.Tensor, q_scale: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                  vt_codes: torch.Tensor, v_scale: torch.Tensor, sm_scale: float, out_dtype: torch.dtype,
                  p_encode: float = 448.0, key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of E4M3 codes (torch.float8_e4m3fn): q_codes [..., N, D] with one scale per query (q_scale
    [..., N, 1]), k_codes [..., M, D] with one per key, V transposed, vt_codes [..., D, M], with one per channel
    (v_scale [..., D, 1]), `key_bias` [..., M] added to every query's scores (a key-padding mask) -> out
    [..., N, D] in `out_dtype`; P encoded at `p_encode`."""
    bh, n, m, d, out, dst = _outputs(q_codes, k_codes, out_dtype, "FP8")
    if n == 0 or bh == 0:
        return out

    def codes(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return t.reshape(bh, rows, cols).contiguous().view(torch.uint8)

    def scales(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(bh, -1).float().contiguous()

    qs = scales(q_scale)
    grid = (triton.cdiv(n, BM), bh)
    _fp8_attention_kernel[grid](codes(q_codes, n, d), qs, codes(k_codes, m, d), scales(k_scale),
                                codes(vt_codes, d, m), scales(v_scale), _bias(key_bias, bh, m, qs), dst, n, m,
                                float(sm_scale), P_ENC=float(p_encode), D=d, DP=padded_head_dim(d), BM=BM, BN=BN,
                                OUT_KIND=_OUT_KIND[out_dtype], HW_CAST=os.environ.get("TRITON_INTERPRET", "0") != "1",
                                HAS_BIAS=key_bias is not None, num_warps=4 if d <= 64 else 8,
                                num_stages=2)  # fmt: skip
    return out
