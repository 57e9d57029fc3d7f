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
W8A8 with BF16 activations, a BF16 GEMM with FP32 output for W8A16 (E4M3 is exact in BF16).
All compute the same math: the products of exactly decoded values, accumulated in FP32, times the
global scales, plus bias; only accumulation order and the output rounding of cuBLAS differ.
"""

from __future__ import annotations

import torch

from solrl_engine.kernels.dispatch import call, cuda_extension, register, run, triton_module
from solrl_engine.kernels.ops import (
    cuda_quantize,
    fp8_quantize_rowwise,
    hadamard_rotate,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from solrl_engine.quant import hadamard, nvfp4
from solrl_engine.quant.fp8 import FP8Tensor
from solrl_engine.quant.nvfp4 import NVFP4Tensor


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return acc.to(x.dtype).reshape(*x.shape[:-1], acc.shape[-1])


def _tensor_cores(device: torch.device, fmt: str, needs: tuple[int, int]) -> str | None:
    """None when `device` has `fmt` tensor cores (compute capability >= `needs`), else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{fmt} tensor-core GEMMs run on CUDA devices, not {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < needs:
        return f"sm_{cap[0]}{cap[1]} has no {fmt} tensor cores (needs sm_{needs[0]}{needs[1]}+)"
    return None


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
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False,
) -> torch.Tensor:  # fmt: skip
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
    return _finish(acc, x)


def _tr_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False,
) -> torch.Tensor:  # fmt: skip
    gemm = triton_module("gemm")
    x2 = _flat(x)
    if quantize_input:
        xq = nvfp4_quantize(x2, None, four_over_six, rht_signs)
        y = gemm.w4a4_gemm(
            xq.qdata, xq.scale, xq.global_scale, weight.qdata, weight.scale, weight.global_scale, bias, x.dtype
        )
    elif x.dtype in (torch.bfloat16, torch.float16):
        xr = x2 if rht_signs is None else hadamard_rotate(x2, rht_signs)  # one launch, the reference's bits
        y = gemm.w4a16_gemm(xr, weight.qdata, weight.scale, weight.global_scale, bias, x.dtype)
    else:  # FP32 activations: the weight-only kernel would have to round them; keep them exact
        return _ref_nvfp4_linear(x, weight, bias, quantize_input, rht_signs, four_over_six)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def scaled_mm_fp4_operands(t: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data as float4_e2m1fn_x2 [rows, K/2], flat swizzled E4M3 scales): cuBLASLt's FP4 layout."""
    return t.qdata.view(torch.float4_e2m1fn_x2), nvfp4.swizzle_scales(t.scale)


def _cuda_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False,
) -> torch.Tensor:  # fmt: skip
    n, k = weight.shape
    if _cuda_fits(x.device, k, n, quantize_input, four_over_six, rht_signs is not None) is not None:
        # reached only through `call` (a layer's `choose` never picks cuda for these): the Triton GEMM
        return _tr_nvfp4_linear(x, weight, bias, quantize_input, rht_signs, four_over_six)
    xq = nvfp4_quantize(_flat(x))
    a, sa = scaled_mm_fp4_operands(xq)
    b, sb = scaled_mm_fp4_operands(weight)
    acc = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32)
    acc = acc * (xq.global_scale * weight.global_scale)
    if bias is not None:
        acc = acc + bias.float()
    return _finish(acc, x)


def _cutlass_nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False,
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
    sb = nvfp4.swizzle_scales(weight.scale).view(torch.uint8)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    y = ext.nvfp4_gemm_sm100(xq.qdata, xq.scale.view(torch.uint8), weight.qdata, sb, alpha, b, stream)
    return _finish(y, x)


def _fp4_tensor_cores(device: torch.device) -> str | None:
    reason = _tensor_cores(device, "FP4", (10, 0))
    if reason is not None:
        return reason + "; Hopper uses the triton GEMM"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 (needs torch >= 2.8)"
    return None


def _cutlass_requires(device: torch.device) -> str | None:
    reason = _tensor_cores(device, "FP4", (10, 0))
    if reason is not None:
        return reason
    if torch.cuda.get_device_capability(device) != (10, 0):
        return "the CUTLASS GEMM is built for sm_100a only"
    ext = cuda_extension()
    if ext is None or not hasattr(ext, "nvfp4_gemm_sm100"):
        return "solrl_engine._C with its CUTLASS GEMM is not built (see README: building the extension)"
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
) -> torch.Tensor:
    w = NVFP4Tensor(qdata, scale, global_scale, torch.float32)
    opts = () if rht_signs is None and not four_over_six else (rht_signs, four_over_six)
    if backend:  # the layer's own choice (QuantLinear.kernel)
        return run("nvfp4_linear", backend, x, w, bias, quantize_input, *opts)
    return call("nvfp4_linear", x.device, x, w, bias, quantize_input, *opts)


@_nvfp4_linear_op.register_fake
def _(x, qdata, scale, global_scale, bias, quantize_input, rht_signs=None, four_over_six=False, backend=""):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


def nvfp4_linear(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, quantize_input: bool,
    rht_signs: torch.Tensor | None = None, four_over_six: bool = False, backend: str = "",
) -> torch.Tensor:  # fmt: skip
    """y = x W^T + b with W in NVFP4; x NVFP4-quantized per call (W4A4) or kept as is (W4A16).

    The exact NVFP4 GEMM: products of decoded block values summed in FP32, then times the two
    global scales, plus bias, in x's dtype. With `rht_signs` the weight is stored rotated along K
    (W R) and x is rotated inside its quantize (x R); `four_over_six` picks x's block scales 4-or-6.
    """
    return _nvfp4_linear_op(x, weight.qdata, weight.scale, weight.global_scale, bias, quantize_input, rht_signs,
                            four_over_six, backend)  # fmt: skip


# --- FP8 -----------------------------------------------------------------------------------------


def _ref_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool
) -> torch.Tensor:
    x2 = _flat(x)
    w = weight.data.float()
    if quantize_input:
        xq = fp8_quantize_rowwise(x2)
        acc = (xq.data.float() @ w.t()) * xq.scale * weight.scale.reshape(1, -1)
    else:
        acc = (x2.float() @ w.t()) * weight.scale.reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return _finish(acc, x)


def _scaled_mm_fits(x2: torch.Tensor, weight: FP8Tensor) -> bool:
    n, k = weight.data.shape
    return k % 16 == 0 and n % 16 == 0 and x2.shape[0] > 0 and weight.scale.numel() == n


def _cuda_fp8_linear(
    x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool
) -> torch.Tensor:
    """W8A8 through cuBLASLt's row-wise scaled GEMM (BF16 out, as cuBLASLt requires for it, so for
    BF16 activations: others take the reference); W8A16 as a BF16 GEMM with FP32 output (E4M3
    weights are exact in BF16) and the channel scales after."""
    x2 = _flat(x)
    if not quantize_input:
        if x.dtype != torch.bfloat16 or x.device.type != "cuda":
            return _ref_fp8_linear(x, weight, bias, quantize_input)
        acc = torch.mm(x2, weight.data.to(torch.bfloat16).t(), out_dtype=torch.float32)
        acc = acc * weight.scale.reshape(1, -1)
        if bias is not None:
            acc = acc + bias.float()
        return _finish(acc, x)
    if x.dtype != torch.bfloat16 or not _scaled_mm_fits(x2, weight):
        return _ref_fp8_linear(x, weight, bias, quantize_input)
    xq = fp8_quantize_rowwise(x2)
    y = torch._scaled_mm(
        xq.data,
        weight.data.t(),
        scale_a=xq.scale.reshape(-1, 1).contiguous(),
        scale_b=weight.scale.reshape(1, -1).contiguous(),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
    )
    return _finish(y, x)


def _fp8_tensor_cores(device: torch.device) -> str | None:
    return _tensor_cores(device, "FP8", (8, 9))


register("fp8_linear", {"reference": _ref_fp8_linear, "cuda": _cuda_fp8_linear}, requires={"cuda": _fp8_tensor_cores})


@torch.library.custom_op("solrl::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, quantize_input: bool
) -> torch.Tensor:
    return call("fp8_linear", x.device, x, FP8Tensor(data, scale, torch.float32), bias, quantize_input)


@_fp8_linear_op.register_fake
def _(x, data, scale, bias, quantize_input):  # noqa: ANN001, ANN202 - shape function
    return x.new_empty((*x.shape[:-1], data.shape[0]))


def fp8_linear(x: torch.Tensor, weight: FP8Tensor, bias: torch.Tensor | None, quantize_input: bool) -> torch.Tensor:
    """y = x W^T + b with W in FP8 (per output channel); x FP8 per token (W8A8) or as is (W8A16)."""
    return _fp8_linear_op(x, weight.data, weight.scale, bias, quantize_input)
