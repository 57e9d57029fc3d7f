"""The quantize where its input is made, reference numerics: a producer's output (an adaLN-Zero norm's, a weighted
RMS norm's times its modulation, an FFN's GELU, a gated FFN's gate) and its row-wise codes.

diffusers' AdaLayerNormZero and AdaLayerNormZeroSingle compute y = layer_norm(x) * (1 + scale) + shift, and the
linears they feed each quantize y per row. A producer that emits the codes with y saves those passes (the Triton
kernel does it in one pass over each row: solrl_triton.producers). This is what it computes, as the stock module
does it: the norm in FP32 under autocast (layer_norm is on autocast's FP32 list) or else in x's dtype, times
(1 + scale) and plus shift in PyTorch's type promotion, then the format's row-wise quantize of y.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from solrl_engine.quant.formats import numerics


def adaln_dtype(x_dtype: torch.dtype, modulation_dtype: torch.dtype, fp32_norm: bool) -> torch.dtype:
    """The dtype of layer_norm(x) * (1 + scale) + shift: the norm's (FP32 under autocast) promoted with the
    modulation's."""
    return torch.promote_types(torch.float32 if fp32_norm else x_dtype, modulation_dtype)


def adaln(x: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor, eps: float, fp32_norm: bool
          ) -> torch.Tensor:  # fmt: skip
    """layer_norm(x) * one_plus_scale[:, None] + shift[:, None] for x [B, T, K] and a modulation [B, K]: the
    module's own ops (`fp32_norm`: the norm computed in FP32, as autocast runs it)."""
    n = F.layer_norm(x.float() if fp32_norm else x, x.shape[-1:], eps=eps)
    return n * one_plus_scale[:, None] + shift[:, None]


def adaln_quantize(
    x: torch.Tensor, one_plus_scale: torch.Tensor, shift: torch.Tensor, eps: float, fmt: str, fp32_norm: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, codes, scales): `adaln`'s y (cast to `out_dtype` where given, as a block that casts its modulated norm to
    its activations' dtype) and `fmt`'s row-wise quantize of that y (quant/<fmt>.py's Numerics.rowwise)."""
    y = adaln(x, one_plus_scale, shift, eps, fp32_norm)
    return _codes(y if out_dtype is None else y.to(out_dtype), fmt)


def rms_scaled(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None) -> torch.Tensor:
    """diffusers' RMSNorm (no bias) of x [B, T, K] times a modulation scale [B, K] (Z-Image's `norm(x) * (1 +
    scale)`; none: the norm alone), in the module's own ops: the mean square in FP32, x times its reciprocal root,
    cast to a half-precision weight's dtype before the weight multiplies, then the scale in PyTorch's promotion."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight is not None:
        if weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(weight.dtype)
        h = h * weight
    else:
        h = h.to(x.dtype)
    return h if scale is None else h * scale[:, None]


def rms_dtype(x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None) -> torch.dtype:
    """The dtype of diffusers' RMSNorm(x) * scale: the norm's (a half weight's, an FP32 weight's FP32, x's without
    one) promoted with the scale's."""
    h = x.dtype if weight is None else (weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else
                                        torch.promote_types(torch.float32, weight.dtype))  # fmt: skip
    return h if scale is None else torch.promote_types(h, scale.dtype)


def rms_quantize(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None, fmt: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales): `rms_scaled`'s y and `fmt`'s row-wise quantize of it: the codes of the linears a
    modulated RMS norm feeds (Z-Image's attention projections and its FFN's first linears)."""
    return _codes(rms_scaled(x, weight, eps, scale), fmt)


def gelu_quantize(x: torch.Tensor, fmt: str, prefix: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales): an FFN's activation y = gelu(x, approximate="tanh") (diffusers' GELU module's op, in x's
    dtype), after `prefix` along the last dimension where given (FLUX.1's single block: cat([attention output,
    gelu(mlp)])), and `fmt`'s row-wise quantize of it: the codes of the linear it feeds."""
    y = F.gelu(x, approximate="tanh")
    return _codes(y if prefix is None else torch.cat([prefix, y], dim=-1), fmt)


def glu_quantize(x: torch.Tensor, fmt: str, gate_first: bool = False, prefix: torch.Tensor | None = None,
                 second: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, codes, scales): a gated FFN's gate y = a * silu(g) for x = cat([a, g]) along the last dimension (SANA's
    GLUMBConv after its depthwise convolution: `hidden * silu(gate)` of its two channel halves), or x = cat([g, a])
    with `gate_first` (FLUX.2's SwiGLU: `silu(first) * second`, the same product), in x's dtype; with `second` the
    halves are x and `second` (Z-Image's SwiGLU: `silu(w1(x)) * w3(x)`, two linears' outputs); after `prefix`
    along the last dimension where given (FLUX.2's single block joins its attention's output first), and `fmt`'s
    row-wise quantize of it: the codes of the linear y feeds."""
    if second is None:
        if x.shape[-1] % 2:
            raise ValueError(f"glu_quantize gates the two halves of the last dimension; got an odd {x.shape[-1]}")
        a, g = x.chunk(2, dim=-1)
    else:
        a, g = x, second
    if gate_first:
        a, g = g, a
    y = a * F.silu(g)
    return _codes(y if prefix is None else torch.cat([prefix, y], dim=-1), fmt)


def _codes(y: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, `fmt`'s row-wise codes of y, their scales) (quant/<fmt>.py's Numerics.rowwise)."""
    quantize = numerics(fmt).rowwise
    if quantize is None:
        raise ValueError(f"format {fmt!r} has no row-wise activation quantize for a producer to emit")
    q = quantize(y)
    return y, q.data, q.scale
