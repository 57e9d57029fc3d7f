"""Public ops, each with its implementations per backend; `dispatch` picks one per call.

Every op has a reference implementation (solrl_engine.quant) that the others are tested against.
"""

from __future__ import annotations

import torch

from solrl_engine.kernels.dispatch import _warn_once, call, cuda_extension, register, triton_module
from solrl_engine.quant import fp8, hadamard, int8, nvfp4
from solrl_engine.quant.fp8 import FP8Tensor
from solrl_engine.quant.int8 import Int8Tensor
from solrl_engine.quant.nvfp4 import NVFP4Tensor

AmaxLike = float | torch.Tensor | None


# --- NVFP4 quantize ------------------------------------------------------------------------------


def _checked_amax(x: torch.Tensor, amax: AmaxLike) -> AmaxLike:
    """The reference's input checks for the Triton path; a given amax as a validated device scalar."""
    nvfp4.check_input(x)
    return None if amax is None else nvfp4.resolve_amax(amax, x)


def _ref_quantize(
    x: torch.Tensor, amax: AmaxLike = None, four_over_six: bool = False, rht_signs: torch.Tensor | None = None
) -> NVFP4Tensor:
    """The reference quantize, of x rotated by the Hadamard transform when `rht_signs` is given."""
    xr = x if rht_signs is None else hadamard.rotate(x, rht_signs)
    t = nvfp4.quantize(xr, amax, four_over_six)
    t.orig_dtype = x.dtype
    return t


def _tr_quantize(
    x: torch.Tensor, amax: AmaxLike = None, four_over_six: bool = False, rht_signs: torch.Tensor | None = None
) -> NVFP4Tensor:
    if rht_signs is not None:
        hadamard.check_size(rht_signs.numel(), x.shape[-1])
    q, s, g = triton_module("nvfp4").quantize(x, _checked_amax(x, amax), four_over_six=four_over_six,
                                              rht_signs=rht_signs)  # fmt: skip
    return NVFP4Tensor(q, s.view(torch.float8_e4m3fn), g, x.dtype)


def cuda_quantize(
    x: torch.Tensor,
    amax: AmaxLike = None,
    swizzle: bool = False,
    four_over_six: bool = False,
    rht_signs: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """The extension's one-launch quantize (amax fused); `swizzle` writes cuBLASLt/CUTLASS's scale layout.
    The extension implements the TE recipe only: a rotation or 4-over-6 runs the Triton kernel (logged once)."""
    if four_over_six or rht_signs is not None:
        if swizzle:
            raise ValueError("the swizzled-scale quantize implements the TE recipe only (no rht / four_over_six)")
        _warn_once("the CUDA extension's quantize implements the TE recipe only; rht / four_over_six use Triton")
        return _tr_quantize(x, amax, four_over_six, rht_signs)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    q, s, g = cuda_extension().nvfp4_quantize(x.contiguous(), _checked_amax(x, amax), swizzle, stream)
    return NVFP4Tensor(q, s.view(torch.float8_e4m3fn), g, x.dtype)


register("nvfp4_quantize", {"reference": _ref_quantize, "triton": _tr_quantize, "cuda": cuda_quantize})


def nvfp4_quantize(
    x: torch.Tensor, amax: AmaxLike = None, four_over_six: bool = False, rht_signs: torch.Tensor | None = None
) -> NVFP4Tensor:
    """NVFP4-quantize `x` along its last dimension through the selected backend; with `rht_signs`,
    x rotated by that Hadamard transform (see solrl_engine.quant.hadamard), with `four_over_six`,
    each block's scale chosen between its max on 6 and on 4."""
    if four_over_six or rht_signs is not None:
        return call("nvfp4_quantize", x.device, x, amax, four_over_six=four_over_six, rht_signs=rht_signs)
    return call("nvfp4_quantize", x.device, x, amax)


# --- NVFP4 fake-quant ----------------------------------------------------------------------------


def _tr_fake_quantize(x: torch.Tensor, amax: AmaxLike = None) -> torch.Tensor:
    return triton_module("nvfp4").fake_quantize(x, _checked_amax(x, amax))


register("nvfp4_fake_quantize", {"reference": nvfp4.fake_quantize, "triton": _tr_fake_quantize})


def nvfp4_fake_quantize(x: torch.Tensor, amax: AmaxLike = None) -> torch.Tensor:
    """Quantize-dequantize in one pass; same shape and dtype as `x`."""
    return call("nvfp4_fake_quantize", x.device, x, amax)


# --- NVFP4 dequantize ----------------------------------------------------------------------------


def _tr_dequantize(t: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    return triton_module("nvfp4").dequantize(t.qdata, t.scale, t.global_scale, dtype)


register("nvfp4_dequantize", {"reference": nvfp4.dequantize, "triton": _tr_dequantize})


def nvfp4_dequantize(t: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode an NVFP4Tensor to `dtype` (default: its source dtype)."""
    return call("nvfp4_dequantize", t.qdata.device, t, dtype or t.orig_dtype)


# --- in-place requantize (keeps storage, so captured graphs stay valid) --------------------------


def _ref_quantize_into(
    t: NVFP4Tensor, x: torch.Tensor, amax: AmaxLike = None, four_over_six: bool = False,
    rht_signs: torch.Tensor | None = None,
) -> NVFP4Tensor:  # fmt: skip
    new = _ref_quantize(x, amax, four_over_six, rht_signs)
    t.qdata.copy_(new.qdata)
    t.scale.copy_(new.scale)
    t.global_scale.copy_(new.global_scale)
    return t


def _tr_quantize_into(
    t: NVFP4Tensor, x: torch.Tensor, amax: AmaxLike = None, four_over_six: bool = False,
    rht_signs: torch.Tensor | None = None,
) -> NVFP4Tensor:  # fmt: skip
    out = (t.qdata, t.scale.view(torch.uint8), t.global_scale)
    triton_module("nvfp4").quantize(x, _checked_amax(x, amax), out=out, four_over_six=four_over_six,
                                    rht_signs=rht_signs)  # fmt: skip
    return t


register("nvfp4_quantize_into_", {"reference": _ref_quantize_into, "triton": _tr_quantize_into})


def nvfp4_quantize_into_(
    t: NVFP4Tensor, x: torch.Tensor, amax: AmaxLike = None, four_over_six: bool = False,
    rht_signs: torch.Tensor | None = None,
) -> NVFP4Tensor:  # fmt: skip
    """Quantize `x` (rotated by `rht_signs`' transform when given) into the existing buffers of `t`
    (same shapes), in place."""
    if x.shape != t.shape:
        raise ValueError(f"cannot requantize a {tuple(x.shape)} tensor into {tuple(t.shape)} storage.")
    if four_over_six or rht_signs is not None:
        return call("nvfp4_quantize_into_", x.device, t, x, amax, four_over_six=four_over_six, rht_signs=rht_signs)
    return call("nvfp4_quantize_into_", x.device, t, x, amax)


# --- Hadamard rotation alone (the weight-only path: x rotated, not quantized) ---------------------


def _ref_rotate(x: torch.Tensor, rht_signs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return hadamard.rotate(x, rht_signs).to(dtype or x.dtype)


def _tr_rotate(x: torch.Tensor, rht_signs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    hadamard.check_size(rht_signs.numel(), x.shape[-1])
    return triton_module("nvfp4").rotate(x, rht_signs, dtype or x.dtype)


register("hadamard_rotate", {"reference": _ref_rotate, "triton": _tr_rotate})


def hadamard_rotate(x: torch.Tensor, rht_signs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x R along the last dimension (solrl_engine.quant.hadamard), computed in FP32 and returned as
    `dtype` (default x's): one launch on the Triton backend, the same bits as the reference."""
    return call("hadamard_rotate", x.device, x, rht_signs, dtype)


# --- FP8 -----------------------------------------------------------------------------------------


def _tr_fp8_rowwise(x: torch.Tensor) -> FP8Tensor:
    q, s = triton_module("fp8").quantize_rowwise(x)
    return FP8Tensor(q, s, x.dtype)


register("fp8_quantize_rowwise", {"reference": fp8.quantize_rowwise, "triton": _tr_fp8_rowwise})


def fp8_quantize_rowwise(x: torch.Tensor) -> FP8Tensor:
    """E4M3 with one FP32 scale per row of the last dimension."""
    return call("fp8_quantize_rowwise", x.device, x)


# --- INT8 ----------------------------------------------------------------------------------------


def _tr_int8_rowwise(x: torch.Tensor) -> Int8Tensor:
    q, s = triton_module("int8").quantize_rowwise(x)
    return Int8Tensor(q, s, x.dtype)


register("int8_quantize_rowwise", {"reference": int8.quantize_rowwise, "triton": _tr_int8_rowwise})


def int8_quantize_rowwise(x: torch.Tensor) -> Int8Tensor:
    """Symmetric INT8 with one FP32 scale per row of the last dimension (solrl_engine.quant.int8)."""
    return call("int8_quantize_rowwise", x.device, x)


def _tr_int8_epilogue(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    return triton_module("int8").scale_epilogue(acc, x_scale, w_scale, bias, out_dtype)


register("int8_scale_epilogue", {"reference": int8.scale_epilogue, "triton": _tr_int8_epilogue})


def int8_scale_epilogue(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """An INT32 GEMM accumulator [M, N] -> float32(acc) * x_scale[m] * w_scale[n] (+ bias) as out_dtype."""
    return call("int8_scale_epilogue", acc.device, acc, x_scale, w_scale, bias, out_dtype)
