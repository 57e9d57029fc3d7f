"""Quantized linear layers (the GEMMs) behind the dispatch seam, one op per format.

Implementations of `nvfp4_linear`:
- reference: decode both operands exactly and multiply in FP32 (the oracle; CPU default);
- triton (Hopper/Ada default): NVFP4 quantize of the activations, then the in-kernel-decode FP16
  tensor-core GEMM (W4A4), or the weight-only GEMM for BF16/FP16 activations (W4A16);
- cuda (Blackwell, sm_100+): `torch._scaled_mm` on `float4_e2m1fn_x2` with swizzled E4M3 block
  scales (cuBLASLt FP4 tensor cores), the default;
- cutlass (SOLRL_BACKEND=cutlass, solrl_engine._C built): the extension's CUTLASS block-scaled GEMM
  (alpha and bias fused in its epilogue) after its one-launch quantize that writes swizzled scales
  (asked for by name only until it has run on a Blackwell GPU).
Each QuantLinear picks its implementation once (`dispatch.choose` with its shapes and options; the
choice and the reasons for the others go into QuantReport) and passes it to the op.
  Weight-only calls keep the Triton kernel (FP4 x BF16 has no tensor-core instruction).
Implementations of `fp8_linear`: reference; cuda (sm_89+): `torch._scaled_mm` E4M3 row-wise for
W8A8 (activations of any float dtype quantized directly), a BF16 GEMM with FP32 output for W8A16
(E4M3 is exact in BF16).
Implementations of `int8_linear` (W8A8): reference (the exact integer GEMM in float64); cuda (sm_80+):
the Triton row-wise quantize, `torch._int_mm` (cuBLASLt IMMA; oneDNN on a CPU) and the one-pass Triton
scale epilogue.
All compute the same math: the products of exactly decoded values, accumulated in FP32 (INT32 for
INT8), times the scales, plus bias; only accumulation order and the output rounding of cuBLAS differ.

Every implementation writes `out_dtype` (the autocast dtype under autocast, as nn.Linear returns; else
the input's) and reports what it ran (`dispatch.ran`), so QuantLinear's fast-path record is what
computed the call, never a guess from the choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from solrl_engine.kernels.capability import device_capability, tensor_cores
from solrl_engine.kernels.dispatch import (
    call,
    cuda_extension,
    ran,
    record_run,
    register,
    run,
    triton_module,
)
from solrl_engine.kernels.ops import (
    cuda_quantize,
    fp8_quantize_rowwise,
    hadamard_rotate,
    int8_quantize_rowwise,
    int8_scale_epilogue,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from solrl_engine.quant import fp8, hadamard, int8, nvfp4
from solrl_engine.quant.fp8 import FP8Tensor
from solrl_engine.quant.int8 import Int8Tensor
from solrl_engine.quant.nvfp4 import NVFP4Tensor


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(acc: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return acc.to(out_dtype or x.dtype).reshape(*x.shape[:-1], acc.shape[-1])


WEIGHT_ONLY_HINT = ("weight-only GEMMs take BF16/FP16 activations: run the explore copy under BF16 autocast (as the "
                    "rollouts do) or in BF16")  # fmt: skip
PASSED_OVER_HINT = "the layer's GEMM line in QuantReport (quantization.txt) says why the fast kernel was passed over"


def _traced(
    tag: str, x: torch.Tensor, fn: Callable[[], torch.Tensor], hint: str
) -> torch.Tensor:
    """Run one layer's GEMM with autocast off (the op writes its own out_dtype; inner matmuls must not
    be recast), recording what ran under `tag` when the layer has one."""
    dev = x.device.type
    off = torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext()
    with off:
        return record_run(tag, fn, x, hint) if tag else fn()


# --- NVFP4 ---------------------------------------------------------------------------------------


def _unit_scale_values(t: NVFP4Tensor) -> torch.Tensor:
    """e2m1(q) * s_blk in FP32, without the global scale (exact; it goes in the epilogue)."""
    one = torch.ones((), dtype=torch.float32, device=t.qdata.device)
    return nvfp4_dequantize(NVFP4Tensor(t.qdata, t.scale, one, t.orig_dtype), torch.float32)


def _rotated(x2: torch.Tensor, rht_signs: torch.Tensor | None) -> torch.Tensor:
    """Weight-only activations rotated along K (in FP32, then back to their dtype), or x2 as is."""
    return x2 if rht_signs is None else hadamard.rotate(x2, rht_signs).to(x2.dtype)


def _ref_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    ran("reference")
    x2 = _flat(x)
    w = _unit_scale_values(weight)
    if quantize_input:  # the rotation and the 4/6 choice inside the activation quantize
        xr = x2 if rht_signs is None else hadamard.rotate(x2, rht_signs)
        xv, xg = nvfp4.fake_quantize_unit(xr, None, four_over_six)
        acc = (xv @ w.t()) * (xg * weight.global_scale)
    else:
        acc = (_rotated(x2, rht_signs).float() @ w.t()) * weight.global_scale
    if bias is not None:
        acc = acc + bias.float()
    return _finish(acc, x, out_dtype)


def _tr_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    gemm = triton_module("gemm")
    x2 = _flat(x)
    out_dtype = out_dtype or x.dtype
    if quantize_input:  # quantized from x's own dtype, whatever it is
        xq = nvfp4_quantize(x2, None, four_over_six, rht_signs)
        y = gemm.w4a4_gemm(
            xq.qdata, xq.scale, xq.global_scale, weight.qdata, weight.scale, weight.global_scale, bias, out_dtype
        )
        ran("triton: NVFP4 quantize + W4A4 GEMM")
    elif x.dtype in (torch.bfloat16, torch.float16):
        xr = x2 if rht_signs is None else hadamard_rotate(x2, rht_signs)  # one launch, the reference's bits
        y = gemm.w4a16_gemm(xr, weight.qdata, weight.scale, weight.global_scale, bias, out_dtype)
        ran("triton: W4A16 GEMM")
    else:  # FP32 activations outside autocast: the weight-only kernel would have to round them
        return _ref_nvfp4_linear(x, weight, bias, quantize_input, rht_signs, four_over_six, out_dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def scaled_mm_fp4_operands(t: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data as float4_e2m1fn_x2 [rows, K/2], flat swizzled E4M3 scales): cuBLASLt's FP4 layout."""
    return t.qdata.view(torch.float4_e2m1fn_x2), nvfp4.swizzle_scales(t.scale)


def _weight_fp4_operands(w: NVFP4Tensor, swizzled: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's cuBLASLt FP4 operands, its scales from the layer's pre-swizzled copy when given."""
    if swizzled is None:
        return scaled_mm_fp4_operands(w)
    return w.qdata.view(torch.float4_e2m1fn_x2), swizzled.view(torch.float8_e4m3fn)


def _fp4_scaled_mm(a: torch.Tensor, sa: torch.Tensor, x_global: torch.Tensor, weight: NVFP4Tensor,
                   w_swizzled: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """cuBLASLt's block-scaled FP4 GEMM of the activation operands (`a`, swizzled `sa`) and the weight, then
    both global scales and the bias, in FP32: the eager `cuda` implementation's and the traced form's one call."""
    b, sb = _weight_fp4_operands(weight, w_swizzled)
    acc = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32) * (x_global * weight.global_scale)
    return acc if bias is None else acc + bias.float()


def _cuda_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, out_dtype: torch.dtype | None = None,
    w_swizzled: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`w_swizzled`: the weight's block scales already in the tiled order (the layer keeps them so)."""
    n, k = weight.shape
    if _cuda_fits(x.device, k, n, quantize_input, four_over_six, rht_signs is not None) is not None:
        # reached only through `call` (a layer's `choose` never picks cuda for these): the Triton GEMM
        return _tr_nvfp4_linear(x, weight, bias, quantize_input, rht_signs, four_over_six, out_dtype)
    xq = nvfp4_quantize(_flat(x))
    acc = _fp4_scaled_mm(*scaled_mm_fp4_operands(xq), xq.global_scale, weight, w_swizzled, bias)
    ran("cuda: cuBLASLt NVFP4 block-scaled _scaled_mm")
    return _finish(acc, x, out_dtype)


def _cutlass_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, out_dtype: torch.dtype | None = None,
    w_swizzled: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The extension's CUTLASS sm100 GEMM (alpha and bias in its epilogue) after its one-launch
    quantize that writes swizzled scales."""
    n, k = weight.shape
    reason = _cutlass_fits(x.device, k, n, quantize_input, four_over_six, rht_signs is not None)
    if reason is not None:
        raise ValueError(f"the CUTLASS NVFP4 GEMM cannot run this call: {reason}")
    ext = cuda_extension()
    xq = cuda_quantize(_flat(x), swizzle=True)
    alpha = xq.global_scale * weight.global_scale
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    sb = w_swizzled if w_swizzled is not None else nvfp4.swizzle_scales(weight.scale).view(torch.uint8)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    y = ext.nvfp4_gemm_sm100(xq.qdata, xq.scale.view(torch.uint8), weight.qdata, sb, alpha, b, stream)
    ran("cutlass: CUTLASS sm100 NVFP4 GEMM")
    return _finish(y, x, out_dtype)


def _fp4_tensor_cores(device: torch.device) -> str | None:
    reason = tensor_cores(device, "nvfp4")
    if reason is not None:
        return reason + "; Hopper uses the triton GEMM"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 (needs torch >= 2.8)"
    return None


def _cutlass_requires(device: torch.device) -> str | None:
    reason = tensor_cores(device, "nvfp4")
    if reason is not None:
        return reason
    if device_capability(device) != (10, 0):
        return "the CUTLASS GEMM is built for sm_100a only"
    ext = cuda_extension()
    if ext is None or not hasattr(ext, "nvfp4_gemm_sm100"):
        return "solrl_engine._C with its CUTLASS GEMM is not built (docs/kernels-and-numerics.md: build it)"
    return None


def _cuda_fits(device: torch.device, k: int, n: int, quantize_input: bool = True, four_over_six: bool = False,
               rht: bool = False, **_: object) -> str | None:  # fmt: skip
    """Whether cuBLASLt's FP4 GEMM can run a layer of K inputs and N outputs with these options."""
    if not quantize_input:
        return "weight-only: FP4 x BF16 has no tensor-core instruction"
    if rht or four_over_six:
        return "the extension's quantize implements the TE recipe only (no rht / four_over_six)"
    if k % 32 or n % 16:
        return f"cuBLASLt FP4 needs K % 32 == 0 and N % 16 == 0 (16-byte rows); got K={k}, N={n}"
    return None


def _cutlass_fits(device: torch.device, k: int, n: int, quantize_input: bool = True, four_over_six: bool = False,
                  rht: bool = False, **_: object) -> str | None:  # fmt: skip
    if not quantize_input or rht or four_over_six:
        return "it runs W4A4 with the TE recipe only"
    if k % 32 or n % 8:
        return f"CUTLASS needs K % 32 == 0 and N % 8 == 0; got K={k}, N={n}"
    return None


register(
    "nvfp4_linear",
    {"reference": _ref_nvfp4_linear, "triton": _tr_nvfp4_linear, "cuda": _cuda_nvfp4_linear,
     "cutlass": _cutlass_nvfp4_linear},
    requires={"cuda": _fp4_tensor_cores, "cutlass": _cutlass_requires},
    fits={"cuda": _cuda_fits, "cutlass": _cutlass_fits},
)  # fmt: skip


# The linears are torch custom ops: torch.compile sees one opaque node per layer (with a shape
# function) instead of tracing into the dispatch code and the kernel launches, so a compiled
# quantized model has no graph breaks and its CUDA graph captures the kernels as they are.
@torch.library.custom_op("solrl::nvfp4_linear", mutates_args=())
def _nvfp4_linear_op(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    quantize_input: bool,
    rht_signs: torch.Tensor | None = None,
    four_over_six: bool = False,
    backend: str = "",
    out_dtype: torch.dtype | None = None,
    tag: str = "",
    scale_swizzled: torch.Tensor | None = None,
) -> torch.Tensor:
    w = NVFP4Tensor(qdata, scale, global_scale, torch.float32)
    opts = {"rht_signs": rht_signs, "four_over_six": four_over_six} if rht_signs is not None or four_over_six else {}
    if scale_swizzled is not None and backend in ("cuda", "cutlass"):  # the implementations that read them
        opts["w_swizzled"] = scale_swizzled

    def gemm() -> torch.Tensor:
        if backend:  # the layer's own choice (QuantLinear.kernel)
            return run("nvfp4_linear", backend, x, w, bias, quantize_input, out_dtype=out_dtype, **opts)
        return call("nvfp4_linear", x.device, x, w, bias, quantize_input, out_dtype=out_dtype, **opts)

    hint = WEIGHT_ONLY_HINT if not quantize_input else PASSED_OVER_HINT
    return _traced(tag, x, gemm, hint)


@_nvfp4_linear_op.register_fake
def _(x, qdata, scale, global_scale, bias, quantize_input, rht_signs=None, four_over_six=False, backend="",  # noqa: ANN001, ANN202
      out_dtype=None, tag="", scale_swizzled=None):  # noqa: ANN001  # fmt: skip
    return x.new_empty((*x.shape[:-1], qdata.shape[0]), dtype=out_dtype or x.dtype)


def nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "", scale_swizzled: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b with W in NVFP4; x NVFP4-quantized per call (W4A4) or kept as is (W4A16).

    The exact NVFP4 GEMM: products of decoded block values summed in FP32, then times the two
    global scales, plus bias, in `out_dtype` (default x's). With `rht_signs` the weight is stored
    rotated along K (W R) and x is rotated inside its quantize (x R); `four_over_six` picks x's block
    scales 4-or-6. `tag` (a layer's) records what ran (`dispatch.runs`). `scale_swizzled`: W's block
    scales in cuBLASLt's tiled order, kept by the layer (the Blackwell GEMM reads them as they are).
    Under torch.compile a W4A4 TE-recipe layer on `cuda` takes the traced form (`traced_nvfp4_linear`).
    """
    if quantize_input and traced(backend) and rht_signs is None and not four_over_six and x.numel():
        return traced_nvfp4_linear(x, weight, bias, out_dtype or x.dtype, scale_swizzled)
    return _nvfp4_linear_op(x, weight.qdata, weight.scale, weight.global_scale, bias, quantize_input, rht_signs,
                            four_over_six, backend, out_dtype, tag, scale_swizzled)  # fmt: skip


# --- FP8 -----------------------------------------------------------------------------------------


def _ref_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    ran("reference")
    x2 = _flat(x)
    w = weight.data.float()
    if quantize_input:
        xq = fp8_quantize_rowwise(x2)
        acc = (xq.data.float() @ w.t()) * xq.scale * weight.scale.reshape(1, -1)
    else:
        acc = (x2.float() @ w.t()) * weight.scale.reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return _finish(acc, x, out_dtype)


def _fp8_fits(device: torch.device, k: int, n: int, quantize_input: bool = True, **_: object) -> str | None:
    """Whether cuBLASLt's row-wise FP8 GEMM can run a layer of K inputs and N outputs."""
    if k % 16 or n % 16:
        return f"cuBLASLt FP8 needs K % 16 == 0 and N % 16 == 0; got K={k}, N={n}"
    return None


def _cuda_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """W8A8 through cuBLASLt's row-wise scaled GEMM: activations of any float dtype quantized directly,
    BF16 out (what cuBLASLt writes for row-wise scales), cast to `out_dtype` when another is asked for;
    W8A16 as a BF16 GEMM with FP32 output (E4M3 weights are exact in BF16) and the channel scales after."""
    x2 = _flat(x)
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
        return _finish(acc, x, out_dtype)
    if _fp8_fits(x.device, k, n) is not None or x2.shape[0] == 0 or weight.scale.numel() != n:
        return _ref_fp8_linear(x, weight, bias, quantize_input, out_dtype)
    y = _fp8_scaled_mm(fp8_quantize_rowwise(x2), weight, bias)
    ran("cuda: cuBLASLt FP8 row-wise _scaled_mm")
    return _finish(y, x, out_dtype)


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
    backend: str = "", out_dtype: torch.dtype | None = None, tag: str = "",
) -> torch.Tensor:  # fmt: skip
    w = FP8Tensor(data, scale, torch.float32)

    def gemm() -> torch.Tensor:
        if backend:
            return run("fp8_linear", backend, x, w, bias, quantize_input, out_dtype=out_dtype)
        return call("fp8_linear", x.device, x, w, bias, quantize_input, out_dtype=out_dtype)

    hint = WEIGHT_ONLY_HINT if not quantize_input else PASSED_OVER_HINT
    return _traced(tag, x, gemm, hint)


@_fp8_linear_op.register_fake
def _(x, data, scale, bias, quantize_input, backend="", out_dtype=None, tag=""):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], data.shape[0]), dtype=out_dtype or x.dtype)


def fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "",
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b with W in FP8 (per output channel); x FP8 per token (W8A8) or as is (W8A16);
    in `out_dtype` (default x's). `tag` (a layer's) records what ran (`dispatch.runs`); under
    torch.compile a layer on `cuda` takes the traced form (`traced_fp8_linear`)."""
    if quantize_input and traced(backend) and x.numel():
        return traced_fp8_linear(x, weight, bias, out_dtype or x.dtype)
    return _fp8_linear_op(x, weight.data, weight.scale, bias, quantize_input, backend, out_dtype, tag)


# --- INT8 ----------------------------------------------------------------------------------------


def _ref_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    ran("reference")
    return int8.linear(x, weight, bias, out_dtype or x.dtype)


def _int8_fits(device: torch.device, k: int, n: int, **_: object) -> str | None:
    """Whether torch._int_mm can run a layer of K inputs and N outputs (cuBLASLt IMMA: 8-aligned)."""
    if k % 8 or n % 8:
        return f"torch._int_mm needs K % 8 == 0 and N % 8 == 0; got K={k}, N={n}"
    return None


MIN_INT_MM_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows: fewer are padded with zero rows


def _int_mm_rows(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """INT32 a @ w.T through `torch._int_mm`, rows zero-padded to MIN_INT_MM_ROWS on CUDA and cut back."""
    m, k = a.shape
    if a.device.type == "cuda" and m < MIN_INT_MM_ROWS:
        a = torch.cat([a, a.new_zeros(MIN_INT_MM_ROWS - m, k)])
    return torch._int_mm(a, w.t())[:m]


def _cuda_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """W8A8: the row-wise quantize of x (any float dtype), the INT32 GEMM `torch._int_mm` (cuBLASLt
    IMMA on a GPU, oneDNN on a CPU), then the scales and bias in one epilogue pass."""
    x2 = _flat(x)
    n, k = weight.data.shape
    if _int8_fits(x.device, k, n) is not None or x2.shape[0] == 0:
        return _ref_int8_linear(x, weight, bias, out_dtype)
    xq = int8_quantize_rowwise(x2)
    acc = _int_mm_rows(xq.data, weight.data)
    y = int8_scale_epilogue(acc, xq.scale, weight.scale, bias, out_dtype or x.dtype)
    ran("cuda: torch._int_mm INT8 GEMM + scale epilogue")
    return y.reshape(*x.shape[:-1], n)


def _int8_tensor_cores(device: torch.device) -> str | None:
    return tensor_cores(device, "int8")


register("int8_linear", {"reference": _ref_int8_linear, "cuda": _cuda_int8_linear},
         requires={"cuda": _int8_tensor_cores}, fits={"cuda": _int8_fits})  # fmt: skip


@torch.library.custom_op("solrl::int8_linear", mutates_args=())
def _int8_linear_op(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "",
) -> torch.Tensor:  # fmt: skip
    w = Int8Tensor(data, scale, torch.float32)

    def gemm() -> torch.Tensor:
        if backend:
            return run("int8_linear", backend, x, w, bias, out_dtype=out_dtype)
        return call("int8_linear", x.device, x, w, bias, out_dtype=out_dtype)

    return _traced(tag, x, gemm, "INT8 GEMMs need sm_80+ and K, N multiples of 8 (see QuantReport's GEMM line)")


@_int8_linear_op.register_fake
def _(x, data, scale, bias, backend="", out_dtype=None, tag=""):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], data.shape[0]), dtype=out_dtype or x.dtype)


def int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, backend: str = "",
    out_dtype: torch.dtype | None = None, tag: str = "",
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b, W8A8: W INT8 per output channel, x INT8 per token (symmetric, solrl_engine.quant.int8);
    in `out_dtype` (default x's). `tag` (a layer's) records what ran (`dispatch.runs`); under
    torch.compile a layer on `cuda` takes the traced form (`traced_int8_linear`)."""
    if traced(backend) and x.numel():
        return traced_int8_linear(x, weight, bias, out_dtype or x.dtype)
    return _int8_linear_op(x, weight.data, weight.scale, bias, backend, out_dtype, tag)


# --- traced forms (under torch.compile) -------------------------------------------------------------
# Under torch.compile the opaque custom ops above hide the activation quantize from inductor: the
# producer (a norm, a modulation, a GELU) writes its output, then the op reads it again for the row
# amax and the cast. The traced forms are the same math as the layer's `cuda` implementation written
# as plain torch ops (the reference quantize, then the scaled GEMM cuBLASLt runs), so inductor fuses
# the amax and the cast into the kernel that produces x and the epilogue into the GEMM's consumer.
# They run only where the layer chose `cuda` (its GEMM fits; a CPU counts under SOLRL_SIMULATE_SM)
# and only while dynamo traces; eager calls keep the custom ops. What a compiled graph holds is
# recorded by its census (solrl_engine.sampling.compile), not per call.

TRACE_QUANTIZE = True  # `set_trace_quantize(False)`: compiled models keep the opaque ops (for comparison)


def set_trace_quantize(on: bool) -> None:
    """Whether compiled quantized layers take their traced form (the default) or the opaque custom op.
    Dynamo guards on this flag, so changing it recompiles rather than reusing a stale graph."""
    global TRACE_QUANTIZE
    TRACE_QUANTIZE = bool(on)


def traced(backend: str) -> bool:
    """True while dynamo traces a call whose layer runs the `cuda` implementation: take the traced form."""
    return backend == "cuda" and TRACE_QUANTIZE and torch.compiler.is_compiling()


def _no_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager:
    dev = x.device.type
    return torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext()


def traced_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """W8A8 FP8 as `_cuda_fp8_linear` computes it: the reference row-wise quantize (traceable, so fused
    into x's producer), cuBLASLt's row-wise `torch._scaled_mm` with BF16 output, cast to `out_dtype`."""
    with _no_autocast(x):
        return _finish(_fp8_scaled_mm(fp8.quantize_rowwise(_flat(x)), weight, bias), x, out_dtype)


def traced_int8_linear(
    x: torch.Tensor, weight: Int8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """W8A8 INT8 as `_cuda_int8_linear` computes it: the reference row-wise quantize (fused into x's
    producer), `torch._int_mm` (rows padded to 17 on CUDA), the reference epilogue (fused after it)."""
    x2 = _flat(x)
    with _no_autocast(x):
        s = int8.row_scales(x2)
        acc = _int_mm_rows(int8.encode(x2, s), weight.data)
        return int8.scale_epilogue(acc, s, weight.scale, bias, out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def nvfp4_activation_operands(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as float4_e2m1fn_x2, swizzled E4M3 block scales, global decode scale) of the rows of x2: the
    reference quantize (TE recipe) in plain torch ops, so inductor fuses it with x2's producer."""
    xq = nvfp4.quantize(x2)
    return xq.qdata.view(torch.float4_e2m1fn_x2), nvfp4.swizzle_scales(xq.scale), xq.global_scale


def traced_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
    w_swizzled: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """W4A4 NVFP4 as `_cuda_nvfp4_linear` computes it on Blackwell: the traced activation quantize, cuBLASLt's
    block-scaled FP4 `torch._scaled_mm` on the layer's pre-swizzled weight scales, then both global scales
    and the bias (fused by inductor after the GEMM)."""
    with _no_autocast(x):
        acc = _fp4_scaled_mm(*nvfp4_activation_operands(_flat(x)), weight, w_swizzled, bias)
        return _finish(acc, x, out_dtype)
