"""NVFP4 Triton kernels: tensor amax, quantize, dequantize, one-pass fake-quant, and the random
Hadamard rotation on its own (the weight-only path rotates activations without quantizing them).

All work on the flat, contiguous tensor as a sequence of 16-element blocks (blocks never straddle a
row because the last dimension is a multiple of 16). The tensor scale is read from a device scalar,
never from the host, so the kernels can be captured in a CUDA graph. Numerics: docs/design.md section 4,
checked bit for bit against solrl_engine.quant.nvfp4.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._numerics import (
    EXACT,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_round_magnitude,
    global_encode_scale,
    is_finite,
    load_f32,
    store_out,
)

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _blocks_per_program() -> int:
    # The interpreter runs programs one by one in Python: fewer, larger programs are far faster.
    return 1024 if _interpreting() else 64


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, IN_BF16: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = load_f32(x_ptr + offs, offs < n, IN_BF16)
    a = tl.where(is_finite(x), tl.abs(x), 0.0)
    tl.atomic_max(amax_ptr, tl.max(a, axis=0))


@triton.jit
def _quantize_blocks(x, s_enc, g):
    """x: [NB, 16] fp32. Returns (codes int32 [NB, 16], scale byte int32 [NB], scale fp32 [NB])."""
    finite = tl.min(is_finite(x).to(tl.int32), axis=1) == 1
    blk_amax = tl.where(finite, tl.max(tl.abs(x), axis=1), 0.0)
    v = tl.minimum(blk_amax * (s_enc * 0.16666666666666666), 448.0)
    s_code, s_val = e4m3_round_magnitude(v)
    s_code = tl.where(finite, s_code, 0x7F)
    s_val = tl.where(finite, s_val, float("nan"))
    mult = tl.minimum(tl.div_rn(1.0, s_val * g), 3.4028234663852886e38)
    scaled = tl.minimum(tl.maximum(x * mult[:, None], -6.0), 6.0)
    # A non-finite block has a NaN scale; its codes are 0 (the reference gets there through NaN).
    codes = tl.where(finite[:, None], e2m1_encode(scaled), 0)
    return codes, s_code, s_val


@triton.jit
def _butterfly_stage(y, G: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One stage of the Walsh-Hadamard butterfly on [G, N]: (a, b) -> (a + b, a - b) for elements
    H apart, in pairs of 2H (the reference's order: solrl_engine.quant.hadamard)."""
    y = tl.permute(tl.reshape(y, [G, N // (2 * H), 2, H]), (0, 1, 3, 2))
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [G, N])


@triton.jit
def _rotate(x, d_ptr, inv_sqrt, NB: tl.constexpr, ROT: tl.constexpr):
    """x [NB, 16] (consecutive blocks of one tensor) rotated by D H / sqrt(ROT) per group of ROT."""
    G: tl.constexpr = NB * 16 // ROT
    y = tl.reshape(x, [G, ROT]) * tl.load(d_ptr + tl.arange(0, ROT))[None, :]
    y = _butterfly_stage(y, G, ROT, 1)
    y = _butterfly_stage(y, G, ROT, 2)
    y = _butterfly_stage(y, G, ROT, 4)
    y = _butterfly_stage(y, G, ROT, 8)
    if ROT >= 32:
        y = _butterfly_stage(y, G, ROT, 16)
    if ROT >= 64:
        y = _butterfly_stage(y, G, ROT, 32)
    if ROT >= 128:
        y = _butterfly_stage(y, G, ROT, 64)
    return tl.reshape(y * inv_sqrt, [NB, 16])


@triton.jit
def _pair_tree_sum16(v, NB: tl.constexpr):
    """Row sums of [NB, 16] by adjacent pairs (16 -> 8 -> 4 -> 2 -> 1), the reference's order."""
    a, b = tl.split(tl.reshape(v, [NB, 8, 2]))
    a, b = tl.split(tl.reshape(a + b, [NB, 4, 2]))
    a, b = tl.split(tl.reshape(a + b, [NB, 2, 2]))
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def _encode_with(x, s_val, g):
    mult = tl.minimum(tl.div_rn(1.0, s_val * g), 3.4028234663852886e38)
    return e2m1_encode(tl.minimum(tl.maximum(x * mult[:, None], -6.0), 6.0))


@triton.jit
def _four_over_six(x, codes, s_code, s_val, s_enc, g, NB: tl.constexpr):
    """Per block, the scale mapping the block max to 4 where its decode is closer (sum of squared
    errors; ties keep 6), as solrl_engine.quant.nvfp4._four_over_six."""
    finite = tl.min(is_finite(x).to(tl.int32), axis=1) == 1
    blk_amax = tl.where(finite, tl.max(tl.abs(x), axis=1), 0.0)
    c4, v4 = e4m3_round_magnitude(tl.minimum(blk_amax * (s_enc * 0.25), 448.0))
    v4 = tl.where(finite, v4, float("nan"))
    codes4 = tl.where(finite[:, None], _encode_with(x, v4, g), 0)
    d6 = (e2m1_decode(codes) * s_val[:, None]) * g - x
    d4 = (e2m1_decode(codes4) * v4[:, None]) * g - x
    use4 = _pair_tree_sum16(d4 * d4, NB) < _pair_tree_sum16(d6 * d6, NB)
    codes = tl.where(use4[:, None], codes4, codes)
    return codes, tl.where(use4, c4, s_code), tl.where(use4, v4, s_val)


@triton.jit
def _load_blocks(x_ptr, d_ptr, inv_sqrt, blk, bmask, NB: tl.constexpr, ROT: tl.constexpr, IN_BF16: tl.constexpr):
    offs = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = load_f32(x_ptr + offs, bmask[:, None], IN_BF16)
    if ROT > 0:
        x = _rotate(x, d_ptr, inv_sqrt, NB, ROT)
    return x, offs


@triton.jit
def _rot_amax_kernel(x_ptr, d_ptr, inv_sqrt, amax_ptr, n_blocks, NB: tl.constexpr, ROT: tl.constexpr,
                     IN_BF16: tl.constexpr):  # fmt: skip
    """The amax of the rotated tensor (the rotation is recomputed by the quantize kernel: no
    rotated copy ever reaches memory)."""
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB).to(tl.int64)
    x, _ = _load_blocks(x_ptr, d_ptr, inv_sqrt, blk, blk < n_blocks, NB, ROT, IN_BF16)
    a = tl.where(is_finite(x), tl.abs(x), 0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(a, axis=1), axis=0))


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    amax_ptr,
    g_ptr,
    d_ptr,
    inv_sqrt,
    n_blocks,
    NB: tl.constexpr,
    DEQUANT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    IN_BF16: tl.constexpr,
    ROT: tl.constexpr = 0,
    FOUR_OVER_SIX: tl.constexpr = False,
):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB).to(tl.int64)
    bmask = blk < n_blocks
    x, offs = _load_blocks(x_ptr, d_ptr, inv_sqrt, blk, bmask, NB, ROT, IN_BF16)
    s_enc = global_encode_scale(tl.load(amax_ptr))
    g = tl.div_rn(1.0, s_enc)
    codes, s_code, s_val = _quantize_blocks(x, s_enc, g)
    if FOUR_OVER_SIX:
        codes, s_code, s_val = _four_over_six(x, codes, s_code, s_val, s_enc, g, NB)
    if DEQUANT:
        # Fake-quant: decode in registers and write the input's dtype; codes never reach memory.
        out = (e2m1_decode(codes) * s_val[:, None]) * g
        store_out(q_ptr + offs, out, bmask[:, None], OUT_KIND)
    else:
        lo, hi = tl.split(tl.reshape(codes, [NB, 8, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        poffs = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(q_ptr + poffs, packed, mask=bmask[:, None])
        tl.store(s_ptr + blk, s_code.to(tl.uint8), mask=bmask)
        tl.store(g_ptr, g, mask=pid == 0)


@triton.jit
def _rotate_kernel(x_ptr, d_ptr, inv_sqrt, out_ptr, n_blocks, NB: tl.constexpr, ROT: tl.constexpr,
                   IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr):  # fmt: skip
    """x R alone (the same `_rotate` the quantize fuses), stored in OUT_KIND."""
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB).to(tl.int64)
    bmask = blk < n_blocks
    x, offs = _load_blocks(x_ptr, d_ptr, inv_sqrt, blk, bmask, NB, ROT, IN_BF16)
    store_out(out_ptr + offs, x, bmask[:, None], OUT_KIND)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, g_ptr, out_ptr, n_blocks, NB: tl.constexpr, OUT_KIND: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB).to(tl.int64)
    bmask = blk < n_blocks
    poffs = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    packed = tl.load(q_ptr + poffs, mask=bmask[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [NB, 16])
    s_val = e4m3_decode(tl.load(s_ptr + blk, mask=bmask, other=0).to(tl.int32))
    g = tl.load(g_ptr)
    out = (e2m1_decode(codes) * s_val[:, None]) * g
    offs = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    store_out(out_ptr + offs, out, bmask[:, None], OUT_KIND)


def _is_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16


def _src(x: torch.Tensor) -> torch.Tensor:
    """The kernel's view of an input: bf16 goes in as raw int16 bits (see load_f32)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _check(x: torch.Tensor) -> None:
    if x.shape[-1] % 16 != 0:
        raise ValueError(f"last dimension must be a multiple of 16; got shape {tuple(x.shape)}.")
    if x.dtype not in _OUT_KIND:
        raise TypeError(f"NVFP4 kernels take float32, bfloat16 or float16; got {x.dtype}.")


def amax(x: torch.Tensor) -> torch.Tensor:
    """Absolute max over finite elements as an fp32 device scalar (0-dim)."""
    x = x.contiguous()
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    block = 16384 if _interpreting() else 4096
    n = x.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, block),)](_src(x), out, n, BLOCK=block, IN_BF16=_is_bf16(x), **EXACT)
    return out


def _amax_arg(x: torch.Tensor, amax_value: torch.Tensor | float | None, rot: tuple[torch.Tensor, float] | None
              ) -> torch.Tensor:  # fmt: skip
    if amax_value is not None:
        return torch.as_tensor(amax_value, dtype=torch.float32, device=x.device).reshape(())
    if rot is None:
        return amax(x)
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    n_blocks = x.numel() // 16
    nb = _blocks_per_program()
    _rot_amax_kernel[(triton.cdiv(n_blocks, nb),)](_src(x), rot[0], rot[1], out, n_blocks, NB=nb,
                                                   ROT=rot[0].numel(), IN_BF16=_is_bf16(x), **EXACT)  # fmt: skip
    return out


def _rotation(x: torch.Tensor, rht_signs: torch.Tensor | None) -> tuple[torch.Tensor, float] | None:
    """(signs on x's device in FP32, 1/sqrt(n)) for a rotated quantize, checked; None without one."""
    if rht_signs is None:
        return None
    n = rht_signs.numel()
    if n not in (16, 32, 64, 128) or x.shape[-1] % n:
        raise ValueError(f"a {n}-point rotation needs a last dimension that is a multiple of it; got {tuple(x.shape)}")
    return rht_signs.to(x.device, torch.float32).contiguous(), float(torch.tensor(n**-0.5, dtype=torch.float32))


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, g: torch.Tensor, amax_value: torch.Tensor | float | None,
            dequant: bool, out_kind: int, four_over_six: bool, rht_signs: torch.Tensor | None) -> None:  # fmt: skip
    n_blocks = x.numel() // 16
    if not n_blocks:
        return
    nb = _blocks_per_program()
    rot = _rotation(x, rht_signs)
    am = _amax_arg(x, amax_value, rot)
    d, inv = rot if rot is not None else (am, 1.0)  # d_ptr is never read without a rotation
    _quantize_kernel[(triton.cdiv(n_blocks, nb),)](
        _src(x), q, s, am, g if not dequant else am, d, inv, n_blocks, NB=nb, DEQUANT=dequant, OUT_KIND=out_kind,
        IN_BF16=_is_bf16(x), ROT=0 if rot is None else rot[0].numel(), FOUR_OVER_SIX=four_over_six, **EXACT,
    )  # fmt: skip


def quantize(
    x: torch.Tensor,
    amax_value: torch.Tensor | float | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    four_over_six: bool = False,
    rht_signs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x -> (qdata uint8 [..., K/2], scale uint8 bytes of E4M3 [..., K/16], g fp32 0-dim).

    Without `amax_value` the amax kernel runs first (two launches, no host sync). `out` lets the
    caller pass existing buffers, which are written in place. `rht_signs` ([n] +-1) quantizes x
    rotated by the n-point random Hadamard transform (fused: the rotated x is never stored; a given
    `amax_value` is the rotated tensor's); `four_over_six` picks each block's 4- or 6-scale.
    """
    _check(x)
    x = x.contiguous()
    lead = x.shape[:-1]
    k = x.shape[-1]
    if out is None:
        q = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
        s = torch.empty((*lead, k // 16), dtype=torch.uint8, device=x.device)
        g = torch.empty((), dtype=torch.float32, device=x.device)
    else:
        q, s, g = out
    _launch(x, q, s, g, amax_value, False, 0, four_over_six, rht_signs)
    return q, s, g


def fake_quantize(
    x: torch.Tensor,
    amax_value: torch.Tensor | float | None = None,
    four_over_six: bool = False,
    rht_signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize and dequantize in one pass: same shape and dtype as x, no codes in memory (with
    `rht_signs`, the result stays in the rotated basis)."""
    _check(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    dst = out.view(torch.int16) if x.dtype == torch.bfloat16 else out
    _launch(x, dst, dst, dst, amax_value, True, _OUT_KIND[x.dtype], four_over_six, rht_signs)
    return out


def rotate(x: torch.Tensor, rht_signs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x R along the last dimension (R = D H / sqrt(n), n = len(rht_signs)), computed in FP32 and
    stored as `dtype`: bit for bit solrl_engine.quant.hadamard.rotate(x, signs).to(dtype)."""
    _check(x)
    if dtype not in _OUT_KIND:
        raise TypeError(f"rotate writes float32, bfloat16 or float16; got {dtype}.")
    x = x.contiguous()
    d, inv = _rotation(x, rht_signs)  # type: ignore[misc]
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n_blocks = x.numel() // 16
    if n_blocks:
        nb = _blocks_per_program()
        dst = out.view(torch.int16) if dtype == torch.bfloat16 else out
        _rotate_kernel[(triton.cdiv(n_blocks, nb),)](_src(x), d, inv, dst, n_blocks, NB=nb, ROT=d.numel(),
                                                     IN_BF16=_is_bf16(x), OUT_KIND=_OUT_KIND[dtype],
                                                     **EXACT)  # fmt: skip
    return out


def dequantize(
    qdata: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Decode NVFP4 (scale given as E4M3 or its uint8 bytes) to `dtype`."""
    if dtype not in _OUT_KIND:
        raise TypeError(f"dequantize writes float32, bfloat16 or float16; got {dtype}.")
    qdata = qdata.contiguous()
    s = scale.contiguous().view(torch.uint8)
    out = torch.empty((*qdata.shape[:-1], qdata.shape[-1] * 2), dtype=dtype, device=qdata.device)
    n_blocks = out.numel() // 16
    if n_blocks:
        nb = _blocks_per_program()
        dst = out.view(torch.int16) if dtype == torch.bfloat16 else out
        g = global_scale.to(torch.float32).reshape(())
        _dequantize_kernel[(triton.cdiv(n_blocks, nb),)](qdata, s, g, dst, n_blocks, NB=nb, OUT_KIND=_OUT_KIND[dtype],
                                                         **EXACT)
    return out
