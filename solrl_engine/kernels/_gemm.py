"""What the quantized GEMMs of every format share: the row view and output shape, the recorded eager call,
and the switch between the opaque custom op and the traced form under torch.compile.

Every implementation writes `out_dtype` (the autocast dtype under autocast, as nn.Linear returns; else the
input's) and reports what it ran (`dispatch.ran`), so QuantLinear's fast-path record is what computed the
call, never a guess from the choice.

Traced forms (under torch.compile): the opaque custom ops hide the activation quantize from inductor: the
producer (a norm, a modulation, a GELU) writes its output, then the op reads it again for the row amax and
the cast. A format's traced form is the same math as the layer's `cuda` implementation written as plain
torch ops (the reference quantize, then the scaled GEMM cuBLASLt runs), so inductor fuses the amax and the
cast into the kernel that produces x and the epilogue into the GEMM's consumer. They run only where the
layer chose `cuda` (its GEMM fits; a CPU counts under SOLRL_SIMULATE_SM) and only while dynamo traces;
eager calls keep the custom ops. What a compiled graph holds is recorded by its census
(solrl_engine.sampling.compile), not per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from solrl_engine.kernels.dispatch import record_run

WEIGHT_ONLY_HINT = ("weight-only GEMMs take BF16/FP16 activations: run the explore copy under BF16 autocast (as the "
                    "rollouts do) or in BF16")  # fmt: skip
PASSED_OVER_HINT = "the layer's GEMM line in QuantReport (quantization.txt) says why the fast kernel was passed over"


PRODUCED = " (input codes from its producer)"  # what a GEMM's record adds when x's producer quantized x


def produced(codes: torch.Tensor | None, scales: torch.Tensor | None, cls: type) -> Any:
    """x's row-wise codes as the format's tensor `cls` ([M, K] codes, [M, 1] scales), None when x's producer made
    none (the GEMM quantizes x itself)."""
    if codes is None or scales is None:
        return None
    return cls(flat(codes), scales.reshape(-1, 1), torch.float32)


def flat(x: torch.Tensor) -> torch.Tensor:
    """The rows of x: [..., K] -> [M, K]."""
    return x.reshape(-1, x.shape[-1])


def finish(acc: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A GEMM's [M, N] result back in x's leading shape, as `out_dtype` (default x's)."""
    return acc.to(out_dtype or x.dtype).reshape(*x.shape[:-1], acc.shape[-1])


def no_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on x's device while it is on: the GEMMs write their own out_dtype, inner matmuls must
    not be recast."""
    dev = x.device.type
    return torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext()


def run_recorded(tag: str, x: torch.Tensor, fn: Callable[[], torch.Tensor], hint: str) -> torch.Tensor:
    """Run one layer's GEMM with autocast off, recording what ran under `tag` when the layer has one."""
    with no_autocast(x):
        return record_run(tag, fn, x, hint) if tag else fn()


TRACE_QUANTIZE = True  # `set_trace_quantize(False)`: compiled models keep the opaque ops (for comparison)


def set_trace_quantize(on: bool) -> None:
    """Whether compiled quantized layers take their traced form (the default) or the opaque custom op.
    Dynamo guards on this flag, so changing it recompiles rather than reusing a stale graph."""
    global TRACE_QUANTIZE
    TRACE_QUANTIZE = bool(on)


def traced(backend: str, forms: tuple[str, ...] = ("cuda",)) -> bool:
    """True while dynamo traces a call whose layer runs an implementation with a traced form (`forms`: `cuda`, and
    for INT8 `triton` too): take the traced form."""
    return backend in forms and TRACE_QUANTIZE and torch.compiler.is_compiling()
