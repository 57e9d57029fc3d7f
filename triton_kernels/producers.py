"""The quantize where its input is made: a producer's norm and modulation (`adaln_quantize`; a weighted RMS norm
times its scale: `rms_quantize`), an FFN's GELU (`gelu_quantize`) or a gated FFN's gate (`glu_quantize`), and the
8-bit row-wise codes of what it produces, in one pass over each row.

An adaLN-Zero producer (diffusers' AdaLayerNormZero, AdaLayerNormZeroSingle) computes
y = layer_norm(x) * (1 + scale) + shift, and every linear it feeds (to_q, to_k, to_v, proj_mlp) quantizes y per
row. Here one program holds whole rows: it normalises, modulates, writes y where another op reads it (STORE_Y;
none does where every consumer takes the codes) and the FP8 or INT8 codes and scales of y (quant.fp8 /
quant.int8's row-wise contract, bit for bit given y), so the consumers take the codes instead of quantizing y
again, each. The norm's mean and variance are two-pass FP32 sums (they
agree with PyTorch's layer_norm to FP32 rounding, not bit for bit); with STAGE_BF16 each step is rounded to BF16
as PyTorch's BF16 ops round them (the producer running in BF16 outside autocast). A BF16 y is quantized as stored:
a block that computes y in FP32 and casts it to BF16 (SANA, Wan) gets the codes of its BF16 y.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._numerics import (
    EXACT,
    fp8_encode,
    fp8_row_factors,
    int8_encode,
    int8_row_scale,
    is_finite,
    load_f32,
    round_bf16,
    store_out,
)

MAX_K = 16384  # whole rows live in one program's registers
FORMATS = {"fp8": 0, "int8": 1}
_Y_KIND = {torch.float32: 0, torch.bfloat16: 1}


@triton.jit
def _row_tile(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's rows (whole rows of K values): (row ids, column ids, row mask, element mask, offsets)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < M
    m = rmask[:, None] & (cols < K)[None, :]
    return rows, cols, rmask, m, rows[:, None] * K + cols[None, :]


@triton.jit
def _adaln_quantize_kernel(x_ptr, onep_ptr, shift_ptr, y_ptr, q_ptr, scale_ptr, M, K, T, eps,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IN_BF16: tl.constexpr,
                           STAGE_BF16: tl.constexpr, Y_KIND: tl.constexpr, FMT: tl.constexpr,
                           STORE_Y: tl.constexpr):  # fmt: skip
    rows, cols, rmask, m, offs = _row_tile(M, K, BLOCK_M, BLOCK_K)
    x = load_f32(x_ptr + offs, m, IN_BF16)
    kf = tl.full([BLOCK_M], K, tl.float32)
    mean = tl.div_rn(tl.sum(x, axis=1), kf)
    d = tl.where(m, x - mean[:, None], 0.0)
    var = tl.div_rn(tl.sum(d * d, axis=1), kf)
    rstd = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(var + eps))
    n = d * rstd[:, None]
    moffs = (rows // T)[:, None] * K + cols[None, :]  # the modulation row of each row's sample
    onep = tl.load(onep_ptr + moffs, mask=m, other=0.0)
    shift = tl.load(shift_ptr + moffs, mask=m, other=0.0)
    if STAGE_BF16:
        n = round_bf16(n)
        y = round_bf16(round_bf16(n * onep) + shift)
    else:
        y = n * onep + shift  # two roundings (EXACT: no FMA), as the module's mul then add
    if Y_KIND == 1:  # a BF16 y (the block casts the FP32 result to its activations' dtype): codes of what it stores
        y = round_bf16(y)
    if STORE_Y:  # y for a reader beside the codes' (none: the consumers take the codes alone)
        store_out(y_ptr + offs, y, m, Y_KIND)
    _store_codes(y, m, rmask, rows, offs, q_ptr, scale_ptr, FMT)


@triton.jit
def _rms_quantize_kernel(x_ptr, w_ptr, scale_ptr_in, y_ptr, q_ptr, scale_ptr, M, K, T, eps, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, IN_BF16: tl.constexpr, HAS_W: tl.constexpr, W_BF16: tl.constexpr,
                         HAS_SCALE: tl.constexpr, S_BF16: tl.constexpr, Y_KIND: tl.constexpr,
                         FMT: tl.constexpr, STORE_Y: tl.constexpr):  # fmt: skip
    # diffusers' RMSNorm (mean square in FP32, x times its reciprocal root, rounded to a BF16 weight's dtype before
    # the weight multiplies), then times the sample's modulation scale, each product rounded as PyTorch rounds it
    rows, cols, rmask, m, offs = _row_tile(M, K, BLOCK_M, BLOCK_K)
    x = load_f32(x_ptr + offs, m, IN_BF16)
    kf = tl.full([BLOCK_M], K, tl.float32)
    var = tl.div_rn(tl.sum(x * x, axis=1), kf)
    r = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(var + eps))
    h = x * r[:, None]
    if HAS_W:
        w = load_f32(w_ptr + cols[None, :], (cols < K)[None, :], W_BF16)
        if W_BF16:  # h cast to the weight's BF16, the product in BF16
            h = round_bf16(round_bf16(h) * w)
        else:
            h = h * w
    elif IN_BF16:  # no weight: the norm returns x's dtype
        h = round_bf16(h)
    if HAS_SCALE:
        s = load_f32(scale_ptr_in + (rows // T)[:, None] * K + cols[None, :], m, S_BF16)
        h = h * s
        if Y_KIND == 1:  # both BF16: the product rounded to BF16
            h = round_bf16(h)
    if STORE_Y:
        store_out(y_ptr + offs, h, m, Y_KIND)
    _store_codes(h, m, rmask, rows, offs, q_ptr, scale_ptr, FMT)


@triton.jit
def _store_codes(y, m, rmask, rows, offs, q_ptr, scale_ptr, FMT: tl.constexpr):
    """The row-wise FP8 (FMT 0) or INT8 (FMT 1) codes and scales of the rows y [BLOCK_M, BLOCK_K] (masked by m)."""
    fin = is_finite(y)
    amax = tl.max(tl.where(m & fin, tl.abs(y), 0.0), axis=1)
    if FMT == 0:
        enc, dec = fp8_row_factors(amax)
        tl.store(scale_ptr + rows, dec, mask=rmask)
        tl.store(q_ptr + offs, fp8_encode(y, enc).to(tl.uint8), mask=m)
    else:
        s = int8_row_scale(amax, tl.max(tl.where(m & ~fin, 1, 0), axis=1) > 0)
        tl.store(scale_ptr + rows, s, mask=rmask)
        tl.store(q_ptr + offs, int8_encode(y, s), mask=m)


@triton.jit
def _gelu_quantize_kernel(x_ptr, p_ptr, y_ptr, q_ptr, scale_ptr, M, K, KP, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr, IN_BF16: tl.constexpr, Y_KIND: tl.constexpr,
                          FMT: tl.constexpr, STORE_Y: tl.constexpr):  # fmt: skip
    # a row of y is the prefix's KP values (none where KP is 0) then the GELU of x's K - KP values
    rows, cols, rmask, m, offs = _row_tile(M, K, BLOCK_M, BLOCK_K)
    pre = (cols < KP)[None, :]
    x = load_f32(x_ptr + rows[:, None] * (K - KP) + (cols - KP)[None, :], m & ~pre, IN_BF16)
    # PyTorch's tanh GELU in its order: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), in FP32
    inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
    t = 1.0 - tl.div_rn(tl.full(x.shape, 2.0, tl.float32), tl.exp(2.0 * inner) + 1.0)
    y = 0.5 * x * (1.0 + t)
    if KP > 0:
        y = tl.where(pre, load_f32(p_ptr + rows[:, None] * KP + cols[None, :], m & pre, IN_BF16), y)
    if Y_KIND == 1:  # a BF16 activation: the codes of what it stores
        y = round_bf16(y)
    if STORE_Y:  # y for a reader beside the codes' (none: the consumers take the codes alone)
        store_out(y_ptr + offs, y, m, Y_KIND)
    _store_codes(y, m, rmask, rows, offs, q_ptr, scale_ptr, FMT)


@triton.jit
def _glu_quantize_kernel(f_ptr, s_ptr, p_ptr, y_ptr, q_ptr, scale_ptr, M, K, KP, RS, S_OFF, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, IN_BF16: tl.constexpr, Y_KIND: tl.constexpr, GATE_FIRST: tl.constexpr,
                         FMT: tl.constexpr, STORE_Y: tl.constexpr):  # fmt: skip
    # a row of y is the prefix's KP values (none where KP is 0) then a * silu(g) of the row's two halves [a, g]
    # ([g, a] with GATE_FIRST), each K - KP values: the first at f_ptr, the second S_OFF further from s_ptr, rows
    # RS apart (one tensor's two halves: RS = 2 (K - KP), S_OFF = K - KP; two tensors: RS = K - KP, S_OFF = 0)
    rows, cols, rmask, m, offs = _row_tile(M, K, BLOCK_M, BLOCK_K)
    pre = (cols < KP)[None, :]
    xoffs = rows[:, None] * RS + (cols - KP)[None, :]
    first = load_f32(f_ptr + xoffs, m & ~pre, IN_BF16)
    second = load_f32(s_ptr + xoffs + S_OFF, m & ~pre, IN_BF16)
    if GATE_FIRST:
        a, g = second, first
    else:
        a, g = first, second
    s = tl.div_rn(g, 1.0 + tl.exp(-g))  # PyTorch's silu: x / (1 + exp(-x)) in FP32
    if IN_BF16:  # silu's BF16 result, then the BF16 product: each rounded as PyTorch's BF16 ops round
        s = round_bf16(s)
    y = a * s
    if KP > 0:
        y = tl.where(pre, load_f32(p_ptr + rows[:, None] * KP + cols[None, :], m & pre, IN_BF16), y)
    if Y_KIND == 1:
        y = round_bf16(y)
    if STORE_Y:  # y for a reader beside the codes' (none: the consumers take the codes alone)
        store_out(y_ptr + offs, y, m, Y_KIND)
    _store_codes(y, m, rmask, rows, offs, q_ptr, scale_ptr, FMT)


def adaln_quantize(
    x: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor, eps: float, fmt: str, stage_bf16: bool,
    y_dtype: torch.dtype, store_y: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, K] (FP32 or BF16), the modulation [B, K] (FP32 values) -> (y [B, T, K] as `y_dtype`, codes [B, T, K],
    FP32 decode scales [B, T, 1]) with y = layer_norm(x) * one_plus_scale + shift (rounded to `y_dtype`) and the codes
    that y's row-wise `fmt` ("fp8": E4M3 bytes viewed as float8_e4m3fn; "int8"). Without `store_y`, y is never
    written (its memory is uninitialised: for consumers that take the codes alone)."""
    if fmt not in FORMATS:
        raise ValueError(f"adaln_quantize emits {tuple(FORMATS)} codes; got {fmt!r}")
    b, t, k = x.shape
    if k > MAX_K or x.dtype not in _Y_KIND or y_dtype not in _Y_KIND:
        raise ValueError(f"adaln_quantize takes rows of at most {MAX_K} FP32/BF16 values; got {k} of {x.dtype}")
    x = x.contiguous()
    onep, shift = (v.float().contiguous().reshape(b, k) for v in (one_plus_scale, shift))
    y, q, scale = _outputs(x, k, fmt, y_dtype)
    rows = b * t
    if rows:
        block_m, block_k, warps = _tiles(k)
        _adaln_quantize_kernel[(triton.cdiv(rows, block_m),)](
            _bits(x), onep, shift, _bits(y), q, scale, rows, k, t, eps, BLOCK_M=block_m, BLOCK_K=block_k,
            IN_BF16=x.dtype == torch.bfloat16, STAGE_BF16=stage_bf16, Y_KIND=_Y_KIND[y_dtype], FMT=FORMATS[fmt],
            STORE_Y=store_y, **warps, **EXACT,
        )
    return _returned(y, q, scale, fmt)


def rms_quantize(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None, fmt: str,
                 y_dtype: torch.dtype, store_y: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [B, T, K], an RMS norm's weight [K] (or none), a modulation scale [B, K] (or none), all FP32 or BF16 ->
    (y [B, T, K] as `y_dtype`, its row-wise `fmt` codes, FP32 decode scales [B, T, 1]) with y = RMSNorm(x) * scale
    as diffusers' RMSNorm and the block compute it (`y_dtype`: their result's dtype, quant.producers.rms_scaled).
    `store_y` as adaln_quantize's."""
    if fmt not in FORMATS:
        raise ValueError(f"rms_quantize emits {tuple(FORMATS)} codes; got {fmt!r}")
    b, t, k = x.shape
    dts = [x.dtype, y_dtype] + [v.dtype for v in (weight, scale) if v is not None]
    if k > MAX_K or any(d not in _Y_KIND for d in dts):
        raise ValueError(f"rms_quantize takes rows of at most {MAX_K} FP32/BF16 values; got {k} of {dts}")
    x = x.contiguous()
    w = x if weight is None else weight.contiguous()
    sc = x if scale is None else scale.contiguous().reshape(b, k)
    y, q, out_scale = _outputs(x, k, fmt, y_dtype)
    rows = b * t
    if rows:
        block_m, block_k, warps = _tiles(k)
        _rms_quantize_kernel[(triton.cdiv(rows, block_m),)](
            _bits(x), _bits(w), _bits(sc), _bits(y), q, out_scale, rows, k, t, eps, BLOCK_M=block_m,
            BLOCK_K=block_k, IN_BF16=x.dtype == torch.bfloat16, HAS_W=weight is not None,
            W_BF16=w.dtype == torch.bfloat16, HAS_SCALE=scale is not None, S_BF16=sc.dtype == torch.bfloat16,
            Y_KIND=_Y_KIND[y_dtype], FMT=FORMATS[fmt], STORE_Y=store_y, **warps, **EXACT,
        )
    return _returned(y, q, out_scale, fmt)


def _tiles(k: int) -> tuple[int, int, dict[str, int]]:
    """(rows per program, the row's power-of-two width, launch options): whole rows, one per program on a GPU."""
    block_k = triton.next_power_of_2(k)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return max(1, min(64, 8192 // block_k)), block_k, {}
    return 1, block_k, {"num_warps": max(1, min(16, block_k // 256))}


def _outputs(x: torch.Tensor, k: int, fmt: str, y_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A producer's outputs for x's rows: y [..., k] in `y_dtype`, its `fmt` codes (FP8 as their bytes), FP32 decode
    scales [..., 1]."""
    y = torch.empty((*x.shape[:-1], k), dtype=y_dtype, device=x.device)
    q = torch.empty(y.shape, dtype=torch.uint8 if fmt == "fp8" else torch.int8, device=x.device)
    return y, q, torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


def _returned(y: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales) with FP8 codes viewed as float8_e4m3fn."""
    return y, (q.view(torch.float8_e4m3fn) if fmt == "fp8" else q), scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A BF16 tensor as its int16 bits (the kernels widen and round BF16 themselves), any other as it is."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def gelu_quantize(x: torch.Tensor, fmt: str, prefix: torch.Tensor | None = None, store_y: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [..., K] (FP32 or BF16) -> (y = gelu(x, approximate="tanh") in x's dtype, y's row-wise `fmt` codes [..., K],
    FP32 decode scales [..., 1]): an FFN's activation and the codes of the linear it feeds, in one pass. `prefix`
    [..., KP] (x's dtype): y = cat([prefix, gelu(x)], -1), the codes of the whole row (FLUX.1's single block, whose
    output projection reads its attention's output beside its MLP's activation). `store_y` as adaln_quantize's."""
    if fmt not in FORMATS:
        raise ValueError(f"gelu_quantize emits {tuple(FORMATS)} codes; got {fmt!r}")
    kp = 0 if prefix is None else prefix.shape[-1]
    k = x.shape[-1] + kp
    if k > MAX_K or x.dtype not in _Y_KIND or (prefix is not None and prefix.dtype != x.dtype):
        raise ValueError(f"gelu_quantize takes rows of at most {MAX_K} FP32/BF16 values (a prefix of x's dtype); got "
                         f"{k} of {x.dtype}")  # fmt: skip
    x = x.contiguous()
    p = x if prefix is None else prefix.contiguous()
    y, q, scale = _outputs(x, k, fmt, x.dtype)
    rows = y.numel() // k if k else 0
    if rows:
        block_m, block_k, warps = _tiles(k)
        _gelu_quantize_kernel[(triton.cdiv(rows, block_m),)](
            _bits(x), _bits(p), _bits(y), q, scale, rows, k, kp, BLOCK_M=block_m, BLOCK_K=block_k,
            IN_BF16=x.dtype == torch.bfloat16, Y_KIND=_Y_KIND[x.dtype], FMT=FORMATS[fmt], STORE_Y=store_y, **warps,
            **EXACT,
        )
    return _returned(y, q, scale, fmt)


def glu_quantize(x: torch.Tensor, fmt: str, gate_first: bool = False, prefix: torch.Tensor | None = None,
                 second: torch.Tensor | None = None, store_y: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [..., 2H] (FP32 or BF16) -> (y = a * silu(g) for x = cat([a, g], -1) (cat([g, a]) with `gate_first`), in
    x's dtype [..., H], y's row-wise `fmt` codes [..., H], FP32 decode scales [..., 1]): a gated FFN's gate (SANA's
    GLUMBConv, rows = pixels; FLUX.2's SwiGLU) and the codes of the linear it feeds, in one pass. `second`
    [..., H] (x then [..., H] too): the halves are x and `second` (Z-Image's SwiGLU of two linears). `prefix`
    [..., KP] (x's dtype): y = cat([prefix, a * silu(g)], -1), the codes of the whole row (FLUX.2's single block).
    x is read as contiguous rows (a channels-last NCHW tensor's pixel rows are: no copy). `store_y` as
    adaln_quantize's."""
    if fmt not in FORMATS:
        raise ValueError(f"glu_quantize emits {tuple(FORMATS)} codes; got {fmt!r}")
    h = x.shape[-1] if second is not None else x.shape[-1] // 2
    kp = 0 if prefix is None else prefix.shape[-1]
    k = h + kp
    odd = second is None and x.shape[-1] % 2
    others = [v for v in (prefix, second) if v is not None]
    if odd or k > MAX_K or x.dtype not in _Y_KIND or any(v.dtype != x.dtype for v in others) or (
            second is not None and second.shape != x.shape):  # fmt: skip
        raise ValueError(f"glu_quantize gates two halves (x's, or x and a second of its shape) into at most {MAX_K} "
                         f"FP32/BF16 values (a prefix and a second of x's dtype); got {tuple(x.shape)} of "
                         f"{x.dtype}")  # fmt: skip
    x = x.contiguous()
    sec = x if second is None else second.contiguous()
    p = x if prefix is None else prefix.contiguous()
    y, q, scale = _outputs(x, k, fmt, x.dtype)
    rows = y.numel() // k if k else 0
    if rows:
        block_m, block_k, warps = _tiles(k)
        rs, s_off = (2 * h, h) if second is None else (h, 0)
        _glu_quantize_kernel[(triton.cdiv(rows, block_m),)](
            _bits(x), _bits(sec), _bits(p), _bits(y), q, scale, rows, k, kp, rs, s_off, BLOCK_M=block_m,
            BLOCK_K=block_k, IN_BF16=x.dtype == torch.bfloat16, Y_KIND=_Y_KIND[x.dtype], GATE_FIRST=gate_first,
            FMT=FORMATS[fmt], STORE_Y=store_y, **warps, **EXACT,
        )
    return _returned(y, q, scale, fmt)
