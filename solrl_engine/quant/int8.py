"""INT8 reference numerics (pure PyTorch) for the Ampere explore precision (W8A8, symmetric).

Why INT8: Ampere (A100, RTX 30xx) has INT8 tensor cores at twice its BF16 rate and no FP8 or FP4 ones,
so INT8 is the only explore format that is faster than the policy there (docs/design.md section 2).

The contract (every implementation meets it; `torch._int_mm` accumulates exactly in INT32):
    amax  = max |x| over the row's finite values         (a row: one token, or one output channel of W)
    scale = amax / 127 (FP32), at least the smallest FP32 subnormal; 1.0 for an all-zero row
    q     = round_half_even(clamp(x / scale, -127, 127))  as int8 (-128 is never used: symmetric)
    y     = float32(sum_k qx[m,k] qw[n,k]) * sx[m] * sw[n] (+ bias), in that order, in FP32
A row holding a NaN or an Inf gets a NaN scale (its codes are 0), so what it produces is NaN: a
non-finite input never becomes a finite output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solrl_engine.quant.formats import Numerics
from solrl_engine.quant.fp8 import FP8Tensor

QMAX = 127.0
TINY = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps  # the smallest subnormal


@dataclass
class Int8Tensor(FP8Tensor):
    """int8 codes with FP32 decode scales broadcastable against them ([..., 1] per row): FP8Tensor's
    layout and decode (x' = float(q) * scale), other codes."""


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """The decode scale of each row of the last dimension ([..., 1], FP32), NaN for a non-finite row."""
    xf = x.detach().float()
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), torch.zeros((), device=xf.device)).amax(dim=-1, keepdim=True)
    s = torch.clamp(amax / QMAX, min=TINY)
    s = torch.where(amax == 0, torch.ones((), device=xf.device), s)
    return torch.where(finite.all(dim=-1, keepdim=True), s, torch.full((), float("nan"), device=xf.device))


def encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of `x` at `scale` (codes of a NaN-scale row are 0)."""
    q = torch.round(torch.clamp(x.detach().float() / scale, -QMAX, QMAX))  # torch.round: half to even
    return torch.nan_to_num(q, nan=0.0).to(torch.int8)


def quantize_rowwise(x: torch.Tensor) -> Int8Tensor:
    """One symmetric scale per row of the last dimension (scale shape [..., 1])."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"row-wise INT8 needs a non-empty last dimension; got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise TypeError(f"INT8 quantizes floating-point tensors; got {x.dtype}.")
    s = row_scales(x)
    return Int8Tensor(encode(x, s), s, x.dtype)


def fake_quantize_rowwise(x: torch.Tensor) -> torch.Tensor:
    """Row-wise quantize then dequantize, same dtype as `x`."""
    return quantize_rowwise(x).dequantize(x.dtype)


def scale_epilogue(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The GEMM's epilogue: float32(acc) * x_scale[m] * w_scale[n] (+ bias) -> out_dtype, in that order."""
    y = acc.float() * x_scale.reshape(-1, 1).float() * w_scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
    xq: Int8Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + b with x and W row-wise INT8: the exact integer GEMM (in float64, exact for any K
    below 2^39), then the epilogue. The oracle the `_int_mm` path is tested against. `xq`: x's row-wise
    codes made already (by x's producer), [M, K] rows and [M, 1] scales."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = quantize_rowwise(x2) if xq is None else xq
    acc = xq.data.double() @ weight.data.double().t()
    y = scale_epilogue(acc, xq.scale, weight.scale, bias, out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# --- attention: SageAttention's recipe (INT8 Q K^T under per-block scales, K smoothed, P V in FP16) -----------

Q_BLOCK, K_BLOCK = 128, 64  # tokens per scale block of Q and of K: the Triton kernel's tiles (solrl_triton.attention)


def quantize_blocks(x: torch.Tensor, block: int) -> Int8Tensor:
    """x [..., tokens, d] -> INT8 codes [..., tokens, d] with one FP32 scale per `block` tokens ([..., blocks]):
    the row-wise rule (amax / 127, round half even, NaN for a non-finite block) over each block's values."""
    *lead, n, d = x.shape
    nb = -(-n // block)
    xf = torch.nn.functional.pad(x.detach().float(), (0, 0, 0, nb * block - n))  # zero rows: amax unchanged
    blocks = xf.reshape(*lead, nb, block * d)
    s = row_scales(blocks)
    codes = encode(blocks, s).reshape(*lead, nb * block, d)[..., :n, :]
    return Int8Tensor(codes, s.squeeze(-1), x.dtype)


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    """K minus its mean over the tokens (per batch and head), in FP32: softmax(q k^T) is unchanged (each query's
    scores move by one constant), and the channel-wise offset that dominates K's range leaves its INT8 codes."""
    kf = k.detach().float()
    return kf - kf.mean(dim=-2, keepdim=True)


def attention_rounding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SageAttention's operands, emulated: Q in INT8 per 128-token block, K smoothed then INT8 per 64-token block
    (both decoded), V in FP16; returned in q's dtype (v in FP16 values), for any attention kernel to consume."""
    qd = _block_decode(quantize_blocks(q, Q_BLOCK), Q_BLOCK).to(q.dtype)
    kd = _block_decode(quantize_blocks(smooth_k(k), K_BLOCK), K_BLOCK).to(k.dtype)
    return qd, kd, v.to(torch.float16).to(v.dtype)


def _block_decode(t: Int8Tensor, block: int) -> torch.Tensor:
    """Decode per-block codes: codes * the scale of their block."""
    n = t.data.shape[-2]
    scale = t.scale.repeat_interleave(block, dim=-1)[..., :n].unsqueeze(-1)
    return t.data.float() * scale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The reference of the INT8 attention kernel ([..., tokens, d] each): S = float32(exact integer Qc Kc^T) *
    q_scale * k_scale * scale (+ `key_bias` [..., keys], a key-padding mask: every query's scores), softmax in FP32,
    P in FP16 times V in FP16 summed in FP32; out in q's dtype."""
    d = q.shape[-1]
    sc = d**-0.5 if scale is None else scale
    qt, kt = quantize_blocks(q, Q_BLOCK), quantize_blocks(smooth_k(k), K_BLOCK)
    acc = qt.data.double() @ kt.data.double().transpose(-1, -2)  # exact integer sums
    n, m = q.shape[-2], k.shape[-2]
    sq = qt.scale.repeat_interleave(Q_BLOCK, dim=-1)[..., :n].unsqueeze(-1)
    sk = kt.scale.repeat_interleave(K_BLOCK, dim=-1)[..., :m].unsqueeze(-2)
    s = acc.float() * sq * sk * sc
    if key_bias is not None:
        s = s + key_bias.float().unsqueeze(-2)
    p = torch.softmax(s, dim=-1)
    return (p.half().float() @ v.half().float()).to(q.dtype)


# W8A8 only: a weight-only INT8 buys nothing over fp8_weight_only's exact-in-BF16 weights
NUMERICS = Numerics("int8", "INT8", 8, lambda k, n: k * n + 4 * n, weight_only=False, attention=attention_rounding,
                    rowwise=quantize_rowwise)
