"""Public ops, each with its implementations per backend; `dispatch` picks one per call.

Every op has a reference implementation (solrl_engine.quant) that the others are tested against.
"""

from __future__ import annotations

import torch

from solrl_engine.kernels.dispatch import call, cuda_extension, register, triton_module
from solrl_engine.quant import fp8, nvfp4
from solrl_engine.quant.fp8 import FP8Tensor
from solrl_engine.quant.nvfp4 import NVFP4Tensor

AmaxLike = float | torch.Tensor | None


# --- NVFP4 quantize ------------------------------------------------------------------------------


def _checked_amax(x: torch.Tensor, amax: AmaxLike) -> AmaxLike:
    """The reference's input checks for the Triton path; a given amax as a validated device scalar."""
    nvfp4.check_input(x)
    return None if amax is None else nvfp4.resolve_amax(amax, x)


def _tr_quantize(x: torch.Tensor, amax: AmaxLike = None) -> NVFP4Tensor:
    q, s, g = triton_module("nvfp4").quantize(x, _checked_amax(x, amax))
    return NVFP4Tensor(q, s.view(torch.float8_e4m3fn), g, x.dtype)


def cuda_quantize(x: torch.Tensor, amax: AmaxLike = None, swizzle: bool = False) -> NVFP4Tensor:
    """The extension's one-launch quantize (amax fused); `swizzle` writes cuBLASLt/CUTLASS's scale layout."""
    stream = torch.cuda.current_stream(x.device).cuda_stream
    q, s, g = cuda_extension().nvfp4_quantize(x.contiguous(), _checked_amax(x, amax), swizzle, stream)
    return NVFP4Tensor(q, s.view(torch.float8_e4m3fn), g, x.dtype)


register("nvfp4_quantize", {"reference": nvfp4.quantize, "triton": _tr_quantize, "cuda": cuda_quantize})


def nvfp4_quantize(x: torch.Tensor, amax: AmaxLike = None) -> NVFP4Tensor:
    """NVFP4-quantize `x` along its last dimension through the selected backend."""
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


def _ref_quantize_into(t: NVFP4Tensor, x: torch.Tensor, amax: AmaxLike = None) -> NVFP4Tensor:
    new = nvfp4.quantize(x, amax)
    t.qdata.copy_(new.qdata)
    t.scale.copy_(new.scale)
    t.global_scale.copy_(new.global_scale)
    return t


def _tr_quantize_into(t: NVFP4Tensor, x: torch.Tensor, amax: AmaxLike = None) -> NVFP4Tensor:
    out = (t.qdata, t.scale.view(torch.uint8), t.global_scale)
    triton_module("nvfp4").quantize(x, _checked_amax(x, amax), out=out)
    return t


register("nvfp4_quantize_into_", {"reference": _ref_quantize_into, "triton": _tr_quantize_into})


def nvfp4_quantize_into_(t: NVFP4Tensor, x: torch.Tensor, amax: AmaxLike = None) -> NVFP4Tensor:
    """Quantize `x` into the existing buffers of `t` (same shapes), in place."""
    if x.shape != t.shape:
        raise ValueError(f"cannot requantize a {tuple(x.shape)} tensor into {tuple(t.shape)} storage.")
    return call("nvfp4_quantize_into_", x.device, t, x, amax)


# --- FP8 -----------------------------------------------------------------------------------------


def _tr_fp8_rowwise(x: torch.Tensor) -> FP8Tensor:
    q, s = triton_module("fp8").quantize_rowwise(x)
    return FP8Tensor(q, s, x.dtype)


register("fp8_quantize_rowwise", {"reference": fp8.quantize_rowwise, "triton": _tr_fp8_rowwise})


def fp8_quantize_rowwise(x: torch.Tensor) -> FP8Tensor:
    """E4M3 with one FP32 scale per row of the last dimension."""
    return call("fp8_quantize_rowwise", x.device, x)
