"""FP8 (E4M3) behind the dispatch seam: the row-wise quantize and the GEMM `fp8_linear`, its custom op and
its traced form; the explore pass's attention `fp8_attention` (Q K^T and P V on the FP8 tensor cores).

Implementations of `fp8_linear`: reference; cuda (sm_89+): `torch._scaled_mm` E4M3 row-wise for W8A8
(activations of any float dtype quantized directly), a BF16 GEMM with FP32 output for W8A16 (E4M3 is
exact in BF16). Both compute the products of exactly decoded values, accumulated in FP32, times the
scales, plus bias; only accumulation order and the output rounding of cuBLAS differ.
"""

from __future__ import annotations

import torch

from solrl_engine.kernels._attention import register_attention, run_attention
from solrl_engine.kernels._gemm import (
    PASSED_OVER_HINT,
    PRODUCED,
    WEIGHT_ONLY_HINT,
    finish,
    flat,
    no_autocast,
    produced,
    run_recorded,
    traced,
)
from solrl_engine.kernels.capability import FormatKernels, TensorCores, tensor_cores
from solrl_engine.kernels.dispatch import call, ran, register, run, triton_module
from solrl_engine.quant import fp8
from solrl_engine.quant.fp8 import FP8Tensor

# --- quantize ------------------------------------------------------------------------------------


def _tr_fp8_rowwise(x: torch.Tensor) -> FP8Tensor:
    q, s = triton_module("fp8").quantize_rowwise(x)
    return FP8Tensor(q, s, x.dtype)


register("fp8_quantize_rowwise", {"reference": fp8.quantize_rowwise, "triton": _tr_fp8_rowwise})


def fp8_quantize_rowwise(x: torch.Tensor) -> FP8Tensor:
    """E4M3 with one FP32 scale per row of the last dimension."""
    return call("fp8_quantize_rowwise", x.device, x)


# --- the GEMM ------------------------------------------------------------------------------------


def _ref_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool,
    out_dtype: torch.dtype | None = None, xq: FP8Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    ran("reference" + ("" if xq is None or not quantize_input else PRODUCED))
    x2 = flat(x)
    w = weight.data.float()
    if quantize_input:
        xq = fp8_quantize_rowwise(x2) if xq is None else xq
        acc = (xq.data.float() @ w.t()) * xq.scale * weight.scale.reshape(1, -1)
    else:
        acc = (x2.float() @ w.t()) * weight.scale.reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return finish(acc, x, out_dtype)


def _fp8_fits(device: torch.device, k: int, n: int, quantize_input: bool = True, **_: object) -> str | None:
    """Whether cuBLASLt's row-wise FP8 GEMM can run a layer of K inputs and N outputs."""
    if k % 16 or n % 16:
        return f"cuBLASLt FP8 needs K % 16 == 0 and N % 16 == 0; got K={k}, N={n}"
    return None


def _cuda_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool,
    out_dtype: torch.dtype | None = None, xq: FP8Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """W8A8 through cuBLASLt's row-wise scaled GEMM: activations of any float dtype quantized directly,
    BF16 out (what cuBLASLt writes for row-wise scales), cast to `out_dtype` when another is asked for;
    W8A16 as a BF16 GEMM with FP32 output (E4M3 weights are exact in BF16) and the channel scales after."""
    x2 = flat(x)
    n, k = weight.data.shape
    out_dtype = out_dtype or x.dtype
    if not quantize_input:
        if x.dtype != torch.bfloat16:
            return _ref_fp8_linear(x, weight, bias, quantize_input, out_dtype)
        if x.device.type == "cuda":
            acc = torch.mm(x2, weight.data.to(torch.bfloat16).t(), out_dtype=torch.float32)
        else:  # a simulated GPU: the same GEMM (BF16 operands, FP32 sums and output), which CPUs run in FP32
            acc = x2.float() @ weight.data.float().t()
        acc = acc * weight.scale.reshape(1, -1)
        if bias is not None:
            acc = acc + bias.float()
        ran("cuda: BF16 GEMM of E4M3 weights (W8A16)")
        return finish(acc, x, out_dtype)
    if _fp8_fits(x.device, k, n) is not None or x2.shape[0] == 0 or weight.scale.numel() != n:
        return _ref_fp8_linear(x, weight, bias, quantize_input, out_dtype, xq)
    y = _fp8_scaled_mm(fp8_quantize_rowwise(x2) if xq is None else xq, weight, bias)
    ran("cuda: cuBLASLt FP8 row-wise _scaled_mm" + ("" if xq is None else PRODUCED))
    return finish(y, x, out_dtype)


def _fp8_scaled_mm(xq: FP8Tensor, weight: FP8Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLASLt's row-wise FP8 GEMM of quantized rows and weight, bias fused, BF16 out (what it writes for
    row-wise scales): the eager `cuda` implementation's and the traced form's one call."""
    b = None if bias is None else bias.to(torch.bfloat16)
    sa, sb = xq.scale.reshape(-1, 1).contiguous(), weight.scale.reshape(1, -1).contiguous()
    return torch._scaled_mm(xq.data, weight.data.t(), scale_a=sa, scale_b=sb, bias=b, out_dtype=torch.bfloat16)


def _fp8_tensor_cores(device: torch.device) -> str | None:
    return tensor_cores(device, "fp8")


register("fp8_linear", {"reference": _ref_fp8_linear, "cuda": _cuda_fp8_linear}, requires={"cuda": _fp8_tensor_cores},
         fits={"cuda": _fp8_fits})  # fmt: skip


@torch.library.custom_op("solrl::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, quantize_input: bool,
    backend: str = "", out_dtype: torch.dtype | None = None, tag: str = "", x_codes: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    w = FP8Tensor(data, scale, torch.float32)
    xq = produced(x_codes, x_scale, FP8Tensor)

    def gemm() -> torch.Tensor:
        if backend:
            return run("fp8_linear", backend, x, w, bias, quantize_input, out_dtype=out_dtype, xq=xq)
        return call("fp8_linear", x.device, x, w, bias, quantize_input, out_dtype=out_dtype, xq=xq)

    hint = WEIGHT_ONLY_HINT if not quantize_input else PASSED_OVER_HINT
    return run_recorded(tag, x, gemm, hint)


@_fp8_linear_op.register_fake
def _(x, data, scale, bias, quantize_input, backend="", out_dtype=None, tag="", x_codes=None, x_scale=None):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], data.shape[0]), dtype=out_dtype or x.dtype)


def fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "", xq: FP8Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b with W in FP8 (per output channel); x FP8 per token (W8A8) or as is (W8A16);
    in `out_dtype` (default x's). `xq`: x's codes and scales made by its producer (W8A8; the GEMM then skips
    the quantize). `tag` (a layer's) records what ran (`dispatch.runs`); under torch.compile a layer on `cuda`
    takes the traced form (`traced_fp8_linear`)."""
    if quantize_input and traced(backend) and x.numel():
        return traced_fp8_linear(x, weight, bias, out_dtype or x.dtype, xq)
    codes, scales = (None, None) if xq is None or not quantize_input else (xq.data, xq.scale)
    return _fp8_linear_op(x, weight.data, weight.scale, bias, quantize_input, backend, out_dtype, tag, codes, scales)


# --- traced form (under torch.compile; see _gemm) ------------------------------------------------


def traced_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, xq: FP8Tensor | None = None
) -> torch.Tensor:
    """W8A8 FP8 as `_cuda_fp8_linear` computes it: the reference row-wise quantize (traceable, so fused
    into x's producer by inductor; none where the producer made the codes, `xq`), cuBLASLt's row-wise
    `torch._scaled_mm` with BF16 output, cast to `out_dtype`."""
    with no_autocast(x):
        xq = fp8.quantize_rowwise(flat(x)) if xq is None else produced(xq.data, xq.scale, FP8Tensor)
        return finish(_fp8_scaled_mm(xq, weight, bias), x, out_dtype)


# --- attention (quant.fp8.attention is the reference) -------------------------------------------------------------


def _tr_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Q, K per token and V per channel in E4M3 (the reference's torch ops), then the Triton kernel: Q K^T and P V
    on the FP8 tensor cores, online softmax in FP32."""
    qt, kt, vt = fp8.attention_operands(q, k, v)
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    out = triton_module("attention").fp8_attention(qt.data, qt.scale, kt.data, kt.scale, vt.data, vt.scale, sc,
                                                   q.dtype, fp8.P_ENCODE, key_bias)  # fmt: skip
    ran("triton: FP8 Q K^T, FP8 P V attention")
    return out


register_attention("fp8", fp8, _tr_fp8_attention, "FP8")


@torch.library.custom_op("solrl::fp8_attention", mutates_args=())
def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, tag: str = "",
                  key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(Q K^T * scale) V with Q, K (per token), V (per channel) and P in E4M3 ([..., tokens, d] each; out in
    q's dtype; `key_bias` [..., keys]: a key-padding mask as an additive bias): the explore pass's attention for
    explore_attention=fp8, through dispatch's choice for q's device and head dim (the Triton kernel on sm_89+, else
    the reference). `tag` records what ran. A custom op: torch.compile keeps it whole (its choice and record run
    when it runs, never traced)."""
    return run_attention("fp8", q, k, v, scale, tag, key_bias,
                         "the FP8 attention kernel runs with Triton on sm_89+ and head dims up to 256")


@fp8_attention.register_fake
def _(q, k, v, scale=None, tag="", key_bias=None):  # noqa: ANN001, ANN202
    return torch.empty_like(q)


KERNELS = FormatKernels("fp8", TensorCores("FP8", (8, 9), cpu_op=True, nominal_speedup=2.0), "fp8_linear",
                        "fp8_attention")  # fmt: skip
