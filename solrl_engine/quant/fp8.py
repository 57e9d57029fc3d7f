"""FP8 E4M3 reference numerics (pure PyTorch) for the Hopper/Ada explore precision.

Current scaling as in Transformer Engine: encode factor s = 448/amax (FP32, 1.0 for amax == 0,
capped at the FP32 max), q = e4m3_rne(clamp(x * s, -448, 448)), decode factor 1/s. Scales are per
row (per token for activations, per output channel for weights) or per tensor. Non-finite inputs
become E4M3 NaN (0x7F): the format has no Inf, and a NaN must stay visible to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solrl_engine.quant.formats import Numerics

E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class FP8Tensor:
    """E4M3 data with FP32 decode scales broadcastable against it ([..., 1] per row, [] per tensor)."""

    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x' = float(q) * scale, cast to `dtype` (default: the source dtype)."""
        return (self.data.float() * self.scale).to(dtype or self.orig_dtype)


def _encode_factor(amax: torch.Tensor) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float32, device=amax.device)
    s = torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device) / amax
    s = torch.minimum(s, torch.tensor(FP32_MAX, dtype=torch.float32, device=amax.device))
    return torch.where(amax == 0, one, s)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))


def _encode(xf: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
    q = torch.clamp(xf * enc, -E4M3_MAX, E4M3_MAX)
    q = torch.where(torch.isfinite(xf), q, torch.tensor(float("nan"), device=xf.device))
    return q.to(torch.float8_e4m3fn)


def quantize_rowwise(x: torch.Tensor) -> FP8Tensor:
    """One scale per row of the last dimension (scale shape [..., 1])."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"row-wise FP8 needs a non-empty last dimension; got shape {tuple(x.shape)}.")
    xf = x.detach().float()
    amax = _finite_abs(xf).amax(dim=-1, keepdim=True)
    enc = _encode_factor(amax)
    return FP8Tensor(_encode(xf, enc), torch.ones_like(enc) / enc, x.dtype)


def quantize_tensorwise(x: torch.Tensor, amax: float | torch.Tensor | None = None) -> FP8Tensor:
    """One scale for the whole tensor; `amax` may be a calibrated static value."""
    xf = x.detach().float()
    if amax is None:
        a = _finite_abs(xf)
        amax_t = a.amax() if a.numel() else torch.zeros((), device=x.device)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(())
        if not bool(torch.isfinite(amax_t)) or bool(amax_t < 0):
            raise ValueError(f"amax must be finite and >= 0; got {amax_t.item()}.")
    enc = _encode_factor(amax_t)
    return FP8Tensor(_encode(xf, enc), torch.ones_like(enc) / enc, x.dtype)


def fake_quantize_rowwise(x: torch.Tensor) -> torch.Tensor:
    """Row-wise quantize then dequantize, same dtype as `x`."""
    return quantize_rowwise(x).dequantize(x.dtype)


def attention_rounding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FP8 attention's operands, emulated: q, k and v each E4M3 with a scale per token and head (the linear's
    row-wise recipe), in their own dtype."""
    return tuple(fake_quantize_rowwise(t).to(t.dtype) for t in (q, k, v))


NUMERICS = Numerics(
    "fp8", "FP8 E4M3", 8, lambda k, n: k * n + 4 * n,  # codes and one FP32 scale per output channel
    attention=attention_rounding, rowwise=quantize_rowwise,
)
