"""explore_precision=auto, one way: the precisions this device's tensor cores run (on a CPU, all of them),
each timed on the model's own quantized layer shapes against the policy, the fastest that beats the policy
taken, else the policy itself explores. A slower proxy is never chosen automatically.

Why timed and not only tabled: on a CPU every format is emulated or run by generic kernels, and even on a GPU
a small model's layers may not gain; the table (kernels' tensor-core capability) only says which formats
are worth timing.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from solrl_engine.kernels import TENSOR_CORES, device_capability, fastest_format, formats_with_tensor_cores, gpu_like
from solrl_engine.nn import QuantConv1x1, QuantLinear, plan_quantization
from solrl_engine.quant.formats import numerics
from solrl_engine.quant.recipe import FORMAT_OPTIONS, get_recipe

# Candidates for the explore copy on a CPU, where every format is emulated (or, for INT8 and FP8,
# run by oneDNN / torch's CPU kernels): all of them are timed against the policy. On a GPU only the
# formats with tensor cores on that device are candidates (`explore_candidates`). Each tensor-core format's
# recipe and its weight-only one (quant's Numerics.recipe_names without the format's extra recipes).
EXPLORE_CANDIDATES: tuple[str, ...] = tuple(
    r for f in TENSOR_CORES for r in numerics(f).recipe_names if r not in numerics(f).recipes
)
# explore_precision=auto's answer where no candidate is faster than the policy: no explore copy at all
POLICY = "policy"


@dataclass(frozen=True)
class ExploreChoice:
    """The explore recipe, why it was chosen, and the timings it was chosen from (ms; "policy": the
    same layers at the policy's own precision), empty where nothing was measured. `precision` is
    POLICY where no quantized copy pays off: the policy itself explores (at the preview steps)."""

    precision: str
    reason: str
    timings_ms: dict[str, float] = field(default_factory=dict)


def explore_candidates(device: torch.device | str) -> tuple[str, ...]:
    """The precisions explore_precision=auto times on `device`: on a GPU (or a CPU under
    SOLRL_SIMULATE_SM) those its tensor cores run (kernels' one tensor-core table: the hardware plan of
    docs/design.md section 2, NVFP4 on sm_100+, FP8 on sm_89+, INT8 on sm_80+, never emulated NVFP4); on
    a CPU all of them."""
    dev = torch.device(device)
    cap = device_capability(dev)
    if not gpu_like(dev) or cap is None:
        return EXPLORE_CANDIDATES
    return formats_with_tensor_cores(cap)


def hardware_plan(device: torch.device | str) -> str:
    """The hardware plan's explore format for a device (docs/design.md section 2): native NVFP4 on Blackwell
    (sm_100+), FP8 on Ada/Hopper (sm_89, sm_90: no FP4 tensor cores), INT8 on Ampere (sm_80, sm_86: INT8
    tensor cores only), emulated NVFP4 elsewhere, a CPU included (a fidelity study's proxy). A CPU under
    SOLRL_SIMULATE_SM counts as that GPU."""
    dev = torch.device(device)
    return fastest_format(device_capability(dev) if gpu_like(dev) else None)


def choose_explore_precision(
    timings_ms: Mapping[str, float], margin: float = 0.95, candidates: Iterable[str] | None = None
) -> ExploreChoice:
    """The fastest candidate at least 1 / margin times faster than "policy" in `timings_ms`, else
    POLICY (explore with the policy itself): a slower proxy is never chosen automatically.
    `candidates` (default: every timed precision) limits the choice, e.g. to a GPU's hardware plan."""
    if "policy" not in timings_ms:
        raise ValueError("timings_ms needs the policy's own time under the key 'policy'")
    base = timings_ms["policy"]
    table = ", ".join(f"{k} {v / base:.2f}x" for k, v in timings_ms.items() if k != "policy")
    allowed = set(EXPLORE_CANDIDATES if candidates is None else candidates)
    timed = sorted((t, k) for k, t in timings_ms.items() if k in allowed and t <= margin * base)
    if timed:
        t, name = timed[0]
        why = f"the fastest precision measured faster than the policy's here ({name} {base / t:.2f}x faster; "
        return ExploreChoice(name, why + f"time vs policy: {table})", dict(timings_ms))
    return ExploreChoice(POLICY, f"no quantized precision is faster than the policy's here (time vs policy: {table}): "
                                 "the policy itself explores; set explore_precision to use one anyway",
                         dict(timings_ms))  # fmt: skip


def explore_layer_shapes(transformer: nn.Module, rule: Mapping[str, Any]) -> Counter[tuple]:
    """(in_features, out_features) -> count of the linears the explore copy would quantize under `rule` (the model's
    layer rule, as QuantRecipe changes), and (in, out, "conv1x1") -> count of its 1x1 convolutions (the policy runs
    those as convolutions: a cuDNN conv plus a bias add on SANA, not a fused linear), planned without touching the
    model."""
    rep = plan_quantization(transformer, get_recipe("nvfp4").with_(**dict(rule)))
    return Counter((d.in_features, d.out_features, *(("conv1x1",) if d.kind == "conv1x1" else ()))
                   for d in rep.layers if d.quantized)  # fmt: skip


def _policy_module(shape: tuple, rows: int, dtype: torch.dtype, dev: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """The policy's own kind of module for a planned shape ((k, n): nn.Linear over `rows` rows; (k, n, "conv1x1"): a
    1x1 nn.Conv2d over an NCHW input of `rows` pixels) and an input for it."""
    k, n, *kind = shape
    if kind == ["conv1x1"]:
        h, w = (rows // 16, 16) if rows % 16 == 0 else (rows, 1)
        return nn.Conv2d(k, n, 1, dtype=dtype, device=dev), torch.randn(1, k, h, w, dtype=dtype, device=dev)
    return nn.Linear(k, n, dtype=dtype, device=dev), torch.randn(rows, k, dtype=dtype, device=dev)


_PROBE_CACHE: dict[tuple, dict[str, float]] = {}


def _call_ms(fn: Callable[[], object], device: torch.device | None = None) -> float:
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _layer_ms(mod: Any, x: torch.Tensor, reps: int, dev: torch.device) -> float:
    """ms of one call of a layer. On a GPU: `reps` calls back to back between two synchronizations, averaged
    (as a forward launches them: the host's per-call overhead counts only where it exceeds the GPU's work),
    fastest of three such windows; elsewhere the fastest of `reps` single calls."""
    if dev.type != "cuda":
        return min(_call_ms(lambda mod=mod, x=x: mod(x), dev) for _ in range(reps))

    def window() -> None:
        for _ in range(reps):
            mod(x)

    return min(_call_ms(window, dev) for _ in range(3)) / reps


def _pass_ms(calls: Iterable[tuple[Any, torch.Tensor, int]], reps: int, dev: torch.device) -> float:
    """ms of one pass over the layers: each layer's time (`_layer_ms`) times its count."""
    return sum(count * _layer_ms(mod, x, reps, dev) for mod, x, count in calls)


def probe_explore_timings(
    shapes: Mapping[tuple[int, int], int],
    rule: Mapping[str, Any],
    dtype: torch.dtype,
    rows: int | None = None,
    reps: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    give_up: float = 2.0,
    device: torch.device | str = "cpu",
    candidates: Iterable[str] | None = None,
) -> dict[str, float]:
    """ms of the explore copy's quantized layers (`shapes`: (in, out) -> count, (in, out, "conv1x1") for 1x1
    convolutions, each timed as the policy's own module and as its quantized twin) at each candidate
    precision (default `explore_candidates(device)`) and at the policy's (`dtype`), on `device`, for
    `rows` input rows (the rollouts' own, Rollouts.forward_rows; default 256 on a CPU, 4096 on a GPU;
    at most 32768 on a GPU and fewer for wide layers on a CPU, to bound the probe's memory and time): per
    layer, its time over `reps` calls (3 on a CPU, 10 on a GPU; `_layer_ms`) after a warm-up call, times its
    count, under `autocast` (the rollouts' own). The second lent GPU (H200) showed why the rows matter: at
    4096 rows, timed one synchronized call at a time, SANA-1.6B's FP8 layers took 1.56x the policy's time,
    while its whole FP8 forward at the rollout's 49152 rows was 1.12x faster. The fastest, not the median,
    and the policy timed again after the candidates (its faster pass kept): other work on the machine only ever adds
    time, and a burst of it while the policy was timed once made a 2.8x slower candidate look faster.

    Each layer's first call is not timed: on the first lent H100 it held the Triton kernels' load and
    the GEMM plans, and a 3x "slower" FP8 copy (one first call) made `auto` explore with the policy.
    A candidate whose warm-up pass (or its first layers) already takes `give_up` times the
    policy's median cannot be chosen and is not timed further: its entry is that partial pass, far
    above the policy's (a lower bound of its full pass). Emulated NVFP4 on a CPU is tens of times slower than the
    policy, so this keeps the whole probe to about a second on the tiny model. Cached per process."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    rows = min(rows, 32768) if rows is not None else (4096 if gpu else 256)
    reps = reps if reps is not None else (10 if gpu else 3)
    names = tuple(explore_candidates(dev) if candidates is None else candidates)
    extras = {k: rule[k] for k in FORMAT_OPTIONS if rule.get(k)}
    key = (tuple(sorted(shapes.items())), tuple(sorted(extras.items())), dtype, rows, reps, give_up,
           torch.get_num_threads(), str(dev), names)  # fmt: skip
    if key in _PROBE_CACHE:
        return dict(_PROBE_CACHE[key])
    out: dict[str, float] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad(), autocast():  # the run's RNG stream is untouched
        torch.manual_seed(0)
        layers = []
        for shape, count in shapes.items():
            k, n = shape[0], shape[1]
            m = rows if gpu else max(16, min(rows, (1 << 27) // max(1, k * n)))  # a CPU's cost stays bounded
            layers.append((*_policy_module(shape, m, dtype, dev), count))
        policy_calls: list[tuple[Any, torch.Tensor, int]] = []
        for name in ("policy", *names):
            recipe = None if name == "policy" else get_recipe(name)
            if recipe is not None:  # the rule's format options, on the format they apply to
                recipe = recipe.with_(**{k: v for k, v in extras.items() if k in numerics(recipe.format).options})
            calls, warm = [], 0.0
            for lin, x, count in layers:  # the warm-up pass, abandoned as soon as it cannot win
                twin = QuantConv1x1 if isinstance(lin, nn.Conv2d) else QuantLinear
                mod = lin if recipe is None else twin.from_linear(lin, recipe)
                mod(x)  # untimed: a first call's one-time costs (kernel JIT or load, GEMM plans) are not its speed
                ms = _call_ms(lambda mod=mod, x=x: mod(x), dev)
                if name != "policy" and warm + count * ms > give_up * out["policy"]:
                    # once more before giving up: a burst of other work on the machine only ever adds time (a
                    # preempted call on a loaded CPU had ruled a 9x-faster candidate out)
                    ms = min(ms, _call_ms(lambda mod=mod, x=x: mod(x), dev))
                warm += count * ms
                calls.append((mod, x, count))
                if name != "policy" and warm > give_up * out["policy"]:
                    break
            if name != "policy" and warm > give_up * out["policy"]:
                out[name] = warm
                continue
            out[name] = _pass_ms(calls, reps, dev)
            policy_calls = policy_calls or calls
        if names:
            out["policy"] = min(out["policy"], _pass_ms(policy_calls, reps, dev))
    _PROBE_CACHE[key] = out
    return dict(out)


def resolve_explore_precision(
    precision: str,
    device: torch.device | str,
    dtype: torch.dtype,
    transformer: nn.Module | None = None,
    rule: Mapping[str, Any] | None = None,
    timings_ms: Mapping[str, float] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    measure: bool = True,
    rows: int | None = None,
) -> ExploreChoice:
    """explore_precision -> the recipe used, with its reason. A set precision passes through; "auto"
    times this model's quantized layers at each candidate precision (`explore_candidates`: on a GPU the
    formats its tensor cores run, on a CPU all) against the policy's own, and takes the fastest that
    beats the policy, else the policy itself (`timings_ms` stubs the measurement), at `rows` token rows per
    layer call (the rollouts' forward; probe_explore_timings' default if None). `measure` False takes
    the hardware plan's format untimed (a fidelity study measures a quantized proxy wherever it is slow)."""
    if precision != "auto":
        return ExploreChoice(precision, "set in the config (explore_precision)")
    if not measure:
        return ExploreChoice(hardware_plan(device), "the hardware plan's format, not timed (explore_precision=auto "
                                                    "in a fidelity study)")  # fmt: skip
    dev = torch.device(device)
    cands = explore_candidates(dev)
    cap = device_capability(dev)
    where = f"sm_{cap[0]}{cap[1]}" + ("" if dev.type == "cuda" else " (simulated)") if cap else "this CPU"
    if not cands:
        return ExploreChoice(POLICY, f"{where} has no tensor cores for NVFP4, FP8 or INT8: the policy explores")
    if timings_ms is None:
        if transformer is None:
            raise ValueError("explore_precision=auto times the model's layers: pass `transformer`")
        shapes = explore_layer_shapes(transformer, rule or {})
        if not shapes:
            return ExploreChoice(POLICY, "the explore rule quantizes no layer of this model: the policy explores")
        timings_ms = probe_explore_timings(shapes, rule or {}, dtype, rows=rows, autocast=autocast, device=dev,
                                           candidates=cands)  # fmt: skip
    ch = choose_explore_precision(timings_ms, candidates=cands)
    return ExploreChoice(ch.precision, f"{where}, candidates {', '.join(cands)}: {ch.reason}", ch.timings_ms)
