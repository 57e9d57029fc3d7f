"""FP8 E4M3 row-wise (per-token / per-channel) quantize kernel, bit-exact with
solrl_engine.quant.fp8.quantize_rowwise.

One program per row: a first sweep finds the row's finite amax, a second encodes (the row is hot in
cache by then). E4M3 rounding is done with integer bit operations (see _numerics).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._numerics import EXACT, fp8_encode, fp8_row_factors, is_finite, load_f32

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _fp8_rowwise_kernel(x_ptr, q_ptr, scale_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        IN_BF16: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = rows[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = load_f32(x_ptr + base + offs[None, :], rmask[:, None] & (offs < K)[None, :], IN_BF16)
        acc = tl.maximum(acc, tl.where(is_finite(x), tl.abs(x), 0.0))
    enc, dec = fp8_row_factors(tl.max(acc, axis=1))
    tl.store(scale_ptr + rows, dec, mask=rmask)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (offs < K)[None, :]
        x = load_f32(x_ptr + base + offs[None, :], m, IN_BF16)
        tl.store(q_ptr + base + offs[None, :], fp8_encode(x, enc).to(tl.uint8), mask=m)


def _row_blocks(k: int, interp: bool) -> tuple[int, int]:
    """(rows per program, K per sweep): short rows are handled several to a program (the CPU
    interpreter pays per program; a GPU wastes lanes on a lone short row)."""
    block_k = min(triton.next_power_of_2(k), 8192 if interp else 2048)
    return max(1, min(64, (8192 if interp else 2048) // block_k)), block_k


def launch_rowwise(
    kernel: object, x: torch.Tensor, code_dtype: torch.dtype, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check `x`, allocate the codes and [..., 1] FP32 scales, and run a row-wise quantize `kernel`
    (arguments: x, codes, scales, rows, K, BLOCK_M, BLOCK_K, IN_BF16) over every row."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"{fmt} quantize takes float32, bfloat16 or float16; got {x.dtype}.")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"row-wise {fmt} needs a non-empty last dimension; got shape {tuple(x.shape)}.")
    x = x.contiguous()
    k = x.shape[-1]
    rows = x.numel() // k
    q = torch.empty(x.shape, dtype=code_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if rows:
        block_m, block_k = _row_blocks(k, os.environ.get("TRITON_INTERPRET", "0") == "1")
        src = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        kernel[(triton.cdiv(rows, block_m),)](src, q, scale, rows, k, BLOCK_M=block_m, BLOCK_K=block_k,  # type: ignore[index]
                                              IN_BF16=x.dtype == torch.bfloat16, **EXACT)  # fmt: skip
    return q, scale


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E4M3 data [..., K] as torch.float8_e4m3fn, fp32 decode scales [..., 1])."""
    q, scale = launch_rowwise(_fp8_rowwise_kernel, x, torch.uint8, "FP8")
    return q.view(torch.float8_e4m3fn), scale
