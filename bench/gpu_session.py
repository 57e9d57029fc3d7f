"""The whole GPU picture in two device calls: ceilings, then each full-size denoiser's explore speed.

Why: a GPU machine is lent rarely, for minutes, and bare. This script spends that time on what says
whether Sol-RL pays off: the device's ceilings and, per full-size random-weight denoiser, one
forward at the rollout batch in BF16 and in each explore precision, with where its time goes and
the seconds per iteration that follow, beside bench/predict.py's speed model for the same device.

    python bench/gpu_session.py --stages 0,1,4 --budget 540 --out $OUT    # device call 1
    python bench/gpu_session.py --stages 2,3 --budget 540 --out $OUT      # device call 2
    python bench/gpu_session.py --smoke --out /tmp/s                      # CPU, tiny shapes, ~2 min

Stages: 0 device info, copy/GEMM ceilings, fast-path record of a small quantized model; 1..3 one
model each (--models order, default sana-1.6b, sd35-large, flux-dev); 4 one real trainer iteration
of `compile` and `sol_rl` on SANA-1.6B against the seconds the iteration table predicts from stage
1's forwards (so it follows stage 1 in the same call; skipped when too little is left). DIR/gpu_session.json is
rewritten after every stage, so a cut-off keeps what finished; a stage whose allowance does not
fit the budget left is skipped and the JSON says so. See docs/gpu-session.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from solrl_engine.kernels.dispatch import device_capability
from solrl_engine.models import ARCH_ALIASES, model_spec
from solrl_engine.nn import fast_path, plan_quantization, requantize_
from solrl_engine.nn.fast_path import reset_fast_path
from solrl_engine.quant import get_recipe
from solrl_engine.rl import presets
from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters
from solrl_engine.rl.distributed import Dist
from solrl_engine.rl.explore import ExploreCopy
from solrl_engine.rl.update import nft_update
from solrl_engine.sampling.compile import Census, census_backend, compile_regions, uncompile_regions

HERE = Path(__file__).resolve().parent


def _sibling(name: str) -> Any:
    """Another bench script as a module (bench/ is no package); registered, as its dataclasses need."""
    key = f"bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[key] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


predict = _sibling("predict")

MODELS = ("sana-1.6b", "sd35-large", "flux-dev")
ROLLOUT_BATCH = dict(predict.ROLLOUT_BATCH)  # SANA 48, FLUX 24, SD3.5-L 8: the rollout batch on one 80 GB GPU
# seconds a stage is allowed (measured runs should sit below; a stage is skipped unless this fits)
ALLOWANCE = {"gpu": {0: 75.0, "model": 270.0, "trainer": 240.0}, "smoke": {0: 8.0, "model": 12.0, "trainer": 8.0}}
# compile adds a cold inductor compile per precision: about this much per model on a GPU (an estimate)
COMPILE_ALLOWANCE = 150.0
# the training phase (LoRA attached, each copy's refresh, one nft_update warm-up + 2 timed): seconds it needs
# left of the stage to start (an estimate: a few update batches of SD3.5-L / FLUX take a few seconds each)
TRAIN_ALLOWANCE = {"gpu": 45.0, "smoke": 1.0}
# torchao's inference configs our FP8 / INT8 explore copies are timed against (the peer a user would reach for)
TORCHAO_CONFIGS = {"fp8": "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())",
                   "int8": "Int8DynamicActivationInt8WeightConfig()"}  # fmt: skip
# tiny configs of the same diffusers classes for --smoke (tests/test_predict.py reuses them)
TINY = {
    "sd35-large": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                       caption_projection_dim=32, pooled_projection_dim=32, sample_size=8, pos_embed_max_size=16),
    "flux-dev": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "sana-1.6b": dict(num_attention_heads=2, attention_head_dim=16, num_layers=2, num_cross_attention_heads=2,
                      cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32, sample_size=4),
}  # fmt: skip
TINY_RES = {"sd35-large": 64, "flux-dev": 64, "sana-1.6b": 128}
TINY_BATCH = 2
# stage 0's fast-path check on a GPU: a small FLUX-class model with GEMM dims the fast kernels take
SMALL_FLUX = dict(num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=4,
                  joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 24, 24))  # fmt: skip
# the explore formats and the compute capability whose tensor cores run them (docs/explore-speed.md)
FORMAT_SM = {"fp8": (8, 9), "int8": (8, 0), "nvfp4": (10, 0)}
PREDICT_DEVICE_PRECISION = ("fp8", "int8", "nvfp4")


# --- timing ----------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2, reps: int = 5) -> float:
    """Median milliseconds of `fn` after warm-up: CUDA events on a GPU (no host sync per call inside
    the timed span), perf_counter on a CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def format_unavailable(fmt: str, device: torch.device) -> str | None:
    """None when `device` has tensor cores for `fmt` (or the CPU runs it, reference or simulated), else why not."""
    cap = device_capability(device)
    need = FORMAT_SM[fmt]
    if device.type == "cpu" and cap is None:
        return "the CPU has no FP4 GEMM and no SOLRL_SIMULATE_SM is set" if fmt == "nvfp4" else None
    if cap is None or cap < need:
        return f"needs sm_{need[0]}{need[1]}+ tensor cores; this device is {cap and f'sm_{cap[0]}{cap[1]}'}"
    return None


# --- stage 0: the device's ceilings ---------------------------------------------------------------


def ceilings(device: torch.device, shape: tuple[int, int, int], copy_mib: int, reps: int) -> dict[str, Any]:
    """Copy bandwidth and BF16 / FP8 row-wise / INT8 GEMM rates at one DiT-sized GEMM (m x n x k)."""
    m, n, k = shape
    out: dict[str, Any] = {"gemm_shape": [m, n, k]}
    src = torch.randn(copy_mib * 2**20 // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps=reps)
    out["copy"] = {"median_ms": ms, "mib": copy_mib, "gb_per_s": 2 * src.numel() * 2 / (ms / 1e3) / 1e9}
    src = dst = torch.empty(0)  # free the buffers before the GEMMs
    flops = 2 * m * n * k
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ w.t(), device, reps=reps)
    out["bf16_mm"] = {"median_ms": ms, "tflops": flops / (ms / 1e3) / 1e12}
    why = format_unavailable("fp8", device)
    if why is None:
        try:
            a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            sa = torch.ones(m, 1, device=device, dtype=torch.float32)
            sw = torch.ones(1, n, device=device, dtype=torch.float32)
            ms = median_ms(lambda: torch._scaled_mm(a8, w8.t(), sa, sw, out_dtype=torch.bfloat16), device, reps=reps)
            out["fp8_scaled_mm_rowwise"] = {"median_ms": ms, "tflops": flops / (ms / 1e3) / 1e12}
        except (RuntimeError, NotImplementedError) as e:
            out["fp8_scaled_mm_rowwise"] = {"skipped": f"torch._scaled_mm failed here: {str(e).splitlines()[0]}"}
    else:
        out["fp8_scaled_mm_rowwise"] = {"skipped": why}
    why = format_unavailable("int8", device)
    if why is None:
        try:
            a8 = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
            w8 = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
            ms = median_ms(lambda: torch._int_mm(a8, w8.t()), device, reps=reps)
            out["int8_int_mm"] = {"median_ms": ms, "tops": flops / (ms / 1e3) / 1e12}
        except (RuntimeError, NotImplementedError) as e:
            out["int8_int_mm"] = {"skipped": f"torch._int_mm failed here: {str(e).splitlines()[0]}"}
    else:
        out["int8_int_mm"] = {"skipped": why}
    out["nvfp4"] = {"skipped": "no raw FP4 GEMM ceiling here: the NVFP4 explore forward (stages 1-3, sm_100+) times it"}
    return out


def small_fast_path(device: torch.device, small: bool, formats: tuple[str, ...] = ("fp8", "int8", "nvfp4")
                    ) -> dict[str, Any]:  # fmt: skip
    """Which implementation each quantized layer of a small FLUX-class denoiser ran, per format, under
    BF16 autocast (the rollouts' setting): the cheapest check that the fast kernels are reached here.
    `small`: SMALL_FLUX at 256 px and batch 4 (GEMM rows and dims the GPU kernels take); else TINY."""
    arch, res, batch = (SMALL_FLUX, 256, 4) if small else (TINY["flux-dev"], TINY_RES["flux-dev"], 2)
    model = build_model("flux-dev", device, arch, res)
    x, t, cond = predict.forward_inputs(model, batch, device=device, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    for fmt in formats:
        copy = None
        try:
            copy = ExploreCopy(model.transformer, fmt)  # every eligible layer: the check is of the kernels
            reset_fast_path(copy.transformer)
            with torch.no_grad(), _autocast(device):
                model.velocity(x, t, cond, transformer=copy.transformer)
            rec = fast_path(copy.transformer)
            out[fmt] = {"summary": rec.summary(), **rec.to_dict(), "model": {"arch": arch, "resolution": res,
                                                                              "batch": batch}}  # fmt: skip
        except Exception as e:  # a format this device cannot run at all: say so, keep the others
            out[fmt] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        del copy
    return out


# --- the full-size denoisers ---------------------------------------------------------------------


def build_model(alias: str, device: torch.device, arch: dict[str, Any] | None, resolution: int | None) -> Any:
    """The family's denoiser with random BF16 weights made on `device`: built on meta (bench/predict.py's
    builder, no memory, no CPU init), then materialised there and initialised by kernels on the device.
    Weights ~ N(0, 1/fan_in), 1-D weights 1 and biases 0 (stable activations, so no NaN paths are timed);
    float buffers (SD3's position table) are random: the values do not change the time."""
    model = predict.build_meta_model(alias, arch, resolution)
    net = model.transformer
    net.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        for b in net.buffers():
            if b.is_floating_point():
                b.normal_(0.0, 0.5, generator=gen)
            else:
                b.zero_()
    model.device_ = torch.device(device)
    return model.eval().requires_grad_(False)


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _blocks(alias: str) -> tuple[str, ...]:
    """The family's repeated block classes: compiled once each (regional), as the compiled sampler does."""
    return model_spec(ARCH_ALIASES.get(alias, alias)).repeated_blocks


def explore_rule(alias: str, fmt: str) -> dict[str, Any]:
    """The family's layer rule widened for the format as the engine's rollouts do (INT8: every eligible layer)."""
    spec = model_spec(ARCH_ALIASES.get(alias, alias))
    rule = dict(spec.explore_rule)
    rule.update(spec.explore_rule_by_format.get(get_recipe(fmt).format, {}))
    return rule


def explore_selection(net: nn.Module, alias: str, fmt: str) -> list[str]:
    """The linears our explore copy quantizes for `fmt`: the plan quantize_model makes inside ExploreCopy
    (plan_quantization, the same recipe and rule), so a peer quantizes exactly those. 1x1 convolutions are
    left out: torchao's linear configs do not take them."""
    report = plan_quantization(net, get_recipe(fmt).with_(**explore_rule(alias, fmt)))
    return [d.name for d in report.layers if d.quantized and d.kind == "linear"]


# Kernel names -> groups, first match wins (lower-case substrings). GPU kernels: cuBLASLt's FP8 names
# carry the element type (e4m3/e5m2), INT8 IMMA ones i8/s8/imma, FP4 e2m1; our Triton GEMMs are
# _w4a4/_w4a16/_splitk_reduce and the INT8 scale epilogue _epilogue_kernel; our quantize kernels are
# _fp8_rowwise/_int8_rowwise/_amax/_quantize/_rotate; flash/fmha/cudnn/efficient_attention are SDPA;
# nvjet/gemm/xmma/cutlass that are none of the above are BF16 GEMMs; inductor's fused triton_poi/per/red
# and ATen's elementwise/reduce/norm kernels are elementwise. CPU (smoke) rows are ATen ops: aten::_scaled_mm
# and aten::_int_mm low-precision, aten::mm/addmm/bmm BF16, the solrl:: custom ops' own time is quantize.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "scaled_dot_product", "efficient_attention", "cudnn_attn", "attention")),
    ("quantize", ("_fp8_rowwise", "_int8_rowwise", "_amax", "_quantize", "_rotate", "rot_amax", "solrl::",
                  "quantize", "amax")),
    ("low_precision_gemm", ("_scaled_mm", "_int_mm", "e4m3", "e5m2", "e2m1", "i8i32", "imma", "_s8", "s8_", "int8",
                            "fp8", "fp4", "_w4a4", "_w4a16", "_splitk_reduce", "_epilogue_kernel")),
    ("bf16_gemm", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                   "matmul", "cublas", "conv")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "softmax", "gelu", "silu", "triton_", "copy",
                     "aten::add", "aten::mul", "aten::cat", "aten::to", "aten::_to_copy", "aten::div", "aten::sub",
                     "aten::rsqrt", "aten::pow", "aten::mean", "aten::neg", "aten::exp", "aten::sin", "aten::cos",
                     "aten::clamp", "aten::where", "aten::fill_", "aten::zero_", "aten::abs", "aten::max", "aten::amax",
                     "aten::contiguous", "aten::clone", "aten::tanh", "aten::sigmoid", "aten::chunk")),
)  # fmt: skip


def kernel_group(name: str) -> str:
    """The group of one kernel (GPU) or ATen op (CPU) name; "other" when no substring matches."""
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def profile_groups(fn: Callable[[], Any], device: torch.device, top: int = 8) -> dict[str, Any]:
    """One call of `fn` under torch.profiler: self time per group and its share, and the top kernels.
    GPU: device kernels' self time; CPU: ATen ops' self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    rows: dict[str, float] = {}
    for e in prof.key_averages():
        if device.type == "cuda":
            us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
            if getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
                continue
        else:
            us = float(e.self_cpu_time_total)
            if not e.key.startswith(("aten::", "solrl::")):
                continue  # python/module frames: their self time is interpreter overhead, not kernels
        if us > 0:
            rows[e.key] = rows.get(e.key, 0.0) + us
    total = sum(rows.values()) or 1.0
    groups: dict[str, float] = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}
    for k, us in rows.items():
        groups[kernel_group(k)] += us
    ranked = sorted(rows.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": total / 1e3,
        "share": {g: v / total for g, v in groups.items()},
        "ms": {g: v / 1e3 for g, v in groups.items()},
        "top": [{"name": k[:120], "ms": us / 1e3, "group": kernel_group(k)} for k, us in ranked],
    }


def forward_fn(model: Any, net: nn.Module, inputs: tuple, device: torch.device) -> Callable[[], Any]:
    """One denoiser forward (velocity) through `net` under BF16 autocast and no grad, as rollouts run it."""
    x, t, cond = inputs

    def fwd() -> Any:
        with torch.no_grad(), _autocast(device):
            return model.velocity(x, t, cond, transformer=net)

    return fwd


def compiled_forward(model: Any, net: nn.Module, inputs: tuple, device: torch.device, reps: int,
                     backend: str, blocks: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """The forward through `net` as the compiled sampler runs it: its repeated blocks compiled in place
    (regional, `blocks`: the family's ModelSpec.repeated_blocks; inductor's default mode), with the census
    of what each compiled graph computes its GEMMs with; without `blocks`, torch.compile of the whole
    velocity function. The first call's seconds (cold compile) apart from the median forward; on a GPU
    the forward also captured in a CUDA graph and replayed (`graphed_ms`), as rollouts replay the loop.
    The blocks are restored to eager after."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    census = Census()
    inner = census_backend(census, None, "eager" if backend == "eager" else "inductor")

    def velocity(x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        return model.velocity(x, t, cond, transformer=net)

    regions = compile_regions(net, inner, blocks) if blocks else 0
    compiled = velocity if regions else torch.compile(velocity, backend=inner)

    def fwd() -> Any:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            return compiled(*inputs)

    try:
        t0 = time.perf_counter()
        fwd()
        _sync(device)
        compile_s = time.perf_counter() - t0
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())  # > 0: parts of the forward ran eager
        out = {"compile_s": compile_s, "forward_ms": median_ms(fwd, device, reps=reps), "backend": backend,
               "regional_blocks": regions, "graph_breaks": breaks, "census": census.to_dict(),
               "census_summary": census.summary()}  # fmt: skip
        if device.type == "cuda":
            out["graphed_ms"] = graphed_ms(fwd, device, reps)
            out["profile"] = profile_groups(fwd, device)
        return out
    finally:
        uncompile_regions(net)


def graphed_ms(fwd: Callable[[], Any], device: torch.device, reps: int) -> float:
    """`fwd` captured once in a CUDA graph (after a warm-up on a side stream), the median replay in ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd()
    torch.cuda.synchronize()
    return median_ms(graph.replay, device, reps=reps)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _compile_skip(cfg: dict[str, Any]) -> str | None:
    """Why a compiled forward is not started now (compile off, or too little of the stage left), else None."""
    if not cfg["compile"]:
        return cfg["compile_why"]
    if time.monotonic() + cfg["compile_allowance"] > cfg["deadline"]:
        return f"under {cfg['compile_allowance']:.0f} s left of the stage for a cold compile"
    return None


def _error(e: BaseException, limit: int = 4) -> dict[str, str]:
    return {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc(limit=limit)[-1500:]}


# --- the peer: torchao on the same layers ----------------------------------------------------------


def torchao_unavailable(fmt: str, device: torch.device) -> str | None:
    """None when torchao can run its `fmt` config here, else why not. Its float8 config asserts CUDA
    sm_89+ itself, so a CPU (even with SOLRL_SIMULATE_SM) is skipped up front, not recorded as an error."""
    if fmt not in TORCHAO_CONFIGS:
        return f"no torchao peer for {fmt}"
    try:
        import torchao  # noqa: F401
    except Exception as e:  # not installed, or built for another torch
        return f"torchao does not import ({type(e).__name__}: {str(e)[:120]}): pip install -e '.[peers]'"
    if fmt == "fp8":
        if device.type != "cuda":
            return "torchao's float8 dynamic quantization needs a CUDA GPU of sm_89+; this is the CPU"
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return f"torchao's float8 dynamic quantization needs sm_89+; this device is sm_{cap[0]}{cap[1]}"
    return None


def torchao_config(fmt: str) -> Any:
    """torchao's config for `fmt`. set_inductor_config=False: its recommended inductor settings (coordinate-
    descent autotuning, global for the process) would compile the peer, and every later compile of ours,
    differently; both are compiled with the same default settings instead."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
    )

    if fmt == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)


def torchao_copy(net: nn.Module, alias: str, fmt: str) -> tuple[nn.Module, list[str], list[str]]:
    """A deep copy of the BF16 transformer with torchao's `fmt` config on exactly the linears our explore
    copy quantizes (explore_selection as quantize_'s filter_fn); the names selected, and those torchao converted."""
    from torchao.quantization import quantize_
    from torchao.utils import TorchAOBaseTensor

    names = sorted(explore_selection(net, alias, fmt))
    wanted = set(names)
    peer = deepcopy(net)
    quantize_(peer, torchao_config(fmt), filter_fn=lambda _m, fqn: fqn in wanted)
    done = sorted(n for n, m in peer.named_modules() if isinstance(getattr(m, "weight", None), TorchAOBaseTensor))
    return peer, names, done


def torchao_peer(model: Any, alias: str, fmt: str, inputs: tuple, device: torch.device, cfg: dict[str, Any],
                 mode: str, entry: dict[str, Any]) -> None:  # fmt: skip
    """torchao's dynamic-activation quantization of the layers our copy quantized, timed as ours is (same
    inputs, median_ms, compiled_forward): the peer our explore forward should beat. Writes entry["torchao"];
    errors (torchao's own checks included) are recorded, never raised."""
    ao = entry.setdefault("torchao", {})
    if "skipped" in ao or "error" in ao:
        return
    if mode == "eager":
        why = torchao_unavailable(fmt, device) or (None if cfg["torchao"] else "--no-torchao")
        if why:
            ao["skipped"] = why
            return
    elif "eager_ms" not in ao:
        return
    elif why := _compile_skip(cfg):
        ao["compiled"] = {"skipped": why}
        return
    peer = None
    try:
        t1 = time.perf_counter()
        peer, names, done = torchao_copy(model.transformer, alias, fmt)
        _sync(device)
        if mode == "eager":
            import torchao

            ours = set(entry.get("quantized_layers", []))
            # same_layers_as_ours: torchao converted every linear our copy quantizes, and no other layer; our
            # 1x1 convolutions (SANA's) have no torchao counterpart and stay BF16 in the peer
            ao.update(config=TORCHAO_CONFIGS[fmt], version=torchao.__version__, layers=len(done),
                      same_layers_as_ours=done == names and set(names) <= ours,
                      ours_not_in_peer=sorted(ours - set(done)), build_s=time.perf_counter() - t1)  # fmt: skip
            ao["eager_ms"] = median_ms(forward_fn(model, peer, inputs, device), device, reps=cfg["reps"])
        else:
            ao["compiled"] = compiled_forward(model, peer, inputs, device, cfg["reps"], cfg["compile_backend"],
                                              _blocks(alias))  # fmt: skip
    except Exception as e:  # torchao refusing a layer or a device must not lose the rest of the stage
        (ao.setdefault("compiled", {}) if mode == "compiled" else ao).update(_error(e))
    finally:
        peer = None
        if mode == "compiled":
            torch._dynamo.reset()
        _release(device)


# --- training: one nft_update, and the explore copy's refresh ---------------------------------------


def train_settings(alias: str, smoke: bool, batch: dict[str, int]) -> dict[str, Any]:
    """The family's update as its paper preset runs it (solrl_engine/rl/presets.py): train batch, gradient
    checkpointing, timestep fraction, LoRA rank / alpha / targets. `batch` overrides the train batch."""
    fam = ARCH_ALIASES.get(alias, alias)
    p = presets.PAPER[fam]
    return {
        "batch": TINY_BATCH if smoke else batch.get(alias, p["train_batch_size"]),
        "checkpointing": bool(p["gradient_checkpointing"]), "timestep_fraction": p["timestep_fraction"],
        "lora_rank": presets.COMMON["lora_rank"], "lora_alpha": presets.COMMON["lora_alpha"],
        "lora_targets": list(p.get("lora_targets") or model_spec(fam).lora_targets),
    }  # fmt: skip


def attach_lora(net: nn.Module, ts: dict[str, Any]) -> LoraAdapters:
    """The trained and "old" LoRA adapters on the policy, as the trainer attaches them (FP32 adapters on
    BF16 base weights, gradient checkpointing where the family's preset uses it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        adapters = LoraAdapters(net, ts["lora_rank"], ts["lora_alpha"], tuple(ts["lora_targets"]))
    for p in adapters.params(TRAIN) + adapters.params(OLD):
        p.data = p.data.float()
    adapters.ema = [e.float() for e in adapters.ema]
    if ts["checkpointing"]:
        net.enable_gradient_checkpointing()
    return adapters


def refresh_time(model: Any, adapters: LoraAdapters, alias: str, fmt: str, device: torch.device,
                 reps: int) -> dict[str, Any]:  # fmt: skip
    """One refresh of the `fmt` explore copy from the policy, in place, as the trainer's step 5 does it
    (ExploreCopy.refresh: the "old" LoRA merged and the LoRA layers re-quantized); beside it, requantize_ of
    every quantized layer from the policy module (what bench/predict.py's refresh estimate prices)."""
    copy = ExploreCopy(model.transformer, fmt, changes=explore_rule(alias, fmt))
    copy.attach(adapters)  # the trainer's attach: checks, frozen tensors shared, and a first refresh (the warm-up)
    _sync(device)
    ms = median_ms(lambda: copy.refresh(adapters), device, warmup=0, reps=reps)
    all_ms = median_ms(lambda: requantize_(copy.transformer, source=model.transformer), device, warmup=1, reps=reps)
    return {"refresh_ms": ms, "refresh": {
        "what": "ExploreCopy.refresh, the trainer's: the LoRA layers merged and re-quantized in place",
        "layers": len(adapters.layers), "requantize_all_ms": all_ms,
        "requantize_all_layers": len(copy.report.quantized)}}  # fmt: skip


def time_nft_update(model: Any, adapters: LoraAdapters, alias: str, device: torch.device, ts: dict[str, Any],
                    reps: int) -> dict[str, Any]:  # fmt: skip
    """One DiffusionNFT update batch: nft_update on `batch` samples at one timestep (the "old" and reference
    no-grad forwards, the policy's forward and backward, then the LoRA optimizer step and the EMA / "old"
    moves), after one warm-up. A paper iteration runs iteration_table's update_batches of these."""
    b = ts["batch"]
    fam = ARCH_ALIASES.get(alias, alias)
    # one step budget and every timestep of it: n_t = 1, so one call is one update batch
    c = presets.paper_config(fam, "sol_rl", "pickscore", train_batch_size=b, full_steps=1, timestep_fraction=1.0)
    opt = torch.optim.AdamW(adapters.params(TRAIN), lr=c.lr, weight_decay=c.weight_decay)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(b, *model.latent_shape, device=device, dtype=torch.bfloat16)
    _, _, cond = predict.forward_inputs(model, b, device=device, dtype=torch.bfloat16)
    adv = torch.linspace(-1.0, 1.0, b, device=device)
    sigmas = torch.tensor([0.75])
    done = [0]

    def update() -> None:
        nft_update(model, adapters, opt, c, x0=x0, cond=cond, adv=adv, sigmas=sigmas, gen=gen, b_global=b, row0=0,
                   iteration=done[0], dist=Dist(), autocast=lambda: _autocast(device))  # fmt: skip
        done[0] += 1

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(update, device, warmup=1, reps=reps)
    out: dict[str, Any] = {"ms": ms, "batch": b, "checkpointing": ts["checkpointing"], "calls": done[0],
                           "kl": c.kl_beta > 0}  # fmt: skip
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def training_phase(model: Any, alias: str, device: torch.device, out: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Between the eager and the compiled forwards: LoRA on the policy as the trainer attaches it, each
    explore copy's refresh (entry["refresh_ms"]), then one nft_update at the family's train batch
    (out["nft_update"]). The LoRA is removed after, so the compiled forwards time the plain BF16 weights."""
    ts, net = out["train_settings"], model.transformer
    if not cfg["train"]:
        out["nft_update"] = {"skipped": "--no-train"}
        return
    if time.monotonic() + cfg["train_allowance"] > cfg["deadline"]:
        out["nft_update"] = {"skipped": f"under {cfg['train_allowance']:.0f} s left of the stage"}
        return
    adapters = None
    try:
        adapters = attach_lora(net, ts)
        for fmt, entry in out["precisions"].items():
            if fmt == "bf16" or "eager_ms" not in entry:
                continue
            try:
                entry.update(refresh_time(model, adapters, alias, fmt, device, cfg["reps"]))
            except Exception as e:  # one copy failing must not lose the update's time
                entry["refresh"] = _error(e)
            finally:
                _release(device)
            cfg["progress"](out)
        out["nft_update"] = time_nft_update(model, adapters, alias, device, ts, 2)
    except Exception as e:
        out["nft_update"] = _error(e)
    finally:
        adapters = None
        if ts["checkpointing"]:
            net.disable_gradient_checkpointing()
        if getattr(net, "peft_config", None):
            net.unload_lora()
        net.requires_grad_(False)
        _release(device)
    cfg["progress"](out)


def model_stage(alias: str, device: torch.device, cfg: dict[str, Any], dev_rates: Any) -> dict[str, Any]:
    """One full-size (or tiny, smoke) denoiser: forwards per precision, eager first for all (the most
    value per second), each FP8 / INT8 one beside torchao's on the same layers; then the training phase (each
    copy's refresh, one nft_update); then compiled while the stage's time lasts, ours before torchao's. The
    fast-path record and profile of each eager forward, seconds per iteration from all of these, and
    bench/predict.py's forward beside them."""
    arch, res = (TINY[alias], TINY_RES[alias]) if cfg["smoke"] else (None, cfg["resolution"])
    batch = TINY_BATCH if cfg["smoke"] else cfg["batch"].get(alias, ROLLOUT_BATCH[alias])
    t0 = time.perf_counter()
    model = build_model(alias, device, arch, res)
    _sync(device)
    out: dict[str, Any] = {
        "model": alias, "batch": batch, "resolution": model.resolution, "latent_shape": list(model.latent_shape),
        "params_b": sum(p.numel() for p in model.transformer.parameters()) / 1e9,
        "build_s": time.perf_counter() - t0, "precisions": {},
        "train_settings": train_settings(alias, cfg["smoke"], cfg["train_batch"]),
    }  # fmt: skip
    inputs = predict.forward_inputs(model, batch, device=device, dtype=torch.bfloat16)
    formats = ["bf16"] + list(cfg["formats"])
    for fmt in formats:
        why = None if fmt == "bf16" else format_unavailable(fmt, device)
        out["precisions"][fmt] = {"skipped": why} if why else {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":  # the update and refreshes first: they feed the iteration table; compile is extra
            training_phase(model, alias, device, out, cfg)
        for fmt in formats:
            entry = out["precisions"][fmt]
            if "skipped" in entry or "error" in entry:
                continue
            if mode == "compiled" and (why := _compile_skip(cfg)):
                entry["compiled"] = {"skipped": why}
                continue
            net = copy = None
            t_entry = time.perf_counter()
            try:
                if fmt == "bf16":
                    net = model.transformer
                    entry["form"] = "plain BF16 weights (LoRA merged): every family's full-precision rollout form"
                else:
                    rule = explore_rule(alias, fmt)
                    t1 = time.perf_counter()
                    copy = ExploreCopy(model.transformer, fmt, changes=rule)
                    _sync(device)
                    net = copy.transformer
                    entry.update(rule={k: list(v) if isinstance(v, tuple) else v for k, v in rule.items()},
                                 build_copy_s=time.perf_counter() - t1)  # fmt: skip
                    reset_fast_path(net)
                if mode == "compiled":
                    entry["compiled"] = compiled_forward(model, net, inputs, device, cfg["reps"],
                                                         cfg["compile_backend"], _blocks(alias))  # fmt: skip
                else:
                    fwd = forward_fn(model, net, inputs, device)
                    entry["eager_ms"] = median_ms(fwd, device, reps=cfg["reps"])
                    if copy is not None:
                        rec = fast_path(net)
                        entry["fast_path"] = {"summary": rec.summary(), **rec.to_dict()}
                        entry["quantized_layers"] = sorted(rec.layers)
                    entry["profile_eager"] = profile_groups(fwd, device)
                    entry["eager_total_s"] = time.perf_counter() - t_entry
            except Exception as e:  # one precision failing must not lose the others
                (entry.setdefault("compiled", {}) if mode == "compiled" else entry).update(_error(e))
            finally:
                copy = net = None
                if mode == "compiled":
                    torch._dynamo.reset()  # its caches hold the compiled copy's weights
                _release(device)
            if fmt in TORCHAO_CONFIGS and mode == "eager":  # the peer right after ours, once ours is freed
                torchao_peer(model, alias, fmt, inputs, device, cfg, mode, entry)
            cfg["progress"](out)  # a cut-off inside this stage keeps the precisions that finished
        if mode == "compiled":  # the peer's compiles after all of ours: ours are the measurements that matter most
            for fmt in formats:
                entry = out["precisions"][fmt]
                if fmt in TORCHAO_CONFIGS and "skipped" not in entry and "error" not in entry:
                    torchao_peer(model, alias, fmt, inputs, device, cfg, mode, entry)
                    cfg["progress"](out)
    for key, make in (("iteration", lambda: iteration_table(out, batch)),
                      ("predicted", lambda: predicted(alias, arch, res, batch, out, dev_rates))):  # fmt: skip
        try:
            out[key] = make()
        except Exception as e:  # keep the measurements when a derived table fails
            out[key] = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc(limit=4)[-1500:]}
    del model
    _release(device)
    return out


def _settings(rec: dict[str, Any]) -> tuple[int, float]:
    """(train batch, timestep fraction) of a model stage: its family's preset, else bench/predict.py's PAPER."""
    ts, p = rec.get("train_settings") or {}, predict.PAPER
    return ts.get("batch", p["train_batch"]), ts.get("timestep_fraction", p["timestep_fraction"])


def update_batches(train_batch: int, timestep_fraction: float) -> int:
    """Update batches per iteration per GPU at the paper's settings, counted as bench/predict.py's
    iteration_seconds counts them: int(full_steps x timestep_fraction) timesteps x ceil(K P / train_batch)."""
    p = predict.PAPER
    n_t = max(1, int(p["full_steps"] * timestep_fraction))
    return n_t * math.ceil(p["k"] * p["prompts_per_gpu"] / train_batch)


def iteration_table(rec: dict[str, Any], batch: int) -> dict[str, Any]:
    """Seconds per iteration per GPU at the paper's settings from the measured times, by bench/predict.py's
    iteration_seconds: sol_rl = explore ceil(N P / b) x preview_steps x t_explore + regen ceil(K P / b) x
    full_steps x t_bf16 + refresh + training, naive_scaling = ceil(N P / b) x full_steps x t_bf16 + training;
    training = update_batches x t_update (the measured nft_update), the same for both. The rollout ratio is what
    Sol-RL changes; the total ratio is what a run gains. A time not measured counts 0, and `training` says so."""
    p = predict.PAPER
    tb, tf = _settings(rec)
    upd = rec.get("nft_update") or {}
    t_update = upd.get("ms")
    n_upd = update_batches(tb, tf)
    training: dict[str, Any] = {"update_batches": n_upd, "update_ms": t_update,
                                "train_s": n_upd * t_update / 1e3 if t_update else 0.0}  # fmt: skip
    if t_update is None:
        training["left_out"] = f"nft_update not measured ({upd.get('skipped') or upd.get('error') or 'not run'})"
    out: dict[str, Any] = {"settings": {**p, "rollout_batch": batch, "train_batch": tb, "timestep_fraction": tf},
                           "training": training}  # fmt: skip
    precs = rec["precisions"]
    for mode in ("eager", "compiled"):
        t_bf16 = _ms(precs.get("bf16", {}), mode)
        if t_bf16 is None:
            continue
        for fmt, e in precs.items():
            t_q = _ms(e, mode)
            if fmt == "bf16" or t_q is None:
                continue
            refresh = e.get("refresh_ms")
            # predict.py prices an update batch as TRAIN_FORWARDS forwards: the measured update is passed as such
            it = predict.iteration_seconds(t_bf16 / 1e3, t_q / 1e3, (t_update or 0.0) / 1e3 / predict.TRAIN_FORWARDS,
                                           (refresh or 0.0) / 1e3, prompts=p["prompts_per_gpu"], n=p["n"], k=p["k"],
                                           batch=batch, preview_steps=p["preview_steps"], full_steps=p["full_steps"],
                                           timestep_fraction=tf, train_batch=tb)  # fmt: skip
            naive, sol = it["naive_scaling"], it["sol_rl"]
            out[f"{mode}/{fmt}"] = {
                "forward_speedup": t_bf16 / t_q, "naive_scaling_s": naive["rollout"], "sol_rl_s": sol["rollout"],
                "sol_rl_vs_naive_scaling": naive["rollout"] / sol["rollout"], "refresh_s": sol["refresh"],
                "refresh_measured": refresh is not None, "train_s": sol["train"],
                "naive_scaling_total_s": naive["total"], "sol_rl_total_s": sol["total"],
                "sol_rl_vs_naive_scaling_total": naive["total"] / sol["total"],
            }  # fmt: skip
    return out


# --- stage 4: one real trainer iteration against the table --------------------------------------------

TRAINER_STAGE = 4
TRAINER_MODEL = "sana-1.6b"  # the smallest full-size denoiser: its iteration fits a stage
TRAINER_FAMILIES = ("compile", "sol_rl")


def trainer_stage(device: torch.device, cfg: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """One iteration of the real trainer (bench/e2e.py's run_family: solrl_engine.rl.Trainer) of `compile`
    and `sol_rl` on SANA-1.6B (random weights, stand-in text encoder and VAE), 1 prompt, N = 96, K = 24,
    after one warm-up iteration (compile, capture), beside the seconds iteration_seconds predicts for the
    same settings from this session's measured SANA forwards (its model stage): the check that the
    table's formula accounts for what a trainer iteration spends (decode, reward, sampling overheads)."""
    e2e = _sibling("e2e")
    smoke = cfg["smoke"]
    model = "tiny" if smoke else TRAINER_MODEL
    argv = ["--model", model, "--iterations", "1", "--warmup", "1", "--prompts", "1"]
    argv += ["--n", "4", "--k", "2", "--rollout-batch", "4"] if smoke else ["--rollout-batch", str(
        cfg["batch"].get(TRAINER_MODEL, ROLLOUT_BATCH[TRAINER_MODEL]))]  # fmt: skip
    args = e2e.build_parser().parse_args(argv)
    out: dict[str, Any] = {"model": model, "argv": argv, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in TRAINER_FAMILIES:
            c = e2e.family_config(fam, args, tmp)
            if smoke:  # sol_rl samples eagerly here (`compile` compiles by definition: one cold CPU compile)
                c = dataclasses.replace(c, compiled_sampler=False)
            try:
                out["families"][fam] = e2e.run_family(c, warmup=1)
                out["families"][fam]["settings"] = {k: getattr(c, k) for k in (
                    "n", "k", "prompts_per_iter", "preview_steps", "full_steps", "rollout_batch_size",
                    "train_batch_size", "timestep_fraction")}  # fmt: skip
            except Exception as e:  # one family failing keeps the other
                out["families"][fam] = _error(e)
            cfg["progress"](out)
            _release(device)
    fams = out["families"]
    if all("time_rollout_s" in fams.get(f, {}) for f in TRAINER_FAMILIES):
        out["sol_rl_vs_compile"] = {k: fams["compile"][k] / fams["sol_rl"][k] for k in
                                    ("time_rollout_s", "time_total_s")}  # fmt: skip
    out["predicted_from_forwards"] = trainer_prediction(rec, fams, TRAINER_MODEL if not smoke else None)
    return out


def trainer_prediction(rec: dict[str, Any], fams: dict[str, Any], alias: str | None) -> dict[str, Any]:
    """iteration_seconds at each trainer run's own settings from the model stage's compiled forwards
    (CUDA-graph replay where measured: what the compiled sampler runs), the precision sol_rl explored in,
    its refresh, and the measured nft_update scaled to the trainer's train batch (linear in the batch: an
    assumption); each family's measured rollout and total over the prediction."""
    stage = next((s for s in rec["stages"].values() if alias and s.get("model") == alias), None)
    if stage is None:
        return {"skipped": "no model stage of this model in this session's record to predict from"}
    precs = stage.get("precisions", {})
    sol = fams.get("sol_rl", {})
    fmt = str(sol.get("explore_recipe", "")).split("+")[0]

    def fwd_ms(e: dict[str, Any]) -> float | None:
        c = e.get("compiled") or {}
        return c.get("graphed_ms") or c.get("forward_ms") or e.get("eager_ms")

    t_bf16 = fwd_ms(precs.get("bf16", {}))
    t_q = fwd_ms(precs.get(fmt, {})) if fmt in precs else t_bf16  # the policy explored: its own forward
    upd = stage.get("nft_update") or {}
    if t_bf16 is None or t_q is None or "ms" not in upd or "settings" not in sol:
        return {"skipped": f"missing a measured forward ({fmt or 'bf16'}) or the nft_update in the model stage"}
    st = sol["settings"]
    t_update = upd["ms"] * st["train_batch_size"] / upd["batch"]
    it = predict.iteration_seconds(t_bf16 / 1e3, t_q / 1e3, t_update / 1e3 / predict.TRAIN_FORWARDS,
                                   (precs.get(fmt, {}).get("refresh_ms") or 0.0) / 1e3,
                                   prompts=st["prompts_per_iter"], n=st["n"], k=st["k"],
                                   batch=st["rollout_batch_size"], preview_steps=st["preview_steps"],
                                   full_steps=st["full_steps"], timestep_fraction=st["timestep_fraction"],
                                   train_batch=st["train_batch_size"])  # fmt: skip
    out: dict[str, Any] = {"explore_precision": fmt or "policy", "forward_ms": {"bf16": t_bf16, "explore": t_q},
                           "update_ms_scaled": t_update}  # fmt: skip
    for fam, table in (("compile", "naive_scaling"), ("sol_rl", "sol_rl")):
        m = fams.get(fam, {})
        if "time_rollout_s" not in m:
            continue
        p = it[table]
        out[fam] = {"predicted_rollout_s": p["rollout"], "predicted_total_s": p["total"],
                    "measured_over_predicted_rollout": m["time_rollout_s"] / p["rollout"],
                    "measured_over_predicted_total": m["time_total_s"] / p["total"]}  # fmt: skip
    return out


def _ms(entry: dict[str, Any], mode: str) -> float | None:
    if mode == "eager":
        return entry.get("eager_ms")
    c = entry.get("compiled") or {}
    return c.get("forward_ms")


def device_from_ceilings(ceil: dict[str, Any], name: str) -> Any:
    """bench/predict.py's Device for this machine from the measured ceilings (INT8 = FP8 rate when the
    device lacks one of them; the quantize kernels' efficiency taken from the recorded H100, an assumption)."""
    h100, _ = predict.h100_from_kernels(predict.KERNELS_JSON)
    bf16 = ceil["bf16_mm"]["tflops"] * 1e12
    fp8 = ceil.get("fp8_scaled_mm_rowwise", {}).get("tflops")
    int8 = ceil.get("int8_int_mm", {}).get("tops")
    rates = {"bf16": bf16, "fp8": (fp8 or int8 or 0) * 1e12 or bf16, "int8": (int8 or fp8 or 0) * 1e12 or bf16}
    rates["nvfp4"] = 2 * rates["fp8"]  # assumed: twice the FP8 rate (Blackwell's dense ratio)
    bw = ceil["copy"]["gb_per_s"] * 1e9
    src = "measured here (copy, BF16, FP8, INT8); NVFP4 = 2x FP8 and the quantize efficiency assumed"
    return predict.Device(name, rates, bw, dict(h100.quantize_efficiency), "fp8", True, src)


def predicted(alias: str, arch: dict[str, Any] | None, res: int | None, batch: int, rec: dict[str, Any],
              dev: Any) -> dict[str, Any]:  # fmt: skip
    """bench/predict.py's roofline forward for this device (from the stage-0 ceilings) at the same batch,
    per precision, on the layers the measured copy quantized; beside the measured forward. Its update batch
    and refresh estimates sit beside the measured ones, at the same train batch and timestep fraction."""
    if dev is None:
        return {"skipped": "no ceilings measured in this run"}
    meta = predict.build_meta_model(alias, arch, res)
    ops = predict.profile_forward(meta, batch)
    out: dict[str, Any] = {"device_rates": {k: v / 1e12 for k, v in dev.rates.items()}, "forward_ms": {}}
    for fmt, e in rec["precisions"].items():
        q = set(e.get("quantized_layers", [])) if fmt != "bf16" else set()
        if fmt != "bf16" and not q:
            continue
        try:
            row = {m: predict.forward_seconds(ops, dev, fmt, q, fused=m == "fused") * 1e3 for m in ("eager", "fused")}
        except (KeyError, ValueError) as err:
            out["forward_ms"][fmt] = {"error": str(err)}
            continue
        row["measured_eager"] = e.get("eager_ms")
        row["measured_compiled"] = _ms(e, "compiled")
        out["forward_ms"][fmt] = row
    p = predict.PAPER
    tb, tf = _settings(rec)
    t_train = predict.forward_seconds(predict.profile_forward(meta, tb), dev, "bf16", set())
    out["update_ms"] = {"predicted": predict.TRAIN_FORWARDS * t_train * 1e3, "train_batch": tb,
                        "measured": (rec.get("nft_update") or {}).get("ms")}  # fmt: skip
    b = out["forward_ms"].get("bf16", {})
    for fmt, row in out["forward_ms"].items():
        if fmt == "bf16" or "eager" not in row or "eager" not in b:
            continue
        q = set(rec["precisions"][fmt].get("quantized_layers", []))
        try:
            refresh = predict.refresh_seconds(meta.transformer, dev, fmt, q)
        except (KeyError, AttributeError):  # a format predict.py has no quantize efficiency for
            refresh = 0.0
        row["refresh_ms"], row["measured_refresh_ms"] = refresh * 1e3, rec["precisions"][fmt].get("refresh_ms")
        row["measured_requantize_all_ms"] = (rec["precisions"][fmt].get("refresh") or {}).get("requantize_all_ms")
        it = predict.iteration_seconds(b["eager"] / 1e3, row["eager"] / 1e3, t_train, refresh,
                                       prompts=p["prompts_per_gpu"], n=p["n"], k=p["k"], batch=batch,
                                       preview_steps=p["preview_steps"], full_steps=p["full_steps"],
                                       timestep_fraction=tf, train_batch=tb)  # fmt: skip
        naive, sol = it["naive_scaling"], it["sol_rl"]
        out[f"iteration_eager/{fmt}"] = {
            "naive_scaling_rollout_s": naive["rollout"], "sol_rl_rollout_s": sol["rollout"], "train_s": sol["train"],
            "refresh_s": sol["refresh"], "sol_rl_vs_naive_scaling": naive["rollout"] / sol["rollout"],
            "sol_rl_vs_naive_scaling_total": naive["total"] / sol["total"],
        }  # fmt: skip
    return out


# --- the session ------------------------------------------------------------------------------------


def summary_lines(rec: dict[str, Any]) -> list[str]:
    """One screen: the ceilings, then per model and precision the forward (eager / compiled, measured vs
    predicted), the fast-path count, the profile's biggest groups and Sol-RL's rollout ratio."""
    info = rec.get("info", {})
    lines = [f"gpu_session on {info.get('name')} ({info.get('capability', info.get('device'))}), torch "
             f"{info.get('torch')}; {rec['elapsed_s']:.0f} s of {rec['budget_s']:.0f} s budget"]  # fmt: skip
    c = rec.get("ceilings")
    if c:

        def rate(key: str, unit: str) -> str:
            v = c.get(key, {})
            return f"{v[unit]:.3g}" if unit in v else "skip"

        lines.append(f"ceilings {c['gemm_shape']}: copy {c['copy']['gb_per_s']:.0f} GB/s, bf16 "
                     f"{rate('bf16_mm', 'tflops')} TFLOP/s, fp8 {rate('fp8_scaled_mm_rowwise', 'tflops')}, "
                     f"int8 {rate('int8_int_mm', 'tops')} TOP/s")  # fmt: skip
    fp = rec["stages"].get("0", {}).get("fast_path_small")
    for fmt, v in (fp or {}).items():
        lines.append(f"fast path {fmt}: {v.get('summary', v.get('error', '')).splitlines()[0][:100]}")
    lines.append(f"{'':<17}{'--- forward ms ---':>26}{'- vs bf16 -':>14}{'':>8}{'sol_rl / naive':>22}{'':>10}"
                 f"{'vs torchao':>14}{'':>7}{'total':>7}")  # fmt: skip
    lines.append(f"{'model':<11}{'prec':<6}{'eager':>8}{'pred':>8}{'compiled':>10}{'eager':>7}{'comp':>7}{'fast':>8}"
                 f"{'eager':>7}{'comp':>7}{'pred':>7}{'compile s':>10}{'eager':>7}{'comp':>7}{'refr ms':>9}"
                 f"{'eager':>7}  eager profile (largest shares)")  # fmt: skip
    for key in sorted(k for k in rec["stages"] if k != "0"):
        s = rec["stages"][key]
        if key == str(TRAINER_STAGE) and "families" in s:
            lines.extend(trainer_lines(s))
            continue
        if "precisions" not in s:
            lines.append(f"stage {key}: {s.get('error', 'no result')[:100]}")
            continue
        bf = s["precisions"].get("bf16", {})
        it, pr = s.get("iteration", {}), s.get("predicted", {})
        for fmt, e in s["precisions"].items():
            if "eager_ms" not in e:
                e = {"skipped": "not run (cut off)", **e}
            if "skipped" in e or "error" in e:
                lines.append(f"{s['model']:<11}{fmt:<6} {(e.get('skipped') or e.get('error'))[:90]}")
                continue
            pred = pr.get("forward_ms", {}).get(fmt, {}).get("eager")
            comp, comp_bf = _ms(e, "compiled"), _ms(bf, "compiled")
            q = fmt != "bf16"
            x = bf["eager_ms"] / e["eager_ms"] if q and bf.get("eager_ms") else None
            xc = comp_bf / comp if q and comp and comp_bf else None
            fpr = e.get("fast_path")
            fast = f"{fpr['fast']}/{fpr['layers']}" if fpr else "-"
            r_e = it.get(f"eager/{fmt}", {}).get("sol_rl_vs_naive_scaling")
            r_c = it.get(f"compiled/{fmt}", {}).get("sol_rl_vs_naive_scaling")
            r_p = pr.get(f"iteration_eager/{fmt}", {}).get("sol_rl_vs_naive_scaling")
            r_t = it.get(f"eager/{fmt}", {}).get("sol_rl_vs_naive_scaling_total")
            cs = (e.get("compiled") or {}).get("compile_s")
            ao = e.get("torchao") or {}
            ao_e = ao["eager_ms"] / e["eager_ms"] if "eager_ms" in ao else None  # our speed / torchao's
            ao_c = _ms(ao, "compiled") / comp if _ms(ao, "compiled") and comp else None
            shares = sorted(e["profile_eager"]["share"].items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"{s['model']:<11}{fmt:<6}{e['eager_ms']:>8.1f}{_f(pred):>8}{_f(comp):>10}{_f(x, 2):>7}"
                         f"{_f(xc, 2):>7}{fast:>8}{_f(r_e, 2):>7}{_f(r_c, 2):>7}{_f(r_p, 2):>7}{_f(cs, 0):>10}"
                         f"{_f(ao_e, 2):>7}{_f(ao_c, 2):>7}{_f(e.get('refresh_ms')):>9}{_f(r_t, 2):>7}  "
                         + " ".join(f"{g} {v:.0%}" for g, v in shares))  # fmt: skip
            census = (e.get("compiled") or {}).get("census_summary")
            if q and census:  # traced scaled GEMMs (quantize fused) or opaque ops, per compiled graph
                lines.append(f"{'':<17}compiled: {census[:100]}")
            why = ao.get("skipped") or ao.get("error") or (ao.get("compiled") or {}).get("error")
            if why:
                lines.append(f"{'':<17}torchao: {why.splitlines()[0][:100]}")
        lines.append(train_line(s))
    lines.append("pred: bench/predict.py's eager roofline from this run's ceilings; sol_rl / naive: rollout "
                 "s/iteration at P=6, N=96, K=24, 6/10 steps (sol_rl's with its refresh); vs torchao: our "
                 "forward's speed over torchao's on the same layers; total: sol_rl / naive s/iteration with "
                 "refresh and nft_update training")  # fmt: skip
    for k, why in rec["skipped"].items():
        lines.append(f"stage {k} skipped: {why}")
    return lines


def trainer_lines(s: dict[str, Any]) -> list[str]:
    """Stage 4 in a few lines: each family's measured seconds per iteration, the ratio, and measured over
    predicted (1.0: the iteration table's formula accounts for the whole iteration)."""
    lines = [f"trainer ({s['model']}, {' '.join(s['argv'][2:])}): one iteration after a warm-up"]
    pred = s.get("predicted_from_forwards", {})
    for fam, m in s["families"].items():
        if "error" in m:
            lines.append(f"  {fam:<8} {m['error'][:100]}")
            continue
        p = pred.get(fam, {})
        vs = (f"; measured / predicted: rollout {_f(p.get('measured_over_predicted_rollout'), 2)}, total "
              f"{_f(p.get('measured_over_predicted_total'), 2)}") if p else ""  # fmt: skip
        lines.append(f"  {fam:<8} rollout {m['time_rollout_s']:.1f} s, train {m['time_train_s']:.1f} s, total "
                     f"{m['time_total_s']:.1f} s, compile {m['time_compile_s']:.0f} s "
                     f"({m['explore_recipe']}){vs}")  # fmt: skip
    r = s.get("sol_rl_vs_compile")
    if r:
        lines.append(f"  sol_rl vs compile: rollout {r['time_rollout_s']:.2f}x, iteration {r['time_total_s']:.2f}x")
    if "skipped" in pred:
        lines.append(f"  no prediction: {pred['skipped']}")
    return lines


def train_line(s: dict[str, Any]) -> str:
    """One model's training: the measured nft_update, and the seconds per iteration it adds."""
    upd, tr = s.get("nft_update") or {}, (s.get("iteration") or {}).get("training") or {}
    head = f"{s['model']:<11}train "
    if "ms" not in upd:
        return head + f"nft_update not measured: {(upd.get('skipped') or upd.get('error') or 'not run')[:90]}"
    pred = ((s.get("predicted") or {}).get("update_ms") or {}).get("predicted")
    peak = f", peak {upd['peak_gib']:.1f} GiB" if "peak_gib" in upd else ""
    return (head + f"nft_update {upd['ms']:.1f} ms per update batch of {upd['batch']} (pred {_f(pred)}), "
            f"checkpointing {'on' if upd['checkpointing'] else 'off'}{peak}; x {tr.get('update_batches')} update "
            f"batches = {_f(tr.get('train_s'), 2)} s/iteration")  # fmt: skip


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="0,1,2,3", help="comma list, run in the order given: 0 ceilings, 1..3 the "
                    "--models in order, 4 one trainer iteration of compile and sol_rl on SANA-1.6B")  # fmt: skip
    ap.add_argument("--budget", type=float, default=540.0, help="seconds this call may spend (stages that do not fit "
                    "their allowance in what is left are skipped)")  # fmt: skip
    ap.add_argument("--out", default="bench/results/gpu-session", help="folder for gpu_session.json")
    ap.add_argument("--models", default=",".join(MODELS), help="the models of stages 1, 2, 3")
    ap.add_argument("--resolution", type=int, default=None, help="pixels for every model (default: each family's "
                    "own, as its rollouts and bench/predict.py use: SANA 1024, SD3.5-L 1024, FLUX 512)")  # fmt: skip
    ap.add_argument("--batch", action="append", default=[], help="rollout batch of a model, e.g. flux-dev=16")
    ap.add_argument("--formats", default="fp8,int8,nvfp4", help="explore formats (skipped where the device lacks one)")
    ap.add_argument("--train-batch", action="append", default=[], help="train batch of a model's nft_update, e.g. "
                    "sd35-large=1 (default: its paper preset's)")  # fmt: skip
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--no-train", action="store_true", help="no nft_update and no refresh timing")
    ap.add_argument("--no-torchao", action="store_true", help="no torchao peer")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; smoke: eager)")
    ap.add_argument("--reps", type=int, default=None, help="timed forwards per median, after 2 warm-ups (default 3; "
                    "a full-size forward is 0.3-4 s, steady on a GPU; smoke 2)")  # fmt: skip
    ap.add_argument("--gemm", default="4096x2048x2048", help="stage 0's GEMM shape m x n x k")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny configs of the same classes, every stage, < 1 min")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the chosen stages within the budget, writing the JSON after each; print the summary."""
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_session.json"
    allowance = ALLOWANCE["smoke" if smoke else "gpu"]
    compile_on = not args.no_compile
    cfg: dict[str, Any] = {
        "smoke": smoke, "resolution": args.resolution, "reps": args.reps or (2 if smoke else 3),
        "batch": {k: int(v) for k, _, v in (b.partition("=") for b in args.batch)},
        "train_batch": {k: int(v) for k, _, v in (b.partition("=") for b in args.train_batch)},
        "train": not args.no_train, "train_allowance": TRAIN_ALLOWANCE["smoke" if smoke else "gpu"],
        "torchao": not args.no_torchao,
        "formats": [f.strip() for f in args.formats.split(",") if f.strip()],
        "compile": compile_on, "compile_why": "--no-compile",
        "compile_backend": args.compile_backend or ("eager" if smoke else "inductor"),
        "compile_allowance": 1.0 if smoke else COMPILE_ALLOWANCE,
    }  # fmt: skip
    rec: dict[str, Any] = {
        "bench": "gpu-session", "argv": sys.argv[1:] if argv is None else list(argv), "budget_s": args.budget,
        "info": _sibling("kernels")._device_info(device), "env": {"SOLRL_SIMULATE_SM": os.environ.get(
            "SOLRL_SIMULATE_SM")}, "allowance_s": {str(k): v for k, v in allowance.items()},
        "stages": {}, "skipped": {}, "elapsed_s": 0.0,
    }  # fmt: skip
    if smoke:
        rec["smoke"] = "CPU, tiny configs of the same diffusers classes: checks the script, measures nothing"

    def write() -> None:
        rec["elapsed_s"] = time.monotonic() - start
        path.write_text(json.dumps(rec, indent=2, default=str))

    def save_partial(key: str, part: dict[str, Any]) -> None:
        rec["stages"][key] = {**part, "partial": True}
        write()

    gemm = tuple(int(v) for v in args.gemm.lower().split("x"))
    if smoke:
        gemm = (64, 32, 32)
    copy_mib = 4 if smoke else 512
    dev_rates = None
    for pos, stage in enumerate(stages):
        need = allowance[0] if stage == 0 else allowance["trainer"] if stage == TRAINER_STAGE else allowance["model"]
        left = args.budget - (time.monotonic() - start)
        if need > left:
            rec["skipped"][str(stage)] = f"needs about {need:.0f} s, {left:.0f} s of the budget left"
            print(f"== stage {stage}: skipped ({rec['skipped'][str(stage)]})", flush=True)
            write()
            continue
        t0 = time.monotonic()
        print(f"== stage {stage}", flush=True)
        try:
            if stage == 0:
                c = ceilings(device, gemm, copy_mib, reps=cfg["reps"] * 4)  # type: ignore[arg-type]
                rec["ceilings"] = c
                res: dict[str, Any] = {"ceilings": c, "fast_path_small": small_fast_path(device, not smoke)}
            elif stage == TRAINER_STAGE:
                cfg["progress"] = partial(save_partial, str(stage))
                res = trainer_stage(device, cfg, rec)
            else:
                if stage > len(models):
                    raise ValueError(f"stage {stage} has no model: --models names {len(models)}")
                if "ceilings" not in rec:  # the second device call: quick ceilings for the prediction
                    rec["ceilings"] = ceilings(device, gemm, copy_mib, reps=cfg["reps"] * 2)  # type: ignore[arg-type]
                if dev_rates is None:
                    dev_rates = device_from_ceilings(rec["ceilings"], str(rec["info"].get("name")))
                # compile runs while this stage's share lasts: its allowance, or the budget less the later stages'
                later = sum(allowance[0] if s == 0 else allowance["trainer"] if s == TRAINER_STAGE else
                            allowance["model"] for s in stages[pos + 1 :])  # fmt: skip
                cfg["deadline"] = max(t0 + need, start + args.budget - later)
                cfg["progress"] = partial(save_partial, str(stage))
                res = model_stage(models[stage - 1], device, cfg, dev_rates)
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc(limit=6)[-2000:]}
        res["seconds"] = time.monotonic() - t0
        rec["stages"][str(stage)] = res
        write()
        print(f"== stage {stage}: {res['seconds']:.1f} s{' (error)' if 'error' in res else ''}", flush=True)
    rec["elapsed_s"] = time.monotonic() - start
    lines = summary_lines(rec)
    rec["summary"] = lines
    write()
    print("\n".join(lines))
    print(f"wrote {path}")
    return rec


if __name__ == "__main__":
    main()
