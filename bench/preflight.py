"""The GPU session's first minute: does this machine run what the session is about to measure?

Why: a lent GPU is rare and its call lasts ten minutes. A setup that cannot import the kernels, reaches the
reference instead of the tensor cores, or cannot capture a sampling step would spend those minutes and return
no number. Each check here takes seconds, says what failed, and gpu_session.py stops the call on a failure.

Checks, in order (each: ok, seconds, details, and `error` when it raised):
- kernels: the Triton kernels import (from the install or the checkout), and which implementation the FP8 /
  INT8 quantize ops take here;
- layers: one FP8 and one INT8 QuantLinear (where the device has the tensor cores) against the same layer on the
  reference implementation, under BF16 autocast, and the record of what ran;
- fast_path_small: a small FLUX-class denoiser's explore copy per format: every quantized layer on its fast path;
- census: one compiled quantized layer; on a GPU (or a simulated one) only traced scaled GEMMs, no opaque op;
- capture: one sampling step of the small model captured in a CUDA graph and replayed against the eager step,
  and the session's timed forward captured; on a CPU both are rehearsed on the meta device (CaptureGuard).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any

import torch
from torch import nn

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.kernels import dispatch
from solrl_engine.nn import fast_path, quantize_model, reset_fast_path
from solrl_engine.sampling.capture import rehearse_capture
from solrl_engine.sampling.compile import Census, census_backend
from solrl_engine.sampling.graphed import GraphedSampler
from solrl_engine.sampling.sampler import sample

# the largest relative difference (Frobenius) of a fast quantized layer from its reference: the same quantized
# operands, FP32 accumulation in another order, one BF16 rounding of the output
LAYER_RTOL = 2e-2
# a captured sampling step against the same step run eagerly (the same kernels: equal up to reduction order)
CAPTURE_RTOL = 1e-2


@contextlib.contextmanager
def _backend(name: str | None) -> Iterator[None]:
    """SOLRL_BACKEND set to `name` for what is quantized inside (the choice is made at quantize time)."""
    old = os.environ.get(dispatch.ENV_VAR)
    if name is None:
        os.environ.pop(dispatch.ENV_VAR, None)
    else:
        os.environ[dispatch.ENV_VAR] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(dispatch.ENV_VAR, None)
        else:
            os.environ[dispatch.ENV_VAR] = old


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def check_kernels(device: torch.device) -> dict[str, Any]:
    """Where the Triton kernels come from, and each 8-bit quantize op's implementation here (a Triton choice
    imports its module now, not at the first quantized layer)."""
    out: dict[str, Any] = {"triton": dispatch.unavailable_reason("triton", device) or "available",
                           "solrl_triton_from": dispatch.source_tree_kernels(), "ops": {}}  # fmt: skip
    for op, mod in (("fp8_quantize_rowwise", "fp8"), ("int8_quantize_rowwise", "int8")):
        backend, why = dispatch.choose(op, device)
        if backend == "triton":
            dispatch.triton_module(mod)
        out["ops"][op] = why
    out["ok"] = True
    return out


def check_layers(device: torch.device, formats: list[str]) -> dict[str, Any]:
    """One QuantLinear per 8-bit format, fast against reference on the same random BF16 input under BF16
    autocast (as rollouts run), and what the fast one ran."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    base = nn.Linear(512, 1024).to(torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=gen) / 512**0.5)
        base.bias.copy_(torch.randn(base.bias.shape, generator=gen))
    x = (torch.randn(64, 512, generator=gen) * torch.logspace(-1, 1, 512)).to(device, torch.bfloat16)
    out: dict[str, Any] = {}
    ok = True
    for fmt in formats:
        fast, ref = nn.Sequential(deepcopy(base)).to(device), nn.Sequential(deepcopy(base)).to(device)
        quantize_model(fast, fmt)
        with _backend("reference"):
            quantize_model(ref, fmt)
        reset_fast_path(fast)
        with torch.no_grad(), _autocast(device):
            y, y_ref = fast(x), ref(x)
        rec = fast_path(fast)
        err = _rel(y, y_ref)
        must_be_fast = dispatch.gpu_like(device)
        good = err <= LAYER_RTOL and y.dtype == torch.bfloat16 and (len(rec.fast) == 1 or not must_be_fast)
        out[fmt] = {"rel_error_vs_reference": err, "out_dtype": str(y.dtype), "ran": rec.summary(), "ok": good}
        ok &= good
    out["ok"] = ok
    return out


def check_fast_path_small(model: Any, inputs: tuple, device: torch.device, formats: list[str]) -> dict[str, Any]:
    """The small denoiser's explore copy per format (every eligible layer) under BF16 autocast: on a GPU (or a
    simulated one) every quantized layer must run its fast kernel."""
    x, t, cond = inputs
    out: dict[str, Any] = {}
    ok = True
    for fmt in formats:
        copy = ExploreCopy(model.transformer, fmt)
        reset_fast_path(copy.transformer)
        with torch.no_grad(), _autocast(device):
            model.velocity(x, t, cond, transformer=copy.transformer)
        rec = fast_path(copy.transformer)
        good = bool(rec.layers) and (not rec.reference or not dispatch.gpu_like(device))
        out[fmt] = {"summary": rec.summary(), **rec.to_dict(), "ok": good}
        ok &= good
        del copy
    out["ok"] = ok
    return out


def check_census(device: torch.device, fmt: str, backend: str) -> dict[str, Any]:
    """A modulated norm feeding one quantized layer, compiled (`backend`: inductor on a GPU) with the census:
    on a GPU (or a simulated one) its GEMM is a traced scaled GEMM, the quantize fused, no opaque op."""
    torch._dynamo.reset()
    net = nn.Sequential(nn.LayerNorm(512), nn.Linear(512, 1024)).to(device, torch.bfloat16)
    quantize_model(net, fmt)
    census = Census()
    compiled = torch.compile(net, backend=census_backend(census, None, backend))
    x = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    with torch.no_grad(), _autocast(device):
        y, y_eager = compiled(x), net(x)
    err = _rel(y, y_eager)
    c = census.to_dict()
    must_trace = dispatch.gpu_like(device)
    good = c["graphs"] >= 1 and err <= LAYER_RTOL and (not must_trace or (c["traced"] >= 1 and c["opaque"] == 0))
    torch._dynamo.reset()
    return {"format": fmt, "backend": backend, "census": c, "summary": census.summary(),
            "rel_error_vs_eager": err, "ok": good}  # fmt: skip


def check_capture(model: Any, inputs: tuple, device: torch.device,
                  graphed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:  # fmt: skip
    """One sampling step of the small model through the rollouts' GraphedSampler (captured, replayed) against
    the eager step, and the session's timed forward captured (`graphed`: gpu_session's graphed_ms). Without
    CUDA both are rehearsed on the meta device: every op a capture could not hold is listed."""
    x, t, cond = inputs
    seeds = list(range(len(x)))
    if device.type == "cuda":
        sampler = GraphedSampler(model, compile=False, warmup=1)
        with _autocast(device):
            y = sampler.sample(cond, seeds, steps=1, dtype=torch.bfloat16)
            y_eager = sample(model, cond, seeds, steps=1, dtype=torch.bfloat16)
        err = _rel(y, y_eager)

        def fwd() -> Any:
            with torch.no_grad(), _autocast(device):
                return model.velocity(x, t, cond)

        ms = graphed(fwd)
        good = sampler.stats.captures == 1 and sampler.stats.replays == 1 and err <= CAPTURE_RTOL
        return {"how": "CUDA graph", "captures": sampler.stats.captures, "rel_error_vs_eager": err,
                "forward_graphed_ms": ms, "ok": good}  # fmt: skip
    meta = deepcopy(model)
    meta.transformer = deepcopy(model.transformer).to("meta")
    mx, mt, mc = (v.to("meta") if isinstance(v, torch.Tensor) else v.map(lambda a: a.to("meta"))
                  for v in (x, t, cond))  # fmt: skip
    found = GraphedSampler(meta, compile=False).rehearse(mc, seeds, steps=1, dtype=torch.bfloat16)
    found += rehearse_capture(lambda: meta.velocity(mx, mt, mc), "meta")
    return {"how": "rehearsed on the meta device (CaptureGuard)", "violations": [str(v) for v in found],
            "ok": not found}  # fmt: skip


def run_checks(checks: list[tuple[str, Callable[[], dict[str, Any]]]]) -> dict[str, Any]:
    """Each check in order, timed; one that raises is recorded (error, traceback) and fails the preflight."""
    out: dict[str, Any] = {}
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # a check that raises is a failure with its reason, not a lost call
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500],
                   "traceback": traceback.format_exc(limit=6)[-2000:]}  # fmt: skip
        res["seconds"] = time.perf_counter() - t0
        out[name] = res
    out["failed"] = [n for n, _ in checks if not out[n]["ok"]]
    out["ok"] = not out["failed"]
    return out


def failure_message(pre: dict[str, Any]) -> str:
    """One paragraph naming each failed check and its first line of evidence."""
    parts = []
    for name in pre["failed"]:
        r = pre[name]
        why = r.get("error") or "; ".join(str(v) for v in r.get("violations", [])[:3]) or ", ".join(
            f"{k}: {v.get('summary') or v.get('ran') or v}" for k, v in r.items() if isinstance(v, dict)
            and not v.get("ok", True))  # fmt: skip
        parts.append(f"{name} ({why.splitlines()[0][:300] if why else 'see the JSON'})")
    return "; ".join(parts)
