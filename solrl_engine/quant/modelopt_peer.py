"""NVIDIA ModelOpt's NVFP4 as a peer: its quantizer on a tensor, and its NVFP4 checkpoints loaded
into QuantLinear without re-quantizing.

ModelOpt (`nvidia-modelopt`, `modelopt.torch.quantization.qtensor.NVFP4QTensor`) and the TE recipe
that `solrl_engine.quant.nvfp4` follows share the format (E2M1 codes packed low nibble first, E4M3
scales per 16, an FP32 second-level scale) and, on ordinary data, every code and block scale. They
differ at the edges (pinned by tests/test_modelopt_peer.py):

1. The second-level scale: ModelOpt stores amax / (6 * 448), TE the reciprocal of 448 * 6 / amax;
   the two FP32 values can differ in the last bit, so decoded values can differ by one ulp.
2. Tiny blocks: where a block's scale would round below E4M3's smallest subnormal (2^-9), ModelOpt
   keeps 2^-9 and encodes the block; TE flushes the scale to 0 and the block decodes to zeros.
3. All-zero blocks: ModelOpt writes scale 1.0, TE 0.0; both decode to zeros.
4. NaN / Inf: ModelOpt's amax takes them in, so the second-level scale and every decoded value of
   the tensor become NaN; TE (and this project) take the amax over finite values and turn only the
   blocks holding NaN / Inf into NaN.
ModelOpt's dynamic activation quantizer (`TensorQuantizer` with NVFP4 block sizes) runs on CUDA only;
`NVFP4QTensor.quantize`, used here, runs anywhere.
"""

from __future__ import annotations

import torch

from solrl_engine.quant.nvfp4 import BLOCK, NVFP4Tensor


def _qtensor():  # noqa: ANN202 - the ModelOpt class, imported lazily
    try:
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except ImportError as e:
        raise ImportError(f"NVIDIA ModelOpt is not installed ({e}); pip install nvidia-modelopt") from e
    return NVFP4QTensor


def modelopt_quantize(x: torch.Tensor) -> NVFP4Tensor:
    """`x` quantized by ModelOpt's NVFP4QTensor (dynamic scales from x itself), as our NVFP4Tensor."""
    q, scale, scale_2 = _qtensor().quantize(x, BLOCK)
    packed = q._quantized_data
    return NVFP4Tensor(packed.reshape(*x.shape[:-1], x.shape[-1] // 2), scale.reshape(*x.shape[:-1], -1),
                       scale_2.float().reshape(()), x.dtype)  # fmt: skip


def modelopt_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize with ModelOpt's numerics (decoded by ModelOpt itself); same shape and dtype."""
    q, scale, scale_2 = _qtensor().quantize(x, BLOCK)
    return q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: BLOCK}).to(x.dtype)


@torch.no_grad()
def load_modelopt_nvfp4(layer: torch.nn.Module, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor) -> None:  # fmt: skip
    """Fill a QuantLinear (NVFP4, TE recipe, no rotation / low-rank) from a ModelOpt NVFP4 checkpoint's
    tensors, as exported for TensorRT-LLM and vLLM: `weight` uint8 [out, in/2] (two E2M1 codes per
    byte, low nibble first), `weight_scale` E4M3 [out, in/16], `weight_scale_2` the FP32 second-level
    scale (amax / 2688). The layer then computes with ModelOpt's values exactly; nothing is re-quantized."""
    from solrl_engine.nn.quant_linear import QuantLinear

    if not isinstance(layer, QuantLinear) or layer.recipe.format != "nvfp4":
        raise TypeError(f"load_modelopt_nvfp4 fills an NVFP4 QuantLinear; got {type(layer).__name__}")
    r = layer.recipe
    if r.rht or r.lowrank:
        raise ValueError(f"a ModelOpt checkpoint holds plain NVFP4 weights; this layer's recipe is {r.name} "
                         "(rotated or split weights): build the layer with the plain 'nvfp4' recipe")  # fmt: skip
    out_f, in_f = layer.out_features, layer.in_features
    want = {"weight": (out_f, in_f // 2), "weight_scale": (out_f, in_f // BLOCK)}
    for name, t in (("weight", weight), ("weight_scale", weight_scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; a {out_f}x{in_f} layer needs {want[name]}")
    if weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be one value (per tensor); got shape {tuple(weight_scale_2.shape)}")
    dev = layer.w_qdata.device
    layer.w_qdata.copy_(weight.to(dev).view(torch.uint8))
    layer.w_scale.copy_(weight_scale.to(dev).view(torch.float8_e4m3fn))
    layer.w_global_scale.copy_(weight_scale_2.to(dev, torch.float32).reshape(()))
