"""NVIDIA ModelOpt's NVFP4 as a peer: its quantizer on a tensor, `mtq.quantize` on a model copy, and
its NVFP4 checkpoints loaded into QuantLinear without re-quantizing.

Why: ModelOpt is what NVIDIA's deployment stacks (TensorRT-LLM, vLLM "modelopt" checkpoints) use,
so `solrl fidelity` can compare our previews against it; we must know exactly where the two agree.

ModelOpt (`nvidia-modelopt`, tested with 0.47.0 on torch 2.13 CPU) and the TE recipe that
`solrl_engine.quant.nvfp4` follows share the format: E2M1 codes packed two per byte with element 2i
in the low nibble, E4M3 scales per 16 along the last dimension (row-major, not swizzled), an FP32
second-level scale applied on decode. `NVFP4QTensor.quantize` (what ModelOpt's checkpoint export
calls) gives, on ordinary finite data, the same block scales and the same codes except at exact
E2M1 rounding ties. The differences, each pinned by tests/test_modelopt_peer.py:

1. Second-level scale: ModelOpt's is amax / (6 * 448), TE's 1 / (448 * 6 / amax); the two FP32
   values can differ in the last bit.
2. Encode: ModelOpt divides x by (s_blk * scale_2); TE multiplies by the FP32 reciprocal of
   (s_blk * g). A value landing exactly on an E2M1 tie (0.25, 1.25, 2.5, 5) can round to the
   neighbouring code, one step apart: rare (none in 1.3M Gaussian FP32 values; a hand-made case in
   the tests), all other codes and every block scale agree bit for bit.
3. Decode order: ModelOpt decodes e2m1 * (s_blk * scale_2), TE (e2m1 * s_blk) * g (the order of a
   block-scaled GEMM, whose epilogue applies the global scale). With identical codes and scales the
   decoded values differ by one FP32 ulp wherever e2m1 is 1.5, 3 or 6 and s_blk * scale_2 rounds
   (0 to 19% of the elements, depending on scale_2's low bits). QuantLinear loaded from a ModelOpt
   checkpoint therefore decodes exactly as our `dequantize` of ModelOpt's codes and scales, and
   within one ulp of ModelOpt's own decode.
4. Tiny blocks: ModelOpt clamps block scales from below at 2^-9 (E4M3's smallest subnormal) and
   encodes the block; TE rounds the scale to nearest even, so a scale <= 2^-10 flushes to 0 and the
   block decodes to zeros: blocks whose max is below ~2.2e-6 (2^-10 / 448) of the tensor's amax,
   i.e. data spread over many decades.
5. All-zero blocks: ModelOpt writes scale 1.0, TE 0.0; both decode to zeros.
6. All-zero tensor: ModelOpt's amax is 0, scale_2 = 0 and its block scales 0 / 0 = NaN, so the whole
   tensor decodes to NaN (zero-initialised layers: adaLN-Zero, LoRA B); TE uses S_enc = 1, zeros.
7. NaN / Inf: ModelOpt's amax takes them in, so scale_2 becomes NaN / Inf and every decoded value of
   the tensor NaN; TE (and this project) take the amax over finite values and turn only the blocks
   holding NaN / Inf into NaN.
8. Shapes: ModelOpt zero-pads a last dimension that is not a multiple of 16; we refuse it.

`mtq.quantize(model, NVFP4_DEFAULT_CFG, loop)` itself does not run on CPU: its dynamic block
quantizer asserts "amax must be a CUDA tensor for dynamic block quantization" and on a GPU runs a
Triton kernel (`fp4_fake_quant_block`). Read, not run here (no GPU in the session that wrote this):
that kernel computes the block scale as e4m3(blk_amax / (6 scale_2)) * scale_2 and replaces any
such scale below 1e-5 (an absolute threshold) by 1.0, so every block whose max is below ~6e-5
decodes to zero whatever the tensor's amax (TE keeps such blocks down to ~2.2e-6 of the amax); it
encodes |x| / scale with the same round-half-even thresholds and decodes q * scale. `quantize_model_modelopt` therefore
routes ModelOpt's NVFP4 quantizers on CPU through a registered ModelOpt backend that calls
`NVFP4QTensor` (the export numerics above) with each quantizer's calibrated amax; on CUDA it leaves
ModelOpt's own kernel in place.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from solrl_engine.nn.quant_linear import QuantLinear
from solrl_engine.quant.nvfp4 import BLOCK, NVFP4Tensor

PIP_HINT = "pip install nvidia-modelopt  (or: pip install -e '.[modelopt]')"
CPU_BACKEND = "solrl_nvfp4_qtensor"  # the ModelOpt quant backend name quantize_model_modelopt registers
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def _qtensor():  # noqa: ANN202 - the ModelOpt class, imported lazily
    try:
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except ImportError as e:
        raise ImportError(f"NVIDIA ModelOpt is not installed ({e}); {PIP_HINT}") from e
    return NVFP4QTensor


def _mtq():  # noqa: ANN202 - modelopt.torch.quantization, imported lazily
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise ImportError(f"NVIDIA ModelOpt is not installed ({e}); {PIP_HINT}") from e
    return mtq


def _scale_2(x: torch.Tensor, amax: float | torch.Tensor | None) -> torch.Tensor | None:
    """ModelOpt's second-level scale for a given amax (its export formula, amax / (6 * 448)); None
    lets NVFP4QTensor take the tensor's own amax."""
    if amax is None:
        return None
    return torch.as_tensor(amax, device=x.device).float().reshape(()) / (E2M1_MAX * E4M3_MAX)


def _check(x: torch.Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension must be a multiple of {BLOCK}; got shape {tuple(x.shape)}")


def modelopt_quantize(x: torch.Tensor, amax: float | torch.Tensor | None = None) -> NVFP4Tensor:
    """`x` quantized by ModelOpt's NVFP4QTensor, as our NVFP4Tensor (codes, E4M3 scales, and ModelOpt's
    scale_2 as the decode scale); `amax` is a calibrated per-tensor amax, default x's own."""
    _check(x)
    q, scale, scale_2 = _qtensor().quantize(x, BLOCK, weights_scaling_factor_2=_scale_2(x, amax))
    packed = q._quantized_data
    return NVFP4Tensor(packed.reshape(*x.shape[:-1], x.shape[-1] // 2), scale.reshape(*x.shape[:-1], -1),
                       scale_2.float().reshape(()), x.dtype)  # fmt: skip


def modelopt_fake_quantize(x: torch.Tensor, amax: float | torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize with ModelOpt's own NVFP4QTensor code (its encode and its decode order);
    same shape and dtype as `x`. `amax`: a calibrated per-tensor amax, default x's own."""
    _check(x)
    q, scale, scale_2 = _qtensor().quantize(x, BLOCK, weights_scaling_factor_2=_scale_2(x, amax))
    return q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: BLOCK}).to(x.dtype)


def _qtensor_backend(inputs: torch.Tensor, quantizer: Any) -> torch.Tensor:
    """A ModelOpt quant backend: NVFP4 fake-quant through NVFP4QTensor with the quantizer's calibrated
    per-tensor amax (the tensor's own before calibration); the last dimension is zero-padded to a
    multiple of 16 as ModelOpt pads it."""
    amax = getattr(quantizer, "_amax", None)
    if amax is not None and amax.numel() != 1:
        raise ValueError(f"{CPU_BACKEND} takes a per-tensor amax; got shape {tuple(amax.shape)}")
    k = inputs.shape[-1]
    pad = (-k) % BLOCK
    x = torch.nn.functional.pad(inputs, (0, pad)) if pad else inputs
    return modelopt_fake_quantize(x, amax)[..., :k]


def _is_nvfp4(cfg: dict) -> bool:
    bits = cfg.get("num_bits")
    blocks = cfg.get("block_sizes") or {}
    return bits is not None and tuple(bits) == (2, 1) and tuple(blocks.get("scale_bits", ())) == (4, 3)


def _with_backend(config: dict, backend: str) -> dict:
    """A copy of a ModelOpt quantize config whose NVFP4 quantizers use `backend` (both the list form
    of quant_cfg, ModelOpt >= 0.4x, and the older pattern -> attributes dict)."""
    cfg = copy.deepcopy(config)
    qc = cfg.get("quant_cfg")
    entries = [e.get("cfg") for e in qc] if isinstance(qc, list) else list((qc or {}).values())
    for attrs in entries:
        for a in attrs if isinstance(attrs, list) else [attrs]:
            if isinstance(a, dict) and _is_nvfp4(a):
                a["backend"] = backend
    return cfg


def quantize_model_modelopt(
    model: torch.nn.Module,
    calib_forward: Callable[[torch.nn.Module], Any],
    config: dict | None = None,
    cpu_backend: bool | None = None,
) -> torch.nn.Module:
    """A copy of `model` fake-quantized by ModelOpt (`mtq.quantize`, NVFP4_DEFAULT_CFG unless `config`),
    calibrated by `calib_forward(copy)`; `model` is left untouched.

    `cpu_backend` (default: when the model is not on CUDA) routes the NVFP4 quantizers through
    NVFP4QTensor, because ModelOpt's own fake-quant kernel needs CUDA (module doc)."""
    mtq = _mtq()
    q = copy.deepcopy(model)
    cfg = config if config is not None else mtq.NVFP4_DEFAULT_CFG
    if cpu_backend is None:
        p = next(q.parameters(), None)
        cpu_backend = p is None or p.device.type != "cuda"
    if cpu_backend:
        from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq

        if not tq.is_registered_quant_backend(CPU_BACKEND):
            tq.register_quant_backend(CPU_BACKEND, _qtensor_backend)
        cfg = _with_backend(cfg, CPU_BACKEND)
    return mtq.quantize(q, cfg, calib_forward)


@torch.no_grad()
def load_modelopt_nvfp4(
    qlinear: torch.nn.Module,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Fill an NVFP4 QuantLinear (no rotation / low-rank) from a ModelOpt NVFP4 checkpoint's tensors,
    as exported for TensorRT-LLM and vLLM, without re-quantizing: `weight_packed` uint8 [out, in/2]
    (element 2i in the low nibble, as ours), `weight_scale` E4M3 [out, in/16] (row-major),
    `weight_scale_2` the FP32 decode scale amax / 2688 (our `w_global_scale`).

    `input_scale` (ModelOpt's calibrated activation amax / 2688) is checked and kept as
    `qlinear.modelopt_input_amax` (= input_scale * 2688) for a static-activation path; QuantLinear
    itself quantizes activations with each call's own amax, so it does not change the forward.
    `bias` (the checkpoint's BF16 bias) is copied when given and the layer has one."""
    if not isinstance(qlinear, QuantLinear) or qlinear.recipe.format != "nvfp4":
        raise TypeError(f"load_modelopt_nvfp4 fills an NVFP4 QuantLinear; got {type(qlinear).__name__}")
    r = qlinear.recipe
    if r.rht or r.lowrank:
        raise ValueError(f"a ModelOpt checkpoint holds plain NVFP4 weights; this layer's recipe is {r.name} "
                         "(rotated or split weights): build the layer with the plain 'nvfp4' recipe")  # fmt: skip
    out_f, in_f = qlinear.out_features, qlinear.in_features
    want = {"weight_packed": (out_f, in_f // 2), "weight_scale": (out_f, in_f // BLOCK)}
    for name, t in (("weight_packed", weight_packed), ("weight_scale", weight_scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; a {out_f}x{in_f} layer needs {want[name]}")
        if t.element_size() != 1:
            raise TypeError(f"{name} must be 1-byte (uint8 / float8_e4m3fn); got {t.dtype}")
    for name, t in (("weight_scale_2", weight_scale_2), ("input_scale", input_scale)):
        if t is not None and (t.numel() != 1 or not bool(torch.isfinite(t.float()).all()) or bool(t.float() < 0)):
            raise ValueError(f"{name} must be one finite value >= 0 (per tensor); got {t}")
    dev = qlinear.w_qdata.device
    qlinear.w_qdata.copy_(weight_packed.to(dev).view(torch.uint8))
    qlinear.w_scale.copy_(weight_scale.to(dev).view(torch.float8_e4m3fn))
    qlinear.w_global_scale.copy_(weight_scale_2.to(dev, torch.float32).reshape(()))
    if bias is not None:
        if qlinear.bias is None or tuple(bias.shape) != (out_f,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not fit this layer (out {out_f}, "
                             f"bias={qlinear.bias is not None})")  # fmt: skip
        qlinear.bias.copy_(bias.detach().to(dev))
    if input_scale is not None:
        qlinear.__dict__["modelopt_input_amax"] = input_scale.to(dev, torch.float32).reshape(()) * (E2M1_MAX * E4M3_MAX)
