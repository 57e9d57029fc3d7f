"""NVFP4 in a QuantLinear: packed E2M1 codes, E4M3 block scales (and their cuBLASLt-tiled copy), an FP32 global
scale; with the recipe's options, the Hadamard rotation's signs and SVDQuant's BF16 low-rank branch."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.nn.formats import LinearFormat
from solrl_engine.quant import hadamard
from solrl_engine.quant import nvfp4 as nvfp4_ref
from solrl_engine.quant.nvfp4 import NVFP4Tensor


class NVFP4Linear(LinearFormat):
    format = "nvfp4"

    def buffers(self, layer: nn.Module, device: torch.device | str | None) -> None:
        o, i, r = layer.out_features, layer.in_features, layer.recipe
        if r.rht and i % r.rht:
            hadamard.check_size(r.rht, i)  # raises, naming the sizes and the fix
        layer.register_buffer("w_qdata", torch.zeros(o, i // 2, dtype=torch.uint8, device=device))
        layer.register_buffer("w_scale", torch.zeros(o, i // 16, dtype=torch.float8_e4m3fn, device=device))
        layer.register_buffer("w_global_scale", torch.ones((), dtype=torch.float32, device=device))
        # the block scales again in cuBLASLt's 128x4 tiled order, written with them (set_weight_), so the
        # Blackwell GEMM reads them as they are instead of swizzling them per call; derived, so not saved
        layer.register_buffer("w_scale_swizzled", torch.zeros(nvfp4_ref.swizzled_numel(o, i // 16), dtype=torch.uint8,
                                                               device=device), persistent=False)  # fmt: skip
        # the rotation's signs (the weight is stored rotated; inputs are rotated inside their quantize)
        layer.register_buffer("rht_signs", hadamard.signs(r.rht, r.rht_seed, device) if r.rht else None)
        # SVDQuant's split: W = lr_up @ lr_down + residual, the residual in NVFP4, the branch in BF16
        rank = r.lowrank
        layer.register_buffer("lr_down", torch.zeros(rank, i, dtype=torch.bfloat16, device=device) if rank else None)
        layer.register_buffer("lr_up", torch.zeros(o, rank, dtype=torch.bfloat16, device=device) if rank else None)

    def stored(self, layer: nn.Module) -> NVFP4Tensor:
        return NVFP4Tensor(layer.w_qdata, layer.w_scale, layer.w_global_scale, torch.float32)

    def set_weight_(self, layer: nn.Module, w: torch.Tensor) -> None:
        if layer.recipe.lowrank:
            w = self._residual_(layer, w)
        kernels.nvfp4_quantize_into_(self.stored(layer), w, None, layer.recipe.four_over_six, layer.rht_signs)
        layer.w_scale_swizzled.copy_(nvfp4_ref.swizzle_scales(layer.w_scale).view(torch.uint8))

    @staticmethod
    def _residual_(layer: nn.Module, w: torch.Tensor) -> torch.Tensor:
        """W minus the low-rank branch. The branch is W's top singular directions, taken from the first
        weight this layer quantizes and kept: later weights (RL updates) re-quantize only their residual,
        which absorbs the update, so the split stays exact at the cost of one SVD per layer per run."""
        wf = w.float()
        if not layer.__dict__.get("lowrank_fixed", False):
            u, sv, vh = torch.linalg.svd(wf, full_matrices=False)
            r = layer.recipe.lowrank
            layer.lr_up.copy_(u[:, :r] * sv[:r])
            layer.lr_down.copy_(vh[:r])
            layer.__dict__["lowrank_fixed"] = True
        return wf - layer.lr_up.float() @ layer.lr_down.float()

    def weight(self, layer: nn.Module) -> torch.Tensor:
        w = kernels.nvfp4_dequantize(self.stored(layer), torch.float32)
        if layer.rht_signs is not None:
            w = hadamard.unrotate(w, layer.rht_signs)
        if layer.lr_up is not None:
            w = w + layer.lr_up.float() @ layer.lr_down.float()
        return w

    def linear(self, layer: nn.Module, x: torch.Tensor, backend: str, out: torch.dtype) -> torch.Tensor:
        r = layer.recipe
        y = kernels.nvfp4_linear(x, self.stored(layer), layer.bias, r.quantize_activations, layer.rht_signs,
                                 r.four_over_six, backend, out, layer.kernel_tag, layer.w_scale_swizzled)  # fmt: skip
        if layer.lr_up is not None:  # the BF16 low-rank branch on the un-rotated input
            xb = x.to(layer.lr_down.dtype)
            y = y + nn.functional.linear(nn.functional.linear(xb, layer.lr_down), layer.lr_up).to(y.dtype)
        return y


HANDLER = NVFP4Linear()
