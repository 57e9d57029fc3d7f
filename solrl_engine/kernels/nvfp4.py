"""NVFP4 behind the dispatch seam: the quantize ops (quantize, fake-quant, dequantize, in-place requantize,
the Hadamard rotation alone) and the GEMM `nvfp4_linear`, its custom op and its traced form.

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
All compute the same math: the products of exactly decoded values, accumulated in FP32, times the two
global scales, plus bias; only accumulation order and the output rounding of cuBLAS differ.
Every op has a reference implementation (solrl_engine.quant) that the others are tested against.
"""

from __future__ import annotations

import torch

from solrl_engine.kernels._gemm import (
    PASSED_OVER_HINT,
    WEIGHT_ONLY_HINT,
    finish,
    flat,
    no_autocast,
    run_recorded,
    traced,
)
from solrl_engine.kernels.capability import FormatKernels, TensorCores, device_capability, tensor_cores
from solrl_engine.kernels.dispatch import _warn_once, call, cuda_extension, ran, register, run, triton_module
from solrl_engine.quant import hadamard, nvfp4
from solrl_engine.quant.nvfp4 import NVFP4Tensor

AmaxLike = float | torch.Tensor | None

# --- quantize ------------------------------------------------------------------------------------


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


# --- fake-quant ----------------------------------------------------------------------------------


def _tr_fake_quantize(x: torch.Tensor, amax: AmaxLike = None) -> torch.Tensor:
    return triton_module("nvfp4").fake_quantize(x, _checked_amax(x, amax))


register("nvfp4_fake_quantize", {"reference": nvfp4.fake_quantize, "triton": _tr_fake_quantize})


def nvfp4_fake_quantize(x: torch.Tensor, amax: AmaxLike = None) -> torch.Tensor:
    """Quantize-dequantize in one pass; same shape and dtype as `x`."""
    return call("nvfp4_fake_quantize", x.device, x, amax)


# --- dequantize ----------------------------------------------------------------------------------


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


# --- the GEMM ------------------------------------------------------------------------------------


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
    x2 = flat(x)
    w = _unit_scale_values(weight)
    if quantize_input:  # the rotation and the 4/6 choice inside the activation quantize
        xr = x2 if rht_signs is None else hadamard.rotate(x2, rht_signs)
        xv, xg = nvfp4.fake_quantize_unit(xr, None, four_over_six)
        acc = (xv @ w.t()) * (xg * weight.global_scale)
    else:
        acc = (_rotated(x2, rht_signs).float() @ w.t()) * weight.global_scale
    if bias is not None:
        acc = acc + bias.float()
    return finish(acc, x, out_dtype)


def _tr_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    gemm = triton_module("gemm")
    x2 = flat(x)
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
    xq = nvfp4_quantize(flat(x))
    acc = _fp4_scaled_mm(*scaled_mm_fp4_operands(xq), xq.global_scale, weight, w_swizzled, bias)
    ran("cuda: cuBLASLt NVFP4 block-scaled _scaled_mm")
    return finish(acc, x, out_dtype)


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
    xq = cuda_quantize(flat(x), swizzle=True)
    alpha = xq.global_scale * weight.global_scale
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    sb = w_swizzled if w_swizzled is not None else nvfp4.swizzle_scales(weight.scale).view(torch.uint8)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    y = ext.nvfp4_gemm_sm100(xq.qdata, xq.scale.view(torch.uint8), weight.qdata, sb, alpha, b, stream)
    ran("cutlass: CUTLASS sm100 NVFP4 GEMM")
    return finish(y, x, out_dtype)


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
    return run_recorded(tag, x, gemm, hint)


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


# --- traced form (under torch.compile; see _gemm) ------------------------------------------------


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
    with no_autocast(x):
        acc = _fp4_scaled_mm(*nvfp4_activation_operands(flat(x)), weight, w_swizzled, bias)
        return finish(acc, x, out_dtype)


# FP4 tensor cores from Blackwell; the Triton in-kernel-decode GEMM (FP16 MMA) runs it on Ada and Hopper
KERNELS = FormatKernels("nvfp4", TensorCores("FP4", (10, 0), cpu_op=False, nominal_speedup=4.0), "nvfp4_linear",
                        runs_from=(8, 9))  # fmt: skip
