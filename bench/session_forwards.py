"""One full-size denoiser's forwards for the GPU session: BF16 and each explore precision, eager and compiled (as
the compiled sampler compiles), torchao's peer on the same layers, where the time goes, and the seconds per
iteration that follow, beside bench/predict.py's speed model for the same device (docs/gpu-session.md).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from session_common import (  # noqa: I001 - bench/ is on sys.path (session_common puts it there)
    ROLLOUT_BATCH,
    TINY,
    TINY_BATCH,
    TINY_RES,
    TINY_VIDEO,
    TORCHAO_CONFIGS,
    _blocks,
    _error,
    _release,
    _sync,
    build_model,
    explore_rule,
    explore_selection,
    format_unavailable,
    forward_fn,
    graphed_ms,
    median_ms,
    predict,
)
from session_summary import _ms
from session_train import train_settings, training_phase
from torch import nn

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.kernels import runs
from solrl_engine.models import ARCH_ALIASES, model_spec
from solrl_engine.nn import fast_path
from solrl_engine.nn.fast_path import reset_fast_path
from solrl_engine.nn.producers import paused
from solrl_engine.sampling.compile import Census, census_backend, compile_regions, uncompile_regions

# a compiled forward starts only while this much of its stage is left: one cold inductor compile of the family's
# repeated blocks (regional; a guess until a GPU session measures it: compile_s in the JSON)
COMPILE_ALLOWANCE = 60.0


# Kernel names -> groups, first match wins (lower-case substrings). GPU kernels: cuBLASLt's FP8 names
# carry the element type (e4m3/e5m2) or, for nvjet's, "qq" (nvjet_sm90_qqtst_...: seen on an H200),
# INT8 IMMA ones i8/s8/imma, FP4 e2m1; our Triton GEMMs are
# _w4a4/_w4a16/_splitk_reduce and the INT8 scale epilogue _epilogue_kernel; our quantize kernels are
# _fp8_rowwise/_int8_rowwise/_amax/_quantize/_rotate; flash/fmha/cudnn/efficient_attention are SDPA;
# nvjet/gemm/xmma/cutlass that are none of the above are BF16 GEMMs; inductor's fused triton_poi/per/red
# and ATen's elementwise/reduce/norm kernels are elementwise. CPU (smoke) rows are ATen ops: aten::_scaled_mm
# and aten::_int_mm low-precision, aten::mm/addmm/bmm BF16, the solrl:: custom ops' own time is quantize.
# Our fused producers (a norm or an activation and the 8-bit codes in one kernel) are their own group: what they
# take over from the quantize group is the measure of issue 40's item 2.
PRODUCER_KERNELS = ("_adaln_quantize", "_gelu_quantize", "_glu_quantize", "_rms_quantize")
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "scaled_dot_product", "efficient_attention", "cudnn_attn", "attention")),
    ("producer", PRODUCER_KERNELS),
    ("quantize", ("_fp8_rowwise", "_int8_rowwise", "_amax", "_quantize", "_rotate", "rot_amax", "solrl::",
                  "quantize", "amax")),
    ("low_precision_gemm", ("_scaled_mm", "_int_mm", "nvjet_sm90_qq", "nvjet_sm100_qq", "e4m3", "e5m2", "e2m1",
                            "i8i32", "imma", "_s8", "s8_", "int8", "fp8", "fp4", "_w4a4", "_w4a16", "_splitk_reduce",
                            "_epilogue_kernel")),
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
    launches: dict[str, int] = {}
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
            launches[e.key] = launches.get(e.key, 0) + int(e.count)
    total = sum(rows.values()) or 1.0
    groups: dict[str, float] = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}
    counts: dict[str, int] = dict.fromkeys(groups, 0)
    for k, us in rows.items():
        groups[kernel_group(k)] += us
        counts[kernel_group(k)] += launches[k]
    ranked = sorted(rows.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": total / 1e3,
        "share": {g: v / total for g, v in groups.items()},
        "ms": {g: v / 1e3 for g, v in groups.items()},
        "launches": counts,
        "top": [{"name": k[:120], "ms": us / 1e3, "group": kernel_group(k)} for k, us in ranked],
    }


def quantize_where_made(profile: dict[str, Any], device: torch.device, quantized: int, fed: int,
                        producers: int) -> dict[str, Any]:  # fmt: skip
    """Issue 40's item 2 read off one eager forward's profile: the fused producers launched once each, and the
    standalone activation quantizes are at most one per quantized layer that no producer feeds (none left where a
    producer exists). GPU kernels only: on a CPU the rows are ATen and custom ops, not launches."""
    if device.type != "cuda":
        return {"skipped": "a CPU profile counts ATen and custom ops, not kernel launches"}
    n = profile.get("launches", {})
    out = {"quantized_layers": quantized, "producer_fed_layers": fed, "producers": producers,
           "producer_launches": n.get("producer", 0), "standalone_quantize_launches": n.get("quantize", 0),
           "standalone_at_most": quantized - fed}  # fmt: skip
    extra = out["standalone_quantize_launches"] - out["standalone_at_most"]
    out["ok"] = extra <= 0 and out["producer_launches"] >= producers
    out["verdict"] = ("no standalone quantize where a producer exists" if out["ok"] else
                      f"{max(extra, 0)} standalone quantize launch(es) beyond the unfed layers, "
                      f"{out['producer_launches']} producer launch(es) for {producers} producer(s)")  # fmt: skip
    return out


def compiled_forward(model: Any, net: nn.Module, inputs: tuple, device: torch.device, reps: int,
                     backend: str, blocks: tuple[str, ...] = (),
                     progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """The forward through `net` as the compiled sampler runs it: its repeated blocks compiled in place
    (regional, `blocks`: the family's ModelSpec.repeated_blocks; inductor's default mode), with the census
    of what each compiled graph computes its GEMMs with; without `blocks`, torch.compile of the whole
    velocity function. The first call's seconds (cold compile) apart from the median forward; on a GPU
    the forward also captured in a CUDA graph and replayed (`graphed_ms`), as rollouts replay the loop.
    The blocks are restored to eager after. `progress` gets the compiled numbers before the capture is tried."""
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
        reasons = dict(torch._dynamo.utils.counters["graph_break"])  # reason -> count; any: parts of it ran eager
        breaks = sum(reasons.values())
        out = {"compile_s": compile_s, "forward_ms": median_ms(fwd, device, reps=reps), "backend": backend,
               "regional_blocks": regions, "graph_breaks": breaks,
               "graph_break_reasons": {k[:400]: v for k, v in list(reasons.items())[:20]}, "census": census.to_dict(),
               "census_summary": census.summary()}  # fmt: skip
        if device.type == "cuda":  # after the compiled numbers are in hand: a capture failure keeps them
            if progress is not None:
                progress(out)
            try:
                out["graphed_ms"] = graphed_ms(fwd, device, reps)
            except Exception as e:  # a failed capture must not lose the compile seconds, forward and census
                out["graphed_error"] = f"{type(e).__name__}: {e}"[:500]
            out["profile"] = profile_groups(fwd, device)
        return out
    finally:
        uncompile_regions(net)


def _compile_skip(cfg: dict[str, Any]) -> str | None:
    """Why a compiled forward is not started now (compile off, or too little of the stage left), else None."""
    if not cfg["compile"]:
        return cfg["compile_why"]
    if time.monotonic() + cfg["compile_allowance"] > cfg["deadline"]:
        return f"under {cfg['compile_allowance']:.0f} s left of the stage for a cold compile"
    return None


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


# precisions "<fmt>+<att>-attention": the FP8 copy with its attention in FP8 (both dots on the FP8 tensor cores: the
# speed model's priced path, so compiled first) or in INT8 (SageAttention's recipe: Q K^T in INT8, P V in FP16), each
# through its explore_attention kernel
ATTENTIONS = ("fp8-attention", "int8-attention")


# a precision "<fmt>+every-layer" (opt-in: --formats fp8,fp8+every-layer): the format on every eligible layer, as
# INT8's rule takes them, not the family's own rule (SANA's keeps its attention in BF16): what a wider rule buys
EVERY_LAYER = "every-layer"


def _base(precision: str) -> str:
    """The linears' format of a forwards precision ("fp8+int8-attention" -> "fp8")."""
    return precision.partition("+")[0]


def _attention(precision: str) -> str:
    """The explore attention's format of a forwards precision ("fp8+int8-attention" -> "int8"; "" for none)."""
    tail = precision.partition("+")[2]
    return tail.removesuffix("-attention") if tail.endswith("-attention") else ""


def _rule(alias: str, precision: str) -> dict[str, Any]:
    """The explore copy's layer rule of a forwards precision: the family's for its format, or every eligible layer."""
    rule = explore_rule(alias, _base(precision))
    return {**rule, **predict.EVERY_LAYER} if precision.partition("+")[2] == EVERY_LAYER else rule


def model_stage(alias: str, device: torch.device, cfg: dict[str, Any], dev_rates: Any) -> dict[str, Any]:
    """One full-size (or tiny, smoke) denoiser: forwards per precision, eager first for all (the most
    value per second), each FP8 / INT8 one beside torchao's on the same layers; then the training phase (each
    copy's refresh, one nft_update); then compiled while the stage's time lasts, ours before torchao's. The
    fast-path record and profile of each eager forward, seconds per iteration from all of these, and
    bench/predict.py's forward beside them."""
    arch, res = (TINY[alias], TINY_RES[alias]) if cfg["smoke"] else (None, cfg["resolution"])
    video = TINY_VIDEO.get(alias, {}) if cfg["smoke"] else {}
    batch = TINY_BATCH if cfg["smoke"] else cfg["batch"].get(alias, ROLLOUT_BATCH[alias])
    t0 = time.perf_counter()
    model = build_model(alias, device, arch, res, **video)
    _sync(device)
    out: dict[str, Any] = {
        "model": alias, "batch": batch, "resolution": model.resolution, "latent_shape": list(model.latent_shape),
        "params_b": sum(p.numel() for p in model.transformer.parameters()) / 1e9,
        "build_s": time.perf_counter() - t0, "precisions": {},
        "train_settings": train_settings(alias, cfg["smoke"], cfg["train_batch"]),
    }  # fmt: skip
    inputs = predict.forward_inputs(model, batch, device=device, dtype=torch.bfloat16)
    formats = ["bf16"] + list(cfg["formats"])
    if model_spec(ARCH_ALIASES.get(alias, alias)).video and "fp8" in formats:
        # attention is 38-71% of a video forward: the explore copy's in INT8 and in FP8 too
        formats += [f"fp8+{att}" for att in ATTENTIONS]
    for fmt in formats:
        why = None if fmt == "bf16" else (format_unavailable(_base(fmt), device)
                                          or (_attention(fmt) and format_unavailable(_attention(fmt), device)))
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
            out["step"] = f"{mode} {fmt}"  # where a stage that fails was (recorded before each entry)
            cfg["progress"](out)
            try:
                if fmt == "bf16":
                    net = model.transformer
                    entry["form"] = "plain BF16 weights (LoRA merged): every family's full-precision rollout form"
                else:
                    rule = _rule(alias, fmt)
                    t1 = time.perf_counter()
                    fam = model_spec(ARCH_ALIASES.get(alias, alias))  # the trainer's copy fuses its producers
                    copy = ExploreCopy(model.transformer, _base(fmt), changes=rule, producers=fam.producers,
                                       producer_blocks=fam.producer_blocks)  # fmt: skip
                    if _attention(fmt):
                        copy.set_attention(_attention(fmt))
                    _sync(device)
                    net = copy.transformer
                    entry.update(rule={k: list(v) if isinstance(v, tuple) else v for k, v in rule.items()},
                                 build_copy_s=time.perf_counter() - t1,
                                 producers=copy.producers.summary() if copy.producers else "")  # fmt: skip
                    reset_fast_path(net)
                if mode == "compiled":
                    entry["compiled"] = compiled_forward(model, net, inputs, device, cfg["reps"],
                                                         cfg["compile_backend"], _blocks(alias),
                                                         lambda c, e=entry: (e.__setitem__("compiled", c),
                                                                             cfg["progress"](out)))  # fmt: skip
                else:
                    fwd = forward_fn(model, net, inputs, device)
                    entry["eager_ms"] = median_ms(fwd, device, reps=cfg["reps"])
                    if copy is not None:
                        rec = fast_path(net)
                        entry["fast_path"] = {"summary": rec.summary(), **rec.to_dict()}
                        entry["quantized_layers"] = sorted(rec.layers)
                    if copy is not None and copy.producers and copy.producers.fused:  # what the fused producers ran
                        entry["producers_ran"] = sorted({runs()[f"{n} (producer)"].impl for n in copy.producers.fused
                                                         if f"{n} (producer)" in runs()})  # fmt: skip
                        entry["producers_codes_alone"] = len(copy.producers.codes_only)  # writing no y
                        with paused(net, copy.producers):  # the same copy, each consumer quantizing for itself
                            entry["eager_ms_producers_paused"] = median_ms(fwd, device, reps=cfg["reps"])
                    if _attention(fmt):  # what the explore copy's attention calls ran (the kernel, or the reference)
                        entry["attention_ran"] = copy.attention_ran()
                    entry["profile_eager"] = profile_groups(fwd, device)
                    if copy is not None and copy.producers and copy.producers.fused:
                        fed = sum(len(v) for v in copy.producers.fused.values())
                        entry["quantize_where_made"] = quantize_where_made(
                            entry["profile_eager"], device, len(entry["quantized_layers"]), fed,
                            len(copy.producers.fused))  # fmt: skip
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
                      ("predicted", lambda: predicted(alias, arch, res, batch, out, dev_rates, video))):  # fmt: skip
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
            # a variant (attention, every layer) is priced with its base's measured refresh (every layer's is larger)
            refresh = precs.get(_base(fmt), e).get("refresh_ms")
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
              dev: Any, video: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """bench/predict.py's roofline forward for this device (from the the ceilings stage) at the same batch,
    per precision, on the layers the measured copy quantized; beside the measured forward. Its update batch
    and refresh estimates sit beside the measured ones, at the same train batch and timestep fraction."""
    if dev is None:
        return {"skipped": "no ceilings measured in this run"}
    meta = predict.build_meta_model(alias, arch, res, **(video or {}))
    ops = predict.profile_forward(meta, batch)
    out: dict[str, Any] = {"device_rates": {k: v / 1e12 for k, v in dev.rates.items()}, "forward_ms": {}}
    for fmt, e in rec["precisions"].items():
        q = set(e.get("quantized_layers", [])) if fmt != "bf16" else set()
        if fmt != "bf16" and not q:
            continue
        try:
            row = {m: predict.forward_seconds(ops, dev, _base(fmt), q, fused=m == "fused",
                                              attention=_attention(fmt) or "bf16") * 1e3
                   for m in ("eager", "fused")}  # fmt: skip
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
            refresh = predict.refresh_seconds(meta.transformer, dev, _base(fmt), q)
        except (KeyError, AttributeError):  # a format predict.py has no quantize efficiency for
            refresh = 0.0
        measured = rec["precisions"].get(_base(fmt), {})  # an attention variant's copy refreshes as its base's
        row["refresh_ms"], row["measured_refresh_ms"] = refresh * 1e3, measured.get("refresh_ms")
        row["measured_requantize_all_ms"] = (measured.get("refresh") or {}).get("requantize_all_ms")
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

