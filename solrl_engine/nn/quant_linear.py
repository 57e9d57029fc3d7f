"""QuantLinear: an nn.Linear whose weight is stored quantized (NVFP4, FP8, INT8 or BF16).

The layer is an inference copy (the explore policy): its tensors are buffers, not parameters, and
`set_weight_` rewrites them in place so that compiled graphs and captured CUDA graphs that point at
them stay valid across RL updates.

Under autocast it behaves as nn.Linear does: whatever dtype arrives (FP32 from a LayerNorm that
autocast keeps in FP32, BF16 from a GEMM), the output is the autocast dtype, and the fast kernel runs:
activations that are quantized are quantized from their own dtype, weight-only layers take their
input cast to the autocast dtype. Each call records what actually ran (`kernel_tag`, see
`solrl_engine.nn.fast_path`).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.quant import hadamard
from solrl_engine.quant import nvfp4 as nvfp4_ref
from solrl_engine.quant.fp8 import FP8Tensor
from solrl_engine.quant.int8 import Int8Tensor
from solrl_engine.quant.nvfp4 import NVFP4Tensor
from solrl_engine.quant.recipe import QuantRecipe, get_recipe

_UIDS = itertools.count()


def io_dtypes(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype a linear computes in, its output dtype) for input `x`: the autocast dtype under
    autocast (nn.Linear's behaviour: inputs of any float dtype are cast, the output is that dtype),
    else x's own. A device without autocast (meta: shape tracing, the capture rehearsal) has none."""
    dev = x.device.type
    if x.is_floating_point() and torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        d = torch.get_autocast_dtype(dev)
        return d, d
    return x.dtype, x.dtype


class QuantLinear(nn.Module):
    """Drop-in replacement for nn.Linear with a quantized weight.

    Output = the exact quantized GEMM (see solrl_engine.kernels.nvfp4_linear / fp8_linear), with the
    input quantized per call when the recipe quantizes activations.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str | QuantRecipe = "nvfp4",
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.recipe = get_recipe(recipe)
        self.in_features = in_features
        self.out_features = out_features
        fmt = self.recipe.format
        if fmt == "nvfp4" and in_features % 16:
            raise ValueError(
                f"NVFP4 needs in_features to be a multiple of 16; got {in_features}. "
                "Leave this layer unquantized (quantize_model does so automatically)."
            )
        if fmt == "nvfp4":
            r = self.recipe
            if r.rht and in_features % r.rht:
                hadamard.check_size(r.rht, in_features)  # raises, naming the sizes and the fix
            self.register_buffer(
                "w_qdata", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer(
                "w_scale", torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn, device=device)
            )
            self.register_buffer("w_global_scale", torch.ones((), dtype=torch.float32, device=device))
            # the block scales again in cuBLASLt's 128x4 tiled order, written with them (set_weight_), so the
            # Blackwell GEMM reads them as they are instead of swizzling them per call; derived, so not saved
            self.register_buffer("w_scale_swizzled", torch.zeros(
                nvfp4_ref.swizzled_numel(out_features, in_features // 16), dtype=torch.uint8, device=device),
                persistent=False)  # fmt: skip
            # the rotation's signs (the weight is stored rotated; inputs are rotated inside their quantize)
            signs = hadamard.signs(r.rht, r.rht_seed, device) if r.rht else None
            self.register_buffer("rht_signs", signs)
            # SVDQuant's split: W = lr_up @ lr_down + residual, the residual in NVFP4, the branch in BF16
            rank = r.lowrank
            self.register_buffer("lr_down", torch.zeros(rank, in_features, dtype=torch.bfloat16, device=device)
                                 if rank else None)  # fmt: skip
            self.register_buffer("lr_up", torch.zeros(out_features, rank, dtype=torch.bfloat16, device=device)
                                 if rank else None)  # fmt: skip
        elif fmt == "fp8":
            self.register_buffer(
                "w_data", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
            )
            self.register_buffer("w_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        elif fmt == "int8":
            self.register_buffer("w_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("w_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        else:
            self.register_buffer("w_bf16", torch.zeros(out_features, in_features, dtype=torch.bfloat16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)
        # The BF16 weight this layer was made from, when kept (not a buffer: never saved twice).
        self.__dict__["master_weight"] = None
        # The key of this layer's fast-path record (quantize_model puts the layer's name in front).
        self.kernel_tag = f"QuantLinear#{next(_UIDS)}"

    @classmethod
    def from_linear(
        cls, linear: nn.Linear | nn.Conv2d, recipe: str | QuantRecipe = "nvfp4", keep_master: bool = False
    ) -> QuantLinear:
        """Quantize an nn.Linear (or a 1x1 nn.Conv2d, for QuantConv1x1); with `keep_master`, remember
        its weight for `requantize_()`."""
        w = linear.weight
        in_f, out_f = (w.shape[1], w.shape[0])
        q = cls(
            in_f,
            out_f,
            bias=linear.bias is not None,
            recipe=recipe,
            device=w.device,
            bias_dtype=linear.bias.dtype if linear.bias is not None else w.dtype,
        )
        q.set_weight_(w, linear.bias)
        if keep_master:
            q.__dict__["master_weight"] = w
        return q

    # --- storage -----------------------------------------------------------------------------------

    def _nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.w_qdata, self.w_scale, self.w_global_scale, torch.float32)

    def _fp8(self) -> FP8Tensor:
        return FP8Tensor(self.w_data, self.w_scale, torch.float32)

    def _int8(self) -> Int8Tensor:
        return Int8Tensor(self.w_int8, self.w_scale, torch.float32)

    @torch.no_grad()
    def set_weight_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantize `weight` into this layer's existing buffers (same storage, no reallocation)."""
        if weight.dim() == 4 and tuple(weight.shape[2:]) == (1, 1):  # a 1x1 convolution's [out, in, 1, 1]
            weight = weight.reshape(weight.shape[0], weight.shape[1])
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit a QuantLinear of "
                f"{self.out_features}x{self.in_features}."
            )
        fmt = self.recipe.format
        dev = self.bias.device if self.bias is not None else next(self.buffers()).device
        w = weight.detach().to(dev)
        if fmt == "nvfp4":
            if self.recipe.lowrank:
                w = self._residual_(w)
            kernels.nvfp4_quantize_into_(self._nvfp4(), w, None, self.recipe.four_over_six, self.rht_signs)
            self.w_scale_swizzled.copy_(nvfp4_ref.swizzle_scales(self.w_scale).view(torch.uint8))
        elif fmt == "fp8":
            q = kernels.fp8_quantize_rowwise(w)
            self.w_data.copy_(q.data)
            self.w_scale.copy_(q.scale)
        elif fmt == "int8":
            qi = kernels.int8_quantize_rowwise(w)
            self.w_int8.copy_(qi.data)
            self.w_scale.copy_(qi.scale)
        else:
            self.w_bf16.copy_(w)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias.detach().to(dev))

    def _residual_(self, w: torch.Tensor) -> torch.Tensor:
        """W minus the low-rank branch. The branch is W's top singular directions, taken from the first
        weight this layer quantizes and kept: later weights (RL updates) re-quantize only their residual,
        which absorbs the update, so the split stays exact at the cost of one SVD per layer per run."""
        wf = w.float()
        if not self.__dict__.get("lowrank_fixed", False):
            u, sv, vh = torch.linalg.svd(wf, full_matrices=False)
            r = self.recipe.lowrank
            self.lr_up.copy_(u[:, :r] * sv[:r])
            self.lr_down.copy_(vh[:r])
            self.__dict__["lowrank_fixed"] = True
        return wf - self.lr_up.float() @ self.lr_down.float()

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight in FP32, in the layer's own basis (un-rotated, with the low-rank branch
        added back): for inspection; the forward never materialises it like this."""
        fmt = self.recipe.format
        if fmt == "nvfp4":
            w = kernels.nvfp4_dequantize(self._nvfp4(), torch.float32)
            if self.rht_signs is not None:
                w = hadamard.unrotate(w, self.rht_signs)
            if self.lr_up is not None:
                w = w + self.lr_up.float() @ self.lr_down.float()
            return w
        if fmt == "fp8":
            return self._fp8().dequantize(torch.float32)
        if fmt == "int8":
            return self._int8().dequantize(torch.float32)
        return self.w_bf16.float()

    # --- compute -----------------------------------------------------------------------------------

    def choose_kernel(self, device: torch.device | str | None = None) -> tuple[str, str]:
        """(backend, why): the implementation this layer's GEMM runs on `device` (default: where its
        buffers are), chosen once from its shapes and recipe (`kernels.choose`) and kept until the
        device or SOLRL_BACKEND changes. `why` names the choice and each implementation passed over."""
        dev = torch.device(device) if device is not None else self.w_scale.device if hasattr(self, "w_scale") else (
            self.w_bf16.device)  # fmt: skip
        key = (dev, kernels.requested_backend(), kernels.simulated_capability())
        cached = self.__dict__.get("_kernel")
        if cached is not None and cached[0] == key:
            return cached[1]
        r = self.recipe
        if r.format == "bf16":
            choice = ("torch", "torch (BF16 weights: torch's own linear)")
        else:
            op = f"{r.format}_linear"
            choice = kernels.choose(op, dev, k=self.in_features, n=self.out_features,
                                    quantize_input=r.quantize_activations, four_over_six=r.four_over_six,
                                    rht=bool(r.rht))  # fmt: skip
        self.__dict__["_kernel"] = (key, choice)
        return choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self.recipe.format
        act = self.recipe.quantize_activations
        compute, out = io_dtypes(x)
        if fmt == "bf16":
            b = None if self.bias is None else self.bias.to(compute)
            return nn.functional.linear(x.to(compute), self.w_bf16.to(compute), b)
        if not act:  # weight-only: the GEMM reads the activations as autocast would hand them to nn.Linear
            x = x.to(compute)
        backend, tag = self.choose_kernel(x.device)[0], self.kernel_tag
        if fmt == "nvfp4":
            r = self.recipe
            y = kernels.nvfp4_linear(x, self._nvfp4(), self.bias, act, self.rht_signs, r.four_over_six, backend,
                                     out, tag, self.w_scale_swizzled)  # fmt: skip
            if self.lr_up is not None:  # the BF16 low-rank branch on the un-rotated input
                xb = x.to(self.lr_down.dtype)
                y = y + nn.functional.linear(nn.functional.linear(xb, self.lr_down), self.lr_up).to(y.dtype)
            return y
        if fmt == "fp8":
            return kernels.fp8_linear(x, self._fp8(), self.bias, act, backend, out, tag)
        return kernels.int8_linear(x, self._int8(), self.bias, backend, out, tag)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, recipe={self.recipe.name}"
        )


class QuantConv1x1(QuantLinear):
    """A 1x1 nn.Conv2d (stride 1, no padding, no groups) with a quantized weight: a linear over the
    channels of an NCHW input, computed by the same quantized GEMM (SANA's GLUMBConv FFN). Same
    buffers as QuantLinear ([out, in] weight), so requantize_ and state dicts treat both alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:  # unbatched [C, H, W], as nn.Conv2d accepts
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if x.dim() != 4 or x.shape[1] != self.in_features:
            raise ValueError(f"QuantConv1x1 expects [B, {self.in_features}, H, W]; got {tuple(x.shape)}")
        # NCHW -> NHWC (contiguous rows for every GEMM backend); the result goes back as an NCHW view.
        return super().forward(x.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size=(1, 1)"
