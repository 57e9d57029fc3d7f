"""Which implementation each quantized layer actually ran: the explore forward's speed contract.

Why: a quantized copy is only worth its error if its layers run their fast kernels. A layer that
falls to the reference (an FP32 input where a BF16 one was expected, a shape the GEMM cannot take)
is slower than the BF16 policy, and nothing else would show it. Every QuantLinear call records what
computed it (`solrl_engine.kernels.runs`); this module reads those records back per model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from solrl_engine import kernels
from solrl_engine.kernels import Run
from solrl_engine.nn.quant_linear import QuantLinear
from solrl_engine.quant.formats import numerics


@dataclass
class FastPathRecord:
    """Layer name -> its last recorded GEMM call (None: the layer has not run since it was built)."""

    layers: dict[str, Run | None] = field(default_factory=dict)

    @property
    def fast(self) -> list[str]:
        return [n for n, r in self.layers.items() if r is not None and r.fast]

    @property
    def reference(self) -> list[str]:
        return [n for n, r in self.layers.items() if r is not None and not r.fast]

    @property
    def not_run(self) -> list[str]:
        return [n for n, r in self.layers.items() if r is None]

    def implementations(self) -> dict[str, int]:
        """Implementation -> how many layers ran it, most frequent first."""
        return dict(Counter(r.impl for r in self.layers.values() if r is not None).most_common())

    def summary(self) -> str:
        """One line (two with layers on the reference): e.g. "80/80 quantized layers on the fast path
        (80 on cuda: cuBLASLt FP8 row-wise _scaled_mm), 0 on the reference"."""
        ran = [r for r in self.layers.values() if r is not None]
        if not self.layers:
            return "no quantized layers"
        if not ran:
            return f"0/{len(self.layers)} quantized layers have run yet"
        impls = ", ".join(f"{n} on {impl}" for impl, n in self.implementations().items() if not impl.startswith(
            kernels.dispatch.REFERENCE))  # fmt: skip
        line = (f"{len(self.fast)}/{len(self.layers)} quantized layers on the fast path" + (f" ({impls})" if impls
                else "") + f", {len(self.reference)} on the reference")  # fmt: skip
        if self.not_run:
            line += f", {len(self.not_run)} not run"
        slow = self.reference
        if slow:
            r = self.layers[slow[0]]
            line += (f"\n  on the reference: {', '.join(slow[:4])}{' ...' if len(slow) > 4 else ''} (e.g. {r.dtype} "
                     f"input {list(r.shape)} on {r.device})")  # fmt: skip
        return line

    def to_dict(self) -> dict[str, object]:
        return {
            "fast": len(self.fast),
            "reference": len(self.reference),
            "not_run": len(self.not_run),
            "layers": len(self.layers),
            "implementations": self.implementations(),
            "layers_on_reference": {n: self.layers[n].__dict__ for n in self.reference},  # type: ignore[union-attr]
        }


def fast_path(model: nn.Module) -> FastPathRecord:
    """The fast-path record of every QuantLinear (and QuantConv1x1) of `model`, by qualified name."""
    runs = kernels.runs()
    rec = FastPathRecord()
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and numerics(m.recipe.format).quantized:
            rec.layers[name] = runs.get(m.kernel_tag)
    return rec


def reset_fast_path(model: nn.Module) -> None:
    """Forget the records of `model`'s layers (e.g. before a measured forward)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            kernels.forget_run(m.kernel_tag)
