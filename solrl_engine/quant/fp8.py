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


# FP8 attention (explore_attention=fp8): the kernel's tiles of keys, over which softmax keeps its running max, and
# the encode factor of P (its values exp(s - running max) lie in [0, 1], so 1 maps to E4M3's largest)
KEY_BLOCK = 64
P_ENCODE = E4M3_MAX


def _poisoned(t: FP8Tensor, x: torch.Tensor) -> FP8Tensor:
    """`t` (row-wise codes of `x`) with a NaN scale on every row of `x` holding a non-finite value: attention mixes
    every row into every output (a NaN or Inf in q, k or v leaves exact attention NaN where it reaches), and a NaN
    scale keeps that so whatever the tensor cores make of a NaN code."""
    bad = ~torch.isfinite(x.detach().float()).all(dim=-1, keepdim=True)
    return FP8Tensor(t.data, torch.where(bad, torch.full_like(t.scale, float("nan")), t.scale), t.orig_dtype)


def _p_codes(p: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of softmax's unnormalised P (values in [0, 1]) at the fixed encode factor P_ENCODE."""
    return _encode(p, torch.tensor(P_ENCODE, device=p.device))


def attention_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[FP8Tensor, FP8Tensor, FP8Tensor]:
    """FP8 attention's operands ([..., tokens, d] each): q and k E4M3 with one scale per token and head (the
    linear's row-wise rule: Q K^T's scales then lie outside its sum), v with one per channel and head, stored
    transposed ([..., d, tokens]: P V sums over tokens, so V's scales must not vary along them). A row holding a
    non-finite value has a NaN scale."""
    qt, kt = (_poisoned(quantize_rowwise(t), t) for t in (q, k))
    vt = v.transpose(-1, -2)
    return qt, kt, _poisoned(quantize_rowwise(vt), vt)


def attention_rounding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FP8 attention's operands, decoded in their own dtypes (`attention_operands`): what a masked call, which the
    kernel does not take, computes with (P's rounding is the kernel's alone)."""
    qt, kt, vt = attention_operands(q, k, v)
    return qt.dequantize(q.dtype), kt.dequantize(k.dtype), vt.dequantize(v.dtype).transpose(-1, -2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The reference of the FP8 attention kernel ([..., tokens, d] each; out in q's dtype): S = (Qc Kc^T summed
    exactly) * q_scale * k_scale * scale (+ `key_bias` [..., keys], a key-padding mask); over blocks of KEY_BLOCK
    keys the online softmax (FP32) of the kernel, whose P = exp(S - running max) is rounded to E4M3 at P_ENCODE
    before P V on the FP8 tensor cores (V's channel scales and 1/P_ENCODE applied once at the end, the row sums
    taken from the unrounded P; a row whose keys so far are all masked takes 0 as its max)."""
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    qt, kt, vt = attention_operands(q, k, v)
    s = (qt.data.double() @ kt.data.double().transpose(-1, -2)).float() * qt.scale * kt.scale.transpose(-1, -2) * sc
    if key_bias is not None:
        s = s + key_bias.float().unsqueeze(-2)
    vc = vt.data.float().transpose(-1, -2)  # [..., tokens, d]
    m_i = torch.full(s.shape[:-1], float("-inf"), device=s.device)
    l_i = torch.zeros_like(m_i)
    acc = torch.zeros((*s.shape[:-1], vc.shape[-1]), device=s.device)
    for j in range(0, s.shape[-1], KEY_BLOCK):
        sj = s[..., j : j + KEY_BLOCK]
        m_new = torch.maximum(m_i, sj.amax(dim=-1))
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp(sj - m_use.unsqueeze(-1))
        alpha = torch.exp(m_i - m_use)
        l_i = l_i * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + _p_codes(p).float() @ vc[..., j : j + KEY_BLOCK, :]
        m_i = m_new
    out = acc * (vt.scale.transpose(-1, -2) / P_ENCODE) / l_i.unsqueeze(-1)
    return out.to(q.dtype)


NUMERICS = Numerics(
    "fp8", "FP8 E4M3", 8, lambda k, n: k * n + 4 * n,  # codes and one FP32 scale per output channel
    attention=attention_rounding, rowwise=quantize_rowwise,
)
