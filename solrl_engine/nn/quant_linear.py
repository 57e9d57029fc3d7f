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
from typing import Any

import torch
from torch import nn

from solrl_engine import kernels
from solrl_engine.kernels import format_kernels
from solrl_engine.nn.formats import LinearFormat, handler
from solrl_engine.quant.formats import numerics
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


class Prequantized(torch.Tensor):
    """A producer's output y with its row-wise codes in format `fmt`: every op sees y (`value`); a QuantLinear of
    `fmt` that quantizes its input takes `codes` and `scale` ([..., K] and [..., 1]) instead. A traceable wrapper
    subclass, so torch.compile keeps it in one graph. `written` False: the producer wrote the codes alone (every
    reader was to take them: nn.producers' codes_only), and any op that reads y raises, saying what to do, rather
    than compute with memory nobody wrote."""

    value: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str
    written: bool

    @staticmethod
    def __new__(cls, value: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: str,
                written: bool = True) -> Prequantized:  # fmt: skip
        return torch.Tensor._make_wrapper_subclass(cls, value.shape, strides=value.stride(), dtype=value.dtype,
                                                   device=value.device, requires_grad=False)  # fmt: skip

    def __init__(self, value: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: str,
                 written: bool = True) -> None:  # fmt: skip
        self.value, self.codes, self.scale, self.fmt, self.written = value, codes, scale, fmt, written

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Prequantized({self.fmt}, {self.value!r})" if self.written else f"Prequantized({self.fmt}, codes alone)"

    def __tensor_flatten__(self) -> tuple[list[str], tuple[str, bool]]:
        return ["value", "codes", "scale"], (self.fmt, self.written)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple[str, bool], size: Any, stride: Any
                             ) -> Prequantized:  # fmt: skip
        return Prequantized(inner["value"], inner["codes"], inner["scale"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        plain = torch.utils._pytree.tree_map_only(Prequantized, Prequantized.read, (args, kwargs or {}))
        return func(*plain[0], **plain[1])

    def read(self) -> torch.Tensor:
        """y, for an op that reads it; an error where the producer did not write it."""
        if not self.written:
            raise RuntimeError(
                "an op read a fused producer's output, but that producer writes only its 8-bit codes (the family's "
                "ModelSpec.producers says the linears it lists are its only readers). A hook or side branch on a "
                "layer of the explore copy reads its input: call solrl_engine.nn.producers.keep_outputs(copy."
                "transformer, copy.producers, [layer names]) after adding it, or name the new reader in the "
                "family's ModelSpec.producers"
            )  # fmt: skip
        return self.value

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


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
        k = numerics(self.recipe.format).k_multiple
        if in_features % k:
            raise ValueError(
                f"{self.recipe.format} needs in_features to be a multiple of {k}; got {in_features}. "
                "Leave this layer unquantized (quantize_model does so automatically)."
            )
        # the format's parts, looked up once (a forward under torch.compile reads attributes, never the registries):
        # its part in nn/ (`handler`: buffers, quantize-into, decode, linear) and its GEMM op in kernels/
        self.__dict__["handler"] = handler(self.recipe.format)
        self.__dict__["linear_op"] = format_kernels()[self.recipe.format].linear_op
        self.handler.buffers(self, device)
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

    # --- storage ---------------------------------------------------------------------------------------

    @property
    def handler(self) -> LinearFormat:
        """The format's handler this layer delegates its storage and GEMM to (nn/formats/<fmt>.py)."""
        return self.__dict__["handler"]

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
        w = weight.detach().to(next(self.buffers()).device)
        self.handler.set_weight_(self, w)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias.detach().to(self.bias.device))

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight in FP32, in the layer's own basis (un-rotated, with the low-rank branch
        added back): for inspection; the forward never materialises it like this."""
        return self.handler.weight(self)

    # --- compute -----------------------------------------------------------------------------------

    def choose_kernel(self, device: torch.device | str | None = None) -> tuple[str, str]:
        """(backend, why): the implementation this layer's GEMM runs on `device` (default: where its
        buffers are), chosen once from its shapes and recipe (`kernels.choose`) and kept until the
        device or SOLRL_BACKEND changes. `why` names the choice and each implementation passed over."""
        dev = torch.device(device) if device is not None else next(self.buffers()).device
        key = (dev, kernels.requested_backend(), kernels.simulated_capability())
        cached = self.__dict__.get("_kernel")
        if cached is not None and cached[0] == key:
            return cached[1]
        r = self.recipe
        op = self.__dict__["linear_op"]
        if op is None:
            choice = ("torch", f"torch ({r.format.upper()} weights: torch's own linear)")
        else:
            choice = kernels.choose(op, dev, k=self.in_features, n=self.out_features,
                                    quantize_input=r.quantize_activations, four_over_six=r.four_over_six,
                                    rht=bool(r.rht))  # fmt: skip
        self.__dict__["_kernel"] = (key, choice)
        return choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is Prequantized:  # x's producer made its row-wise codes (nn.producers): take them if they are ours
            if x.fmt == self.recipe.format and self.recipe.quantize_activations:
                xq = self.handler.produced(x.codes, x.scale)
                return self.handler.linear(self, x.value, self.choose_kernel(x.device)[0], io_dtypes(x.value)[1], xq)
            x = x.read()
        compute, out = io_dtypes(x)
        if not self.recipe.quantize_activations:  # the GEMM reads the activations as autocast hands them to nn.Linear
            x = x.to(compute)
        return self.handler.linear(self, x, self.choose_kernel(x.device)[0], out)

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
        if x.dim() == 3:  # unbatched [C, H, W], as nn.Conv2d accepts (a producer's codes, if any, batched alike)
            one = Prequantized(*(t.unsqueeze(0) for t in (x.value, x.codes, x.scale)), x.fmt, x.written) \
                if type(x) is Prequantized else x.unsqueeze(0)  # fmt: skip
            return self.forward(one).squeeze(0)
        if x.dim() != 4 or x.shape[1] != self.in_features:
            raise ValueError(f"QuantConv1x1 expects [B, {self.in_features}, H, W]; got {tuple(x.shape)}")
        if type(x) is Prequantized:  # its producer's rows handed over as an NCHW view (nn.producers.relayout)
            rows = Prequantized(*(t.permute(0, 2, 3, 1) for t in (x.value, x.codes, x.scale)), x.fmt, x.written)
            return super().forward(rows).permute(0, 3, 1, 2)
        # NCHW -> NHWC (contiguous rows for every GEMM backend); the result goes back as an NCHW view.
        return super().forward(x.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size=(1, 1)"
