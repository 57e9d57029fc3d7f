"""What the GPU session's stages share: the models and their tiny smoke configs, the timer, the formats a device
runs, building a full-size random-weight denoiser on the device, its forward, and its CUDA-graph replay.

Why its own file: bench/gpu_session.py (the calls, stages and clock), session_forwards.py (one model's forwards)
and session_train.py (its refresh and update) all build on these, and none of them on each other's internals.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts import each other
import predict  # noqa: E402

from solrl_engine.explore.plan import ExploreSettings  # noqa: E402
from solrl_engine.explore.plan import explore_rule as plan_rule  # noqa: E402
from solrl_engine.kernels import TENSOR_CORES  # noqa: E402
from solrl_engine.kernels.capability import device_capability  # noqa: E402
from solrl_engine.models import ARCH_ALIASES, model_spec  # noqa: E402
from solrl_engine.nn import plan_quantization  # noqa: E402
from solrl_engine.quant import get_recipe  # noqa: E402

HERE = Path(__file__).resolve().parent


MODELS = ("sana-1.6b", "sd35-large", "flux-dev")  # what trainer:MODEL and forwards:MODEL take
VIDEO_MODELS = ("wan2.1-1.3b", "wan2.1-14b")  # forwards:MODEL only (the published 480 x 832, 81-frame clip)


ROLLOUT_BATCH = dict(predict.ROLLOUT_BATCH)  # SANA 48, FLUX 24, SD3.5-L 8: the rollout batch on one 80 GB GPU


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
    **dict.fromkeys(("wan2.1-1.3b", "wan2.1-14b"),
                    dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32,
                         freq_dim=16, rope_max_seq_len=64)),
}  # fmt: skip


TINY_RES = {"sd35-large": 64, "flux-dev": 64, "sana-1.6b": 128, "wan2.1-1.3b": 32, "wan2.1-14b": 32}
TINY_VIDEO = dict.fromkeys(("wan2.1-1.3b", "wan2.1-14b"), {"frames": 5, "width": 48})  # a video model's smoke clip


TINY_BATCH = 2


# the preflight's small FLUX-class model: GEMM dims the fast kernels take, seconds to build and run
SMALL_FLUX = dict(num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=4,
                  joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 24, 24))  # fmt: skip


FORMATS = tuple(TENSOR_CORES)  # the explore formats with tensor cores, fastest first (kernels' one table)


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
    need = TENSOR_CORES[fmt].needs
    if device.type == "cpu" and cap is None:
        return "the CPU has no FP4 GEMM and no SOLRL_SIMULATE_SM is set" if fmt == "nvfp4" else None
    if cap is None or cap < need:
        return f"needs sm_{need[0]}{need[1]}+ tensor cores; this device is {cap and f'sm_{cap[0]}{cap[1]}'}"
    return None


def build_model(alias: str, device: torch.device, arch: dict[str, Any] | None, resolution: int | None,
                **video: int) -> Any:  # fmt: skip
    """The family's denoiser with random BF16 weights made on `device`: built on meta (bench/predict.py's
    builder, no memory, no CPU init), then materialised there and initialised by kernels on the device.
    Weights ~ N(0, 1/fan_in), 1-D weights 1 and biases 0 (stable activations, so no NaN paths are timed);
    float buffers (SD3's position table) are random: the values do not change the time. `video`: a video
    model's frames and width (None: the published clip)."""
    model = predict.build_meta_model(alias, arch, resolution, **video)
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
    """BF16 autocast, as rollouts run; none on a device without it (meta: the capture rehearsal)."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _blocks(alias: str) -> tuple[str, ...]:
    """The family's repeated block classes: compiled once each (regional), as the compiled sampler does."""
    return model_spec(ARCH_ALIASES.get(alias, alias)).repeated_blocks


def explore_rule(alias: str, fmt: str) -> dict[str, Any]:
    """The family's layer rule widened for the format as the engine's rollouts do (INT8: every eligible layer):
    explore.plan's rule at the default settings."""
    return plan_rule(ExploreSettings(), model_spec(ARCH_ALIASES.get(alias, alias)), fmt)


def explore_selection(net: nn.Module, alias: str, fmt: str) -> list[str]:
    """The linears our explore copy quantizes for `fmt`: the plan quantize_model makes inside ExploreCopy
    (plan_quantization, the same recipe and rule), so a peer quantizes exactly those. 1x1 convolutions are
    left out: torchao's linear configs do not take them."""
    report = plan_quantization(net, get_recipe(fmt).with_(**explore_rule(alias, fmt)))
    return [d.name for d in report.layers if d.quantized and d.kind == "linear"]


def forward_fn(model: Any, net: nn.Module, inputs: tuple, device: torch.device) -> Callable[[], Any]:
    """One denoiser forward (velocity) through `net` under BF16 autocast and no grad, as rollouts run it."""
    x, t, cond = inputs

    def fwd() -> Any:
        with torch.no_grad(), _autocast(device):
            return model.velocity(x, t, cond, transformer=net)

    return fwd


def graphed_ms(fwd: Callable[[], Any], device: torch.device, reps: int) -> float:
    """`fwd` captured once in a CUDA graph (after a warm-up on a side stream), the median replay in ms. Every
    tensor `fwd` reads must already be on the device (tests/test_capture_safety.py rehearses that on the CPU).
    A capture that fails is ended and the device synchronized before the error propagates, so the process is
    not left capturing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fwd()
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
    return median_ms(graph.replay, device, reps=reps)


def _release(device: torch.device) -> None:
    """Free what the last entry held. Never raises: after a sticky CUDA error empty_cache fails too, and
    raising here (a `finally`) would replace the error that names the step; cuda_broken reports it."""
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def cuda_broken(device: torch.device) -> str | None:
    """The sticky CUDA error this process carries (an illegal address poisons every later call), or None."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


def _error(e: BaseException, limit: int = 4) -> dict[str, str]:
    return {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc(limit=limit)[-1500:]}


# one attention call of Wan2.1-1.3B at 480 x 832 and 81 frames: 12 heads of 128 over 32,760 tokens
WAN_ATTENTION = (1, 12, 32760, 128)


# the fused producers at a family's row widths (issue 40's item 2): the op, its row width, and whether a second
# input of x's shape, a prefix, or a norm's modulation comes with it
PRODUCER_CASES = {
    "adaln (FLUX.1's norm, 3072)": 3072, "rms (Z-Image's norm, 3840)": 3840, "gelu (FLUX.1's FFN, 12288)": 12288,
    "glu (SANA's gate, 5600)": 5600,
}


def _producer_pair(kind: str, x: torch.Tensor, k: int, fmt: str, g: torch.Generator
                   ) -> tuple[Callable[[], torch.Tensor], Callable[[bool], Any]]:  # fmt: skip
    """(the stock ops an unfused copy runs for one producer, the fused kernel given whether it writes y) on BF16
    rows x of width k (2k: a gate's two halves)."""
    import torch.nn.functional as F

    from solrl_engine.kernels.dispatch import triton_module
    from solrl_engine.quant import producers as ref

    tr = triton_module("producers")
    onep = 1 + 0.1 * torch.randn(1, k, device=x.device, dtype=torch.bfloat16, generator=g)
    shift = 0.1 * torch.randn(1, k, device=x.device, dtype=torch.bfloat16, generator=g)
    x3 = x.view(1, *x.shape)
    if kind == "adaln":
        return (lambda: F.layer_norm(x, (k,), eps=1e-6) * onep + shift,
                lambda y: tr.adaln_quantize(x3, onep, shift, 1e-6, fmt, True, torch.bfloat16, y))  # fmt: skip
    if kind == "rms":
        return (lambda: ref.rms_scaled(x3, onep[0], 1e-5, onep),
                lambda y: tr.rms_quantize(x3, onep[0], 1e-5, onep, fmt, torch.bfloat16, y))  # fmt: skip
    if kind == "gelu":
        return lambda: F.gelu(x, approximate="tanh"), lambda y: tr.gelu_quantize(x, fmt, None, y)
    a, b = x.chunk(2, dim=-1)
    return lambda: a * F.silu(b), lambda y: tr.glu_quantize(x, fmt, False, None, None, y)


def producer_peers(device: torch.device, rows: int, reps: int) -> dict[str, Any]:
    """Each fused producer kernel (triton_kernels/producers.py) against what an unfused copy runs in its place (the
    stock ops in BF16, then the format's row-wise quantize kernel), on `rows` random BF16 rows of a family's width:
    median ms of each, their ratio, and the fused kernel's bytes moved (x read; y, codes and scales written) per
    second, to set beside the copy's; and the same kernel writing its codes alone (`codes_alone_*`: no y, as where
    every linear a producer feeds takes the codes). FP8 codes where the device has FP8, else INT8."""
    from solrl_engine import kernels

    fmt = "fp8" if format_unavailable("fp8", device) is None else "int8"
    quantize = kernels.fp8_quantize_rowwise if fmt == "fp8" else kernels.int8_quantize_rowwise
    g = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {"format": fmt, "rows": rows}
    for name, k in PRODUCER_CASES.items():
        try:
            kind = name.split()[0]
            width = 2 * k if kind == "glu" else k
            x = torch.randn(rows, width, device=device, dtype=torch.bfloat16, generator=g)
            stock, fused = _producer_pair(kind, x, k, fmt, g)
            fused_ms = median_ms(lambda f=fused: f(True), device, reps=reps)
            alone_ms = median_ms(lambda f=fused: f(False), device, reps=reps)
            unfused_ms = median_ms(lambda st=stock, n=k: quantize(st().reshape(rows, n)), device, reps=reps)
            moved = rows * (width * 2 + k + 4)  # x in BF16, one byte of code each, a scale a row (and y in BF16)
            out[name] = {"fused_ms": fused_ms, "unfused_ms": unfused_ms, "fused_speedup": unfused_ms / fused_ms,
                         "fused_gb_per_s": (moved + rows * k * 2) / (fused_ms / 1e3) / 1e9,
                         "codes_alone_ms": alone_ms, "codes_alone_speedup": unfused_ms / alone_ms,
                         "codes_alone_gb_per_s": moved / (alone_ms / 1e3) / 1e9}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one kernel failing is recorded, never fatal to the stage
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return out


def attention_peers(device: torch.device, shape: tuple[int, int, int, int], reps: int) -> dict[str, Any]:
    """One attention call [B, H, N, d] on random BF16 q, k, v: PyTorch's SDPA (BF16), ours for
    explore_attention=int8 (solrl::int8_attention: INT8 Q K^T, FP16 P V, Triton) and =fp8 (solrl::fp8_attention:
    FP8 Q K^T and P V, Triton; where the GPU has FP8 tensor cores, else its reference) and SageAttention version 1
    (`sageattention.sageattn`, the same recipe's published kernels; carried as a wheel, CUDA only), each with its
    median ms, its speed against SDPA and its relative error against FP32 attention. Random inputs check the
    kernels, not a model's ranking (the fidelity records do that)."""
    import torch.nn.functional as F

    b, h, n, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    rows = min(n, 1024)  # the error on the first query rows (FP32 attention over all 32,760 would cost seconds)
    want = F.scaled_dot_product_attention(q[:, :, :rows].float(), k.float(), v.float())
    out: dict[str, Any] = {"shape": list(shape), "error_rows": rows}

    def entry(fn: Any) -> dict[str, Any]:
        err = ((fn()[:, :, :rows].float() - want).norm() / want.norm()).item()
        return {"median_ms": median_ms(fn, device, reps=reps), "rel_error": err}

    from solrl_engine.kernels import choose, runs

    def ours(fmt: str) -> Any:
        op = getattr(torch.ops.solrl, f"{fmt}_attention")
        return lambda: op(q, k, v, None, f"ceilings attention {fmt}")

    impls: dict[str, Any] = {"sdpa_bf16": lambda: F.scaled_dot_product_attention(q, k, v), "ours_int8": ours("int8")}
    backend, why = choose("fp8_attention", device, d=d)
    if backend == "reference":  # no FP8 tensor cores: the reference over 32k tokens would take minutes and 100 GB
        out["ours_fp8"] = {"skipped": why}
    else:
        impls["ours_fp8"] = ours("fp8")
    try:
        from sageattention import sageattn

        if device.type != "cuda":
            raise RuntimeError("SageAttention runs on CUDA tensors only")
        impls["sageattention_v1"] = lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    except Exception as e:  # noqa: BLE001 - a missing peer is recorded, never fatal
        out["sageattention_v1"] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    for name, fn in impls.items():
        try:
            out[name] = entry(fn)
        except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others
            out[name] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    for fmt in ("int8", "fp8"):
        if f"ours_{fmt}" not in impls:
            continue
        ran = runs().get(f"ceilings attention {fmt}")
        out[f"ours_{fmt}"]["ran"] = ran.impl if ran is not None else "not recorded"
    base = out["sdpa_bf16"].get("median_ms")
    for name in impls:
        if base and out[name].get("median_ms"):
            out[name]["speedup_vs_sdpa"] = base / out[name]["median_ms"]
    return out


def ceilings(device: torch.device, shape: tuple[int, int, int], copy_mib: int, reps: int,
             attention: tuple[int, int, int, int] | None = None, producer_rows: int = 0) -> dict[str, Any]:  # fmt: skip
    """Copy bandwidth and BF16 / FP8 row-wise / INT8 GEMM rates at one DiT-sized GEMM (m x n x k); with `attention`
    ([B, H, N, d]), the attention peers at that shape (`attention_peers`); with `producer_rows`, the fused
    producers against the unfused ops on that many rows (`producer_peers`)."""
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
        # what an INT8 layer runs: torch._int_mm plus the scale epilogue (sm_80-89) against the Triton GEMM with the
        # epilogue fused (sm_90+), both with BF16 out and bias, beside BF16's own linear with bias
        try:
            from solrl_engine.kernels.dispatch import triton_module

            tr = triton_module("int8")
            sx = torch.rand(m, 1, device=device) * 1e-2
            sw = torch.rand(n, 1, device=device) * 1e-2
            bias = torch.randn(n, device=device, dtype=torch.bfloat16)
            ms = median_ms(lambda: tr.scale_epilogue(torch._int_mm(a8, w8.t()), sx, sw, bias, torch.bfloat16), device,
                           reps=reps)  # fmt: skip
            out["int8_int_mm_epilogue"] = {"median_ms": ms, "tops": flops / (ms / 1e3) / 1e12}
            ms = median_ms(lambda: tr.gemm(a8, sx, w8, sw, bias, torch.bfloat16), device, reps=reps)
            out["int8_triton_gemm_epilogue"] = {"median_ms": ms, "tops": flops / (ms / 1e3) / 1e12}
            ms = median_ms(lambda: torch.nn.functional.linear(a, w, bias), device, reps=reps)
            out["bf16_linear_bias"] = {"median_ms": ms, "tflops": flops / (ms / 1e3) / 1e12}
        except Exception as e:  # noqa: BLE001 - a missing Triton or a failed kernel is recorded, never fatal
            out["int8_triton_gemm_epilogue"] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    else:
        out["int8_int_mm"] = {"skipped": why}
    out["nvfp4"] = {"skipped": "no raw FP4 GEMM ceiling here: the NVFP4 explore forward (forwards stages, sm_100+) "
                               "times it"}
    if attention is not None:
        out["attention"] = attention_peers(device, attention, max(3, reps // 4))
    if producer_rows:
        out["producers"] = producer_peers(device, producer_rows, max(3, reps // 2))
    return out
