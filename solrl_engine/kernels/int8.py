"""INT8 behind the dispatch seam: the row-wise quantize, the scale epilogue and the GEMM `int8_linear`
(W8A8), its custom op and its traced form.

Implementations of `int8_linear`: reference (the exact integer GEMM in float64); cuda (sm_80 to sm_89): the
Triton row-wise quantize, `torch._int_mm` (cuBLASLt IMMA; oneDNN on a CPU) and the one-pass Triton scale
epilogue; triton (sm_90+, where cuBLASLt falls back to sm_80 kernels; any sm_80+ when asked for): the Triton
row-wise quantize and one Triton kernel for the tensor-core GEMM with the scales and bias in its epilogue. All
compute the products of the integer codes, accumulated exactly in INT32, times the scales, plus bias, rounded as
the reference rounds: bit-exact with it.
"""

from __future__ import annotations

import torch

from solrl_engine.kernels._attention import register_attention, run_attention
from solrl_engine.kernels._gemm import PRODUCED, flat, no_autocast, produced, run_recorded, traced
from solrl_engine.kernels.capability import FormatKernels, TensorCores, device_capability, tensor_cores
from solrl_engine.kernels.dispatch import call, ran, register, run, triton_module, unavailable_reason
from solrl_engine.quant import int8
from solrl_engine.quant.int8 import Int8Tensor

# --- quantize and epilogue -----------------------------------------------------------------------


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


# --- the GEMM ------------------------------------------------------------------------------------


def _ref_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
    xq: Int8Tensor | None = None,
) -> torch.Tensor:
    ran("reference" + ("" if xq is None else PRODUCED))
    return int8.linear(x, weight, bias, out_dtype or x.dtype, xq)


def _int8_fits(device: torch.device, k: int, n: int, **_: object) -> str | None:
    """Whether torch._int_mm can run a layer of K inputs and N outputs (cuBLASLt IMMA: 8-aligned)."""
    if k % 8 or n % 8:
        return f"torch._int_mm needs K % 8 == 0 and N % 8 == 0; got K={k}, N={n}"
    return None


HOPPER = (9, 0)


def _tr_int8_requires(device: torch.device) -> str | None:
    """The Triton INT8 GEMM runs where Triton kernels run and the device has INT8 tensor cores (sm_80+)."""
    return unavailable_reason("triton", device) or tensor_cores(device, "int8")


def _tr_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
    xq: Int8Tensor | None = None,
) -> torch.Tensor:
    """W8A8: the Triton row-wise quantize of x, then one Triton kernel for the INT8 tensor-core GEMM with the
    scales and bias applied in its epilogue, written once as out_dtype (no INT32 accumulator in memory)."""
    x2 = flat(x)
    n = weight.data.shape[0]
    if x2.shape[0] == 0:
        return _ref_int8_linear(x, weight, bias, out_dtype, xq)
    given = xq is not None
    xq = int8_quantize_rowwise(x2) if xq is None else xq
    y = triton_module("int8").gemm(xq.data, xq.scale, weight.data, weight.scale, bias, out_dtype or x.dtype)
    ran("triton: INT8 tensor-core GEMM, scales and bias in its epilogue" + (PRODUCED if given else ""))
    return y.reshape(*x.shape[:-1], n)


MIN_INT_MM_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows: fewer are padded with zero rows


def _int_mm_rows(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """INT32 a @ w.T through `torch._int_mm`, rows zero-padded to MIN_INT_MM_ROWS on CUDA and cut back."""
    m, k = a.shape
    if a.device.type == "cuda" and m < MIN_INT_MM_ROWS:
        a = torch.cat([a, a.new_zeros(MIN_INT_MM_ROWS - m, k)])
    return torch._int_mm(a, w.t())[:m]


def _cuda_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
    xq: Int8Tensor | None = None,
) -> torch.Tensor:
    """W8A8: the row-wise quantize of x (any float dtype), the INT32 GEMM `torch._int_mm` (cuBLASLt
    IMMA on a GPU, oneDNN on a CPU), then the scales and bias in one epilogue pass."""
    x2 = flat(x)
    n, k = weight.data.shape
    if _int8_fits(x.device, k, n) is not None or x2.shape[0] == 0:
        return _ref_int8_linear(x, weight, bias, out_dtype, xq)
    given = xq is not None
    xq = int8_quantize_rowwise(x2) if xq is None else xq
    acc = _int_mm_rows(xq.data, weight.data)
    y = int8_scale_epilogue(acc, xq.scale, weight.scale, bias, out_dtype or x.dtype)
    ran("cuda: torch._int_mm INT8 GEMM + scale epilogue" + (PRODUCED if given else ""))
    return y.reshape(*x.shape[:-1], n)


def _int8_tensor_cores(device: torch.device) -> str | None:
    """Where torch._int_mm runs, and should: INT8 tensor cores, but not on Hopper and later where the Triton GEMM
    runs, since there cuBLASLt runs its sm_80 IMMA kernels (the H200 ran them at BF16's rate,
    bench/results/2026-11-25-NVIDIA_H200-gpu-session-2-forwards.json) and the Triton GEMM is native and has the
    scales and bias in its epilogue. A device-level answer, so a layer's choice and a call's selection agree."""
    why = tensor_cores(device, "int8")
    cap = device_capability(device)
    if why is None and cap is not None and cap >= HOPPER and _tr_int8_requires(device) is None:
        return (f"sm_{cap[0]}{cap[1]}: cuBLASLt's INT8 GEMM runs sm_80 kernels there (BF16's rate on the H200); the "
                "Triton GEMM with the fused epilogue runs instead")  # fmt: skip
    return why


register("int8_linear", {"reference": _ref_int8_linear, "cuda": _cuda_int8_linear, "triton": _tr_int8_linear},
         requires={"cuda": _int8_tensor_cores, "triton": _tr_int8_requires}, fits={"cuda": _int8_fits})  # fmt: skip


@torch.library.custom_op("solrl::int8_gemm", mutates_args=())
def _int8_gemm_op(
    a: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The Triton GEMM with its epilogue alone (codes and scales in), for the traced form: the quantize before it
    stays plain torch ops that inductor fuses into x's producer."""
    return triton_module("int8").gemm(a, x_scale, w, w_scale, bias, out_dtype)


@_int8_gemm_op.register_fake
def _(a, x_scale, w, w_scale, bias, out_dtype):  # noqa: ANN001, ANN202
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


@torch.library.custom_op("solrl::int8_linear", mutates_args=())
def _int8_linear_op(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "", x_codes: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    w = Int8Tensor(data, scale, torch.float32)
    xq = produced(x_codes, x_scale, Int8Tensor)

    def gemm() -> torch.Tensor:
        if backend:
            return run("int8_linear", backend, x, w, bias, out_dtype=out_dtype, xq=xq)
        return call("int8_linear", x.device, x, w, bias, out_dtype=out_dtype, xq=xq)

    return run_recorded(tag, x, gemm, "INT8 GEMMs need sm_80+ and K, N multiples of 8 (see QuantReport's GEMM line)")


@_int8_linear_op.register_fake
def _(x, data, scale, bias, backend="", out_dtype=None, tag="", x_codes=None, x_scale=None):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], data.shape[0]), dtype=out_dtype or x.dtype)


def int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "", xq: Int8Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b, W8A8: W INT8 per output channel, x INT8 per token (symmetric, solrl_engine.quant.int8);
    in `out_dtype` (default x's). `xq`: x's codes and scales made by its producer (the GEMM then skips the
    quantize). `tag` (a layer's) records what ran (`dispatch.runs`); under torch.compile a layer on `cuda` takes
    the traced form (`traced_int8_linear`)."""
    if traced(backend, ("cuda", "triton")) and x.numel():
        return traced_int8_linear(x, weight, bias, out_dtype or x.dtype, backend, xq)
    codes, scales = (None, None) if xq is None else (xq.data, xq.scale)
    return _int8_linear_op(x, weight.data, weight.scale, bias, backend, out_dtype, tag, codes, scales)


# --- traced form (under torch.compile; see _gemm) ------------------------------------------------


def traced_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, backend: str = "cuda",
    xq: Int8Tensor | None = None,
) -> torch.Tensor:
    """W8A8 INT8 as the layer's implementation computes it: the reference row-wise quantize (fused into x's
    producer by inductor; none where the producer made the codes, `xq`), then on `cuda` `torch._int_mm` (rows
    padded to 17 on CUDA) and the reference epilogue (fused after it), on `triton` the Triton GEMM with its
    epilogue (one opaque op)."""
    x2 = flat(x)
    with no_autocast(x):
        if xq is None:
            s = int8.row_scales(x2)
            q = int8.encode(x2, s)
        else:
            q, s = flat(xq.data), xq.scale.reshape(-1, 1)
        if backend == "triton":
            y = _int8_gemm_op(q, s, weight.data, weight.scale, bias, out_dtype)
        else:
            y = int8.scale_epilogue(_int_mm_rows(q, weight.data), s, weight.scale, bias, out_dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])


# --- attention (SageAttention's recipe; quant.int8.attention is the reference) ------------------------------------


def _tr_int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                       key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Q and the smoothed K quantized per block (the reference's torch ops), then the Triton kernel: INT8 Q K^T on
    the tensor cores, online softmax in FP32, P V in FP16."""
    qt = int8.quantize_blocks(q, int8.Q_BLOCK)
    kt = int8.quantize_blocks(int8.smooth_k(k), int8.K_BLOCK)
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    out = triton_module("attention").int8_attention(qt.data, qt.scale, kt.data, kt.scale, v, sc, q.dtype, key_bias)
    ran("triton: INT8 Q K^T, FP16 P V attention")
    return out


register_attention("int8", int8, _tr_int8_attention, "INT8")


@torch.library.custom_op("solrl::int8_attention", mutates_args=())
def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, tag: str = "",
                   key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(Q K^T * scale) V with Q, K in INT8 (per-block scales, K smoothed) and P, V in FP16 ([..., tokens, d]
    each; out in q's dtype; `key_bias` [..., keys]: a key-padding mask as an additive bias): the explore pass's
    attention for explore_attention=int8, through dispatch's choice for q's device and head dim (the Triton kernel on
    sm_80+, else the reference). `tag` records what ran. A custom op: torch.compile keeps it whole (its choice and
    record run when it runs, never traced)."""
    return run_attention("int8", q, k, v, scale, tag, key_bias,
                         "the INT8 attention kernel runs with Triton on sm_80+ and head dims up to 256")


@int8_attention.register_fake
def _(q, k, v, scale=None, tag="", key_bias=None):  # noqa: ANN001, ANN202
    return torch.empty_like(q)


KERNELS = FormatKernels("int8", TensorCores("INT8", (8, 0), cpu_op=True, nominal_speedup=2.0), "int8_linear",
                        "int8_attention")  # fmt: skip
