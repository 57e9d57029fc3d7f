"""Sol-RL's speed on GPUs you do not have: a roofline model of one denoiser forward, run on the meta device.

Rent a GPU only after knowing what it should give: this script builds each full-size family denoiser
(SANA-1.6B, SD3.5-Large, FLUX.1-dev, the published configs with no weights) on the meta device,
runs one forward of the engine's own `velocity` at the rollout batch and the family's resolution,
and records every kernel that forward launches in eager mode: its FLOPs (GEMMs, attention,
convolutions) and the bytes it reads and writes. Each op is attributed to its layer group (the
module path with the block index as *), and the linears the family's explore rule quantizes are
re-priced in the explore precision (weight and activation bytes at its width, plus the pass that
quantizes the activation). Time per group = max(FLOPs / rate, bytes / bandwidth), summed.

    python bench/predict.py                       # three families x H100 (measured), A100, B200 (assumed)
    python bench/predict.py --batch flux-dev=16 --prompts-per-gpu 6

Device rates: the H100's are the ones bench/kernels.py measured (bench/results/*-kernels.json);
A100 and B200 are their published dense peaks scaled by the H100's achieved/peak ratios, marked
as assumptions in the output. Seconds per iteration of naive_scaling, naive_quant and sol_rl at
the paper's settings follow (docs/speed-model.md), with the measured H100 runs beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from solrl_engine.models import ARCH_ALIASES, model_spec
from solrl_engine.models.base import Conditioning
from solrl_engine.nn import plan_quantization
from solrl_engine.nn.flops import group_name
from solrl_engine.nn.producers import plan_producers
from solrl_engine.nn.quantize import is_conv1x1
from solrl_engine.quant import get_recipe
from solrl_engine.quant.formats import rowwise_formats

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS_JSON = RESULTS / "2026-11-24-NVIDIA_H100_80GB_HBM3-kernels.json"
MEASURED_E2E = (RESULTS / "2026-11-24-NVIDIA_H100_80GB_HBM3-e2e-sana-1.6b.json",)
OUT_JSON = RESULTS / "2026-11-25-speed-model.json"

# rollout batch per family: the sizes bench/e2e.py's usage runs them at on one 80 GB GPU
ROLLOUT_BATCH = {"sana-1.6b": 48, "flux-dev": 24, "sd35-large": 8, "wan2.1-1.3b": 4, "wan2.1-14b": 2, "z-image": 8,
                 "flux2-klein-4b": 8, "sana-video-2b": 4, "qwen-image": 4, "qwen-image-edit": 2,
                 "qwen-image-edit-2509": 2}  # fmt: skip
IMAGE_FAMILIES = ("sana-1.6b", "flux-dev", "sd35-large")  # the default run; Wan (480p, 81 frames) on request
# the paper's setting: 48 prompts per iteration over 8 GPUs, N = 96 -> K = 24, 6 preview / 10 full steps; the
# train batch and timestep fraction here are the fallbacks: each family's paper preset gives its timestep fraction
# and UPDATE_80GB its train batch (`family_training`: SD3.5-L 2 / 0.6, FLUX 12 / 0.4, SANA 16 / 0.6)
PAPER = dict(prompts_per_gpu=6, n=96, k=24, preview_steps=6, full_steps=10, timestep_fraction=0.6, train_batch=16)
# the update's (micro-batch, recompute) per paper preset on one 80 GB GPU: estimates the presets fixed before they
# left both at auto (a run now sizes its own from the GPU's memory plan); the speed model and the GPU session's
# forwards stage time the update at these
UPDATE_80GB = {"sd3": (2, False), "flux": (12, True), "sana": (16, False), "qwenimage": (1, True),
               "z-image": (1, False), "flux2-klein": (2, False), "sana-video": (1, True),
               **dict.fromkeys(("wan2.1-1.3b", "wan2.1-14b", "wan2.2-5b"), (1, True))}  # fmt: skip


def family_training(fam: str) -> tuple[int, float]:
    """(train batch, timestep fraction) of a family's paper preset (solrl_engine/rl/presets.py) at UPDATE_80GB's
    micro-batch, else PAPER's."""
    from solrl_engine.rl import presets

    key = fam if fam in presets.PAPER else ARCH_ALIASES.get(fam, fam)
    p = presets.PAPER.get(key, {})
    return UPDATE_80GB.get(key, (PAPER["train_batch"],))[0], p.get("timestep_fraction", PAPER["timestep_fraction"])
# bytes per element of a weight / activation in each precision (NVFP4: 4 bits + one E4M3 scale per 16)
ELEM_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "nvfp4": 0.5 + 1 / 16}
# the explore attention kernels (explore_attention=<fmt>): the share of attention's FLOPs they run at the format's
# rate (Q K^T and P V are equal halves) and the bytes per element of V they read. FP8 runs both products on FP8
# tensor cores from E4M3 V; SageAttention's INT8 runs Q K^T in INT8 and P V in FP16 (BF16's rate) from FP16 V.
ATTENTION_PRODUCTS = {"fp8": (1.0, 1.0), "int8": (0.5, 2.0)}
# forward-equivalents of one training sample-timestep of nft_update: the old and reference adapters'
# no-grad forwards, the policy's forward, and its backward through frozen weights (activation grads
# only, about one forward's GEMMs); an assumption, checked against the measured H100 training time
TRAIN_FORWARDS = 4.0

# published peak dense rates (FLOP/s, bytes/s); sources cited in the JSON
PEAKS: dict[str, dict[str, Any]] = {
    "H100": dict(bf16=989.4e12, fp8=1978.9e12, int8=1978.9e12, bandwidth=3.35e12,
                 source="https://glennklockwood.com/garden/processors/h100 (H100 SXM5, dense)"),
    "A100": dict(bf16=312e12, int8=624e12, bandwidth=2.039e12,
                 source="https://glennklockwood.com/garden/processors/A100 (A100 80GB SXM4, dense)"),
    "B200": dict(bf16=2250e12, fp8=4500e12, nvfp4=9000e12, bandwidth=8.0e12,
                 source="https://glennklockwood.com/garden/processors/B200 (HGX B200 at 1000 W, dense)"),
}  # fmt: skip
EXPLORE_PRECISION = {"H100": "fp8", "A100": "int8", "B200": "nvfp4"}  # docs/design.md section 2


# --- one forward on the meta device ---------------------------------------------------------------


def build_meta_model(alias: str, arch: dict[str, Any] | None = None, resolution: int | None = None,
                     **video: int) -> nn.Module:  # fmt: skip
    """The family's FlowModel around its published transformer built on the meta device (no memory):
    the same forward the engine's rollouts run. `arch` overrides the config (tests build tiny ones); `video`:
    a video model's frames and width (its defaults: the published 81 frames at 480 x 832)."""
    import diffusers

    cls = model_spec(ARCH_ALIASES.get(alias, alias)).adapter_object()
    config = {**cls.FULL_CONFIG, **getattr(cls, "ALIAS_CONFIGS", {}).get(alias, {}), **(arch or {})}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            net = getattr(diffusers, cls.TRANSFORMER_CLASS)(**config)
    finally:
        torch.set_default_dtype(default)
    # the scheduler is built off the meta device: diffusers copies its sigmas to the CPU
    pipe = SimpleNamespace(transformer=net, scheduler=cls.default_scheduler(), vae=None,
                           vae_scale_factor=cls.RANDOM_VAE_FACTOR, random=True)  # fmt: skip
    return cls(pipe, device="meta", dtype=torch.bfloat16, resolution=resolution, **video)


def forward_inputs(model: Any, batch: int, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:  # fmt: skip
    """Latents, flow time and stand-in text conditioning of one rollout batch, all on `device` (a captured
    forward reads them there: a CPU tensor would be a host copy inside the capture). Random, not zeros: a GEMM
    of zeros runs faster than one of data, and a quantize of zero rows takes its degenerate branch. Latents
    and text states ~ N(0, 1), the flow time uniform in [0.2, 0.8] (drawn on the CPU from `seed`, so every
    device gets the same values); shapes only on meta."""
    hidden, pooled = model._standin_dims()
    tokens = model.TEXT_TOKENS
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(*shape, device=device, dtype=dtype)
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    # a conditioned family's image inputs (an edit's source latents, an image-to-video's first frame and its CLIP
    # states): shaped as its own stand-in conditioning has them
    proto = model._standin_encode([""]) if model_spec(model.MODEL).conditioned else Conditioning(torch.empty(0))
    cond = Conditioning(
        randn(batch, tokens, hidden),
        None if pooled is None else randn(batch, pooled),
        torch.ones(batch, tokens, dtype=torch.long, device=device) if pooled is None else None,
        *(None if t is None else randn(batch, *t.shape[1:]) for t in (proto.image, proto.image_states)),
    )
    x = randn(batch, *model.latent_shape)
    t = (0.2 + 0.6 * torch.rand((), generator=gen)).to(device)
    return x, t, cond


@dataclass
class OpCost:
    """One layer group's work of one kind: kind is linear, attention, conv or elementwise."""

    group: str
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0
    # linears only: the elements of their inputs, weights and outputs (to re-price them quantized)
    in_elems: float = 0.0
    weight_elems: float = 0.0
    out_elems: float = 0.0
    layers: set[str] = field(default_factory=set)
    # attention only: the bytes of q, k, v and the output of its self-attention calls (queries and keys of one
    # sequence), what context parallelism's Ulysses all-to-alls move; a cross-attention's text keys are not split
    self_bytes: float = 0.0


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for `t`: its elements, or its storage when it is a broadcast view."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return n


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


class _Recorder(TorchDispatchMode):
    """Every aten op of the forward: FLOPs from torch's flop formulas, bytes of its tensors."""

    def __init__(self, stack: list[tuple[str, nn.Module]], costs: dict[tuple[str, str], OpCost]) -> None:
        super().__init__()
        self.stack, self.costs = stack, costs

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors(list(args) + list(kwargs.values()))
        if func.is_view or not inputs:  # views launch nothing; factories (empty, zeros) are negligible
            return out
        name, mod = self.stack[-1] if self.stack else ("", None)
        packet = func.overloadpacket
        flops = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)  # torch's formulas take the tensors
        nbytes = sum(_nbytes(t) for t in inputs + _tensors(out))
        if flops and mod is not None and (type(mod) is nn.Linear or is_conv1x1(mod)):
            kin, kout = (mod.in_features, mod.out_features) if isinstance(mod, nn.Linear) else (
                mod.in_channels, mod.out_channels)  # fmt: skip
            rows = flops / (2 * kin * kout)
            c = self._cost(name, "linear")
            c.in_elems += rows * kin
            c.out_elems += rows * kout
            c.weight_elems += kin * kout
            c.layers.add(name)
        elif flops:
            c = self._cost(name, "conv" if "conv" in str(packet) else "attention")
        else:
            c = self._cost(name, "elementwise")
        c.flops += flops
        c.bytes += nbytes
        c.ops += 1
        return out

    def _cost(self, name: str, kind: str) -> OpCost:
        g = group_name(name) if name else "(top)"
        return self.costs.setdefault((g, kind), OpCost(g, kind))


class _Attention(TorchFunctionMode):
    """F.scaled_dot_product_attention as one fused kernel (flash attention on a GPU): 2 x 2 x B x heads
    x Tq x Tk x head_dim FLOPs and the bytes of q, k, v and the output; never the T x T matrix."""

    def __init__(self, stack: list[tuple[str, nn.Module]], costs: dict[tuple[str, str], OpCost]) -> None:
        super().__init__()
        self.stack, self.costs = stack, costs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask")
        a = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        q, k, v = a["query"], a["key"], a["value"]
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        heads = q.shape[:-2].numel()  # batch x heads
        name = self.stack[-1][0] if self.stack else ""
        g = group_name(name) if name else "(top)"
        c = self.costs.setdefault((g, "attention"), OpCost(g, "attention"))
        c.flops += 2 * 2 * heads * q.shape[-2] * k.shape[-2] * q.shape[-1]
        c.bytes += sum(_nbytes(t) for t in (q, k, v, out)) + (_nbytes(a["attn_mask"]) if isinstance(
            a.get("attn_mask"), torch.Tensor) else 0)  # fmt: skip
        if q.shape[-2] == k.shape[-2]:
            c.self_bytes += sum(_nbytes(t) for t in (q, k, v, out))
        c.ops += 1
        return out


def profile_forward(model: Any, batch: int) -> list[OpCost]:
    """The work of one denoiser forward at `batch` (run on whatever device the model is on; meta costs
    nothing), per (layer group, kind)."""
    net = model.transformer
    stack: list[tuple[str, nn.Module]] = []
    costs: dict[tuple[str, str], OpCost] = {}
    handles = []

    def pop(_m: nn.Module, _a: object, _o: object) -> None:  # returns None: the output stays as it is
        stack.pop()

    for name, mod in net.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: stack.append((n, m)) and None))
        handles.append(mod.register_forward_hook(pop))
    x, t, cond = forward_inputs(model, batch, device=next(net.parameters()).device, dtype=model.dtype)
    try:
        with torch.no_grad(), _Attention(stack, costs), _Recorder(stack, costs):
            model.velocity(x, t, cond)
    finally:
        for h in handles:
            h.remove()
    return list(costs.values())


# every eligible layer (what the INT8 rule takes): `--every-layer` prices each format so, as a rule search on real
# weights might widen a family's FP8 rule (SANA's and SD3.5's keep their attention in BF16)
EVERY_LAYER = {"include": (), "skip_max_dim": 0}


def explore_layers(model: Any, alias: str, precision: str, every_layer: bool = False) -> set[str]:
    """Names of the linears the family's explore copy quantizes in `precision` (its rule, widened per
    format as the rollouts widen it: INT8 on every eligible layer; `every_layer`: every eligible layer in any
    format; on meta)."""
    spec = model_spec(ARCH_ALIASES.get(alias, alias))
    rule = {**spec.explore_rule, **spec.explore_rule_by_format.get(get_recipe(precision).format, {})}
    rule = {**rule, **EVERY_LAYER} if every_layer else rule
    recipe = get_recipe(precision).with_(**rule)
    return set(plan_quantization(model.transformer, recipe).quantized)


def producer_fed(model: Any, alias: str, precision: str, quantized: set[str]) -> dict[str, tuple[str, bool]]:
    """The quantized linears whose input codes a fused producer makes in the trainer's explore copy (its norm and
    modulation, or its FFN's GELU: nn.producers), each with its producer and whether that producer writes its codes
    alone (no op reads its y: FusedProducers.codes_only): consumer name -> (producer name, codes alone). Empty for a
    format without row-wise codes (NVFP4)."""
    spec = model_spec(ARCH_ALIASES.get(alias, alias))
    fmt = get_recipe(precision).format
    plan = plan_producers(model.transformer, spec.producers, fmt if fmt in rowwise_formats() else "",
                          quantized.__contains__, spec.producer_blocks)  # fmt: skip
    return {f"{p.rpartition('.')[0]}.{c}": (p, p in plan.codes_only) for p, takers in plan.fused.items()
            for c in takers}  # fmt: skip


# --- devices and the roofline ---------------------------------------------------------------------


@dataclass
class Device:
    """Achieved rates of one GPU: FLOP/s per precision, bytes/s, and how it was obtained."""

    name: str
    rates: dict[str, float]
    bandwidth: float
    quantize_efficiency: dict[str, float]  # achieved bandwidth of the activation quantize / copy bandwidth
    explore_precision: str
    measured: bool
    source: str


def _median(values: list[float]) -> float:
    if not values:
        raise ValueError("no measurement to take a median of")
    return float(statistics.median(values))


def h100_from_kernels(path: Path, min_rows: int = 1024) -> tuple[Device, dict[str, Any]]:
    """The H100's rates from a bench/kernels.py record: medians over its DiT-shaped GEMMs (M >= min_rows;
    the M = 1 and 16 rows are launch-bound and say nothing about a rollout batch) and its tensors."""
    rec = json.loads(Path(path).read_text())
    big = [g for g in rec["gemms"] if g["gemm"][0] >= min_rows]
    bf16 = _median([g["bf16_mm"]["tflops"] for g in big]) * 1e12
    fp8 = _median([g["fp8_scaled_mm"]["tflops"] for g in big]) * 1e12
    fp8_linear = _median([g["fp8_linear_w8a8"]["tflops"] for g in big if "fp8_linear_w8a8" in g]) * 1e12
    bw = _median([r["copy"]["gb_per_s"] for r in rec["results"]]) * 1e9
    q_fp8 = _median([r["fp8_quantize_rowwise"]["ratio_to_copy"] for r in rec["results"]])
    q_fp4 = _median([r["nvfp4_quantize_with_amax_pass"]["ratio_to_copy"] for r in rec["results"]])
    peak = PEAKS["H100"]
    eff = {"bf16": bf16 / peak["bf16"], "low": fp8 / peak["fp8"], "bandwidth": bw / peak["bandwidth"]}
    taken = {
        "file": str(Path(path).name),
        "gpu": rec["info"].get("name"),
        "gemm_shapes": [g["gemm"] for g in big],
        "bf16_mm_tflops_median": bf16 / 1e12,
        "fp8_scaled_mm_tflops_median": fp8 / 1e12,
        "fp8_linear_w8a8_tflops_median": fp8_linear / 1e12,
        "copy_gb_per_s_median": bw / 1e9,
        "fp8_quantize_rowwise_ratio_to_copy_median": q_fp8,
        "nvfp4_quantize_with_amax_pass_ratio_to_copy_median": q_fp4,
        "efficiency_vs_peak": eff,
    }
    dev = Device("H100", {"bf16": bf16, "fp8": fp8, "int8": peak["int8"] * eff["low"]}, bw,
                 {"fp8": q_fp8, "int8": q_fp8, "nvfp4": q_fp4}, "fp8", True,
                 f"measured: {Path(path).name} (INT8 not measured: its peak x the FP8 efficiency)")  # fmt: skip
    return dev, taken


def assumed_device(name: str, h100: Device, taken: dict[str, Any]) -> Device:
    """A GPU no session has had: its published peaks x the H100's achieved/peak ratios (an assumption)."""
    peak, eff = PEAKS[name], taken["efficiency_vs_peak"]
    rates = {p: peak[p] * (eff["bf16"] if p == "bf16" else eff["low"]) for p in ("bf16", "fp8", "int8", "nvfp4")
             if p in peak}  # fmt: skip
    src = f"ASSUMED: published peak ({peak['source']}) x H100 efficiency"
    bw = peak["bandwidth"] * eff["bandwidth"]
    return Device(name, rates, bw, dict(h100.quantize_efficiency), EXPLORE_PRECISION[name], False, src)


def roofline(flops: float, nbytes: float, rate: float, bandwidth: float) -> float:
    """Seconds of a kernel (or a group of them) that is bound by whichever is slower: its arithmetic at
    `rate` or its memory traffic at `bandwidth`."""
    return max(flops / rate if flops else 0.0, nbytes / bandwidth if nbytes else 0.0)


def group_times(ops: list[OpCost], dev: Device, precision: str, quantized: set[str], fused: bool = False,
                attention: str = "bf16", produced: dict[str, tuple[str, bool]] | None = None
                ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Seconds per (group, kind) of one forward with `quantized` linears in `precision` ("bf16": none),
    and the activation-quantize passes those linears add. fused=True is the compiled ideal: every
    elementwise op and every activation quantize fused into the kernel next to it (costing nothing),
    a lower bound that eager and real compiled runs sit above. `attention` "fp8": the explore-only option
    of FP8 attention (q, k, v in FP8, both products at the FP8 rate, the output in BF16); "int8": SageAttention's
    recipe (Q K^T at the INT8 rate, P V from FP16 V at BF16's; `ATTENTION_PRODUCTS`). `produced`
    (`producer_fed`): linears whose input codes their producer writes, once per producer (the codes' bytes), in
    place of each linear's own quantize pass (the producer's other work stays priced as the elementwise ops it was;
    fusing those passes into one is not credited, except the write of y a codes-alone producer no longer makes: its
    BF16 bytes come off the elementwise work)."""
    out: dict[str, dict[str, float]] = {}
    produced = produced or {}
    seen: set[str] = set()
    bf16 = dev.rates["bf16"]
    for c in ops:
        if fused and c.kind == "elementwise":
            continue
        key = f"{c.group} [{c.kind}]"
        if c.kind == "attention" and attention != "bf16":
            low, v_bytes = ATTENTION_PRODUCTS[attention]
            # q and k at its width, v at the width its P V reads, the output BF16 (each a quarter of the BF16 bytes)
            nbytes = c.bytes * (2 * ELEM_BYTES[attention] / 2 + v_bytes / 2 + 1) / 4
            arith = c.flops * low / dev.rates[attention] + c.flops * (1 - low) / bf16
            out[key + f" {attention}"] = {"s": max(arith, nbytes / dev.bandwidth), "flops": c.flops, "bytes": nbytes}
            continue
        q = precision != "bf16" and c.kind == "linear" and bool(c.layers & quantized)
        if q and not c.layers <= quantized:
            raise ValueError(f"group {c.group} mixes quantized and BF16 layers; split it")
        if not q:
            out[key] = {"s": roofline(c.flops, c.bytes, bf16, dev.bandwidth), "flops": c.flops, "bytes": c.bytes}
            continue
        w = ELEM_BYTES[precision]
        nbytes = (
            (c.in_elems + c.weight_elems) * w
            + c.out_elems * 2
            + max(0.0, c.bytes - 2 * (c.in_elems + c.weight_elems + c.out_elems))
        )  # fmt: skip  (bias and anything else stays as it was)
        out[key + f" {precision}"] = {"s": roofline(c.flops, nbytes, dev.rates[precision], dev.bandwidth),
                                      "flops": c.flops, "bytes": nbytes}  # fmt: skip
        if fused:
            continue
        qbw = dev.bandwidth * dev.quantize_efficiency[precision]
        fed = [n for n in c.layers if n in produced]
        per_layer = c.in_elems / len(c.layers)
        qbytes = (len(c.layers) - len(fed)) * per_layer * (2 + w)  # read the BF16 activation, write it quantized
        if qbytes:
            out[f"{c.group} [quantize {precision}]"] = {"s": qbytes / qbw, "flops": 0.0, "bytes": qbytes}
        new = {produced[n] for n in fed} - seen  # a producer writes its codes once, for all the linears it feeds
        seen |= new
        if new:
            cbytes = len(new) * per_layer * w
            out[f"{c.group} [producer codes {precision}]"] = {"s": cbytes / qbw, "flops": 0.0, "bytes": cbytes}
        alone = sum(1 for _, codes_alone in new if codes_alone)
        if alone:  # the stock ops' last write (y, at least BF16), priced among the elementwise ops, is not made
            ybytes = alone * per_layer * 2
            out[f"{c.group} [elementwise saved: y unwritten]"] = {"s": -ybytes / dev.bandwidth, "flops": 0.0,
                                                                  "bytes": -ybytes}  # fmt: skip
    return out


def forward_seconds(ops: list[OpCost], dev: Device, precision: str, quantized: set[str], fused: bool = False,
                    attention: str = "bf16", produced: dict[str, tuple[str, bool]] | None = None
                    ) -> float:  # fmt: skip
    """One forward: the sum over its groups of each group's roofline time (no overlap between kernels)."""
    return sum(v["s"] for v in group_times(ops, dev, precision, quantized, fused, attention, produced).values())


# the GPU-to-GPU bandwidth one rank's all-to-all moves its bytes at, per direction (ASSUMED: NVLink's published
# per-GPU figure, H100/H200 NVLink 4 and B200 NVLink 5 halved for one direction, A100 NVLink 3), never measured here
LINK_BANDWIDTH = {"H100": 450e9, "A100": 300e9, "B200": 900e9}


def context_parallel(ops: list[OpCost], dev: Device, precision: str, quantized: set[str], cp: int,
                     fused: bool = False, produced: dict[str, tuple[str, bool]] | None = None
                     ) -> dict[str, float]:  # fmt: skip
    """One forward split over `cp` ranks by Ulysses (rl/context_parallel.py): each rank computes 1/cp of every op
    (its tokens through the linears, its heads through attention) and, around each self-attention call, all-to-alls
    q, k, v in and the output back: (cp - 1) / cp of its share of those bytes, at the assumed link bandwidth, not
    overlapped with compute (a cross-attention's queries stay with their rank: no exchange). Returns the rank's
    compute and communication seconds, the forward's, and its efficiency: the unsplit forward's seconds over cp
    ranks' seconds (1.0: the split costs nothing). `produced`: the explore copy's producer-fed linears
    (`producer_fed`), priced as `group_times` prices them."""
    whole = forward_seconds(ops, dev, precision, quantized, fused, produced=produced)
    compute = whole / cp
    comm = sum(c.self_bytes / cp * (cp - 1) / cp for c in ops if c.kind == "attention") / LINK_BANDWIDTH[dev.name]
    return {"compute_s": compute, "comm_s": comm, "forward_s": compute + comm,
            "efficiency": whole / (cp * (compute + comm)), "comm_share": comm / (compute + comm)}


def kind_shares(times: dict[str, dict[str, float]]) -> dict[str, float]:
    """Share of the forward's time per kind of work (for the summary)."""
    tot = sum(v["s"] for v in times.values()) or 1.0
    out: dict[str, float] = {}
    for key, v in times.items():
        kind = key[key.index("[") + 1 : key.index("]")].split()[0]
        if kind == "linear" and key.rstrip().endswith(("fp8", "int8", "nvfp4")):
            kind = "linear_quantized"
        out[kind] = out.get(kind, 0.0) + v["s"] / tot
    return out


# --- seconds per iteration --------------------------------------------------------------------------


def iteration_seconds(t_bf16: float, t_explore: float, t_train_fwd: float, refresh: float, *, prompts: int, n: int,
                      k: int, batch: int, preview_steps: int, full_steps: int, timestep_fraction: float,
                      train_batch: int) -> dict[str, dict[str, float]]:  # fmt: skip
    """Rollout and training seconds of each family on one GPU (its `prompts` of the iteration).

    naive_scaling explores N x P in BF16 at full steps; naive_quant the same in the explore precision;
    sol_rl previews N x P quantized at preview steps, regenerates K x P in BF16 at full steps and
    refreshes its copy once. Training is the same for all three: nft_update over K x P samples at
    int(full_steps x timestep_fraction) timesteps, TRAIN_FORWARDS forwards each at the train batch.
    """
    chunks_n, chunks_k = math.ceil(n * prompts / batch), math.ceil(k * prompts / batch)
    n_t = max(1, int(full_steps * timestep_fraction))
    train = n_t * math.ceil(k * prompts / train_batch) * TRAIN_FORWARDS * t_train_fwd
    fams = {
        "naive_scaling": {"explore": chunks_n * full_steps * t_bf16, "regen": 0.0, "refresh": 0.0},
        "naive_quant": {"explore": chunks_n * full_steps * t_explore, "regen": 0.0, "refresh": refresh},
        "sol_rl": {"explore": chunks_n * preview_steps * t_explore, "regen": chunks_k * full_steps * t_bf16,
                   "refresh": refresh},
    }  # fmt: skip
    for f in fams.values():
        f["rollout"] = f["explore"] + f["regen"] + f["refresh"]
        f["train"] = train
        f["total"] = f["rollout"] + train
    return fams


def refresh_seconds(net: nn.Module, dev: Device, precision: str, quantized: set[str]) -> float:
    """Writing the updated weights into the explore copy once: read BF16, write the quantized width."""
    elems = sum(net.get_submodule(n).weight.numel() for n in quantized)
    return elems * (2 + ELEM_BYTES[precision]) / (dev.bandwidth * dev.quantize_efficiency[precision])


# --- measured runs -------------------------------------------------------------------------------


def measured_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """Per-forward and per-phase times of recorded bench/e2e.py runs on full-size models, with their settings."""
    out = []
    for p in paths:
        if not Path(p).exists():
            continue
        rec = json.loads(Path(p).read_text())
        for fam, r in rec["results"].items():
            c = rec["configs"][fam]
            steps = c["preview_steps"] if fam == "sol_rl" else c["full_steps"]
            chunks = math.ceil(c["n"] * c["prompts_per_iter"] / c["rollout_batch_size"])
            out.append({
                "file": Path(p).name, "gpu": rec["info"].get("name"), "model": rec["model"], "family": fam,
                "compiled": bool(c.get("compiled_sampler")), "explore_recipe": r.get("explore_recipe"),
                "settings": {k: c[k] for k in ("n", "k", "prompts_per_iter", "rollout_batch_size", "train_batch_size",
                                               "preview_steps", "full_steps", "timestep_fraction")},
                "time_explore_s": r["time_explore_s"], "time_train_s": r["time_train_s"],
                "time_total_s": r["time_total_s"],
                "forward_s": r["time_explore_s"] / (chunks * steps),  # one explore forward at the rollout batch
            })  # fmt: skip
    return out


def _loop(settings: dict[str, Any]) -> dict[str, Any]:
    """The loop settings iteration_seconds takes, from the script's settings."""
    keys = ("n", "k", "preview_steps", "full_steps", "timestep_fraction")
    return {"prompts": settings["prompts_per_gpu"], **{k: settings[k] for k in keys}}


# --- the whole prediction -----------------------------------------------------------------------------


def predict(families: list[str], devices: list[Device], batches: dict[str, int], settings: dict[str, Any],
            measured: list[dict[str, Any]], arch: dict[str, dict[str, Any]] | None = None,
            resolution: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """Per family and device: forward times, seconds per iteration, Sol-RL's ratios; and the measured
    H100 runs against the same model at their own settings."""
    out: dict[str, Any] = {}
    comparisons = []
    for fam in families:
        model = build_meta_model(fam, (arch or {}).get(fam), (resolution or {}).get(fam))
        b = batches[fam]
        profiles = {b: profile_forward(model, b)}
        tb, tf = family_training(fam)
        tb = settings.get("train_batch") or tb  # --train-batch overrides every family's
        loop = {**_loop(settings), "timestep_fraction": tf}
        profiles.setdefault(tb, profile_forward(model, tb))
        ops = profiles[b]
        lin = sum(c.flops for c in ops if c.kind == "linear")
        fam_out: dict[str, Any] = {
            "rollout_batch": b, "train_batch": tb, "timestep_fraction": tf, "latent_shape": list(model.latent_shape),
            "forward_gflops": {k: sum(c.flops for c in ops if c.kind == k) / 1e9 for k in
                               ("linear", "attention", "conv")},
            "forward_gbytes_bf16": sum(c.bytes for c in ops) / 1e9,
            "devices": {},
        }  # fmt: skip
        for dev in devices:
            prec = dev.explore_precision
            quantized = explore_layers(model, fam, prec, bool(settings.get("every_layer")))
            produced = producer_fed(model, fam, prec, quantized)
            qflops = sum(c.flops for c in ops if c.kind == "linear" and c.layers & quantized)
            refresh = refresh_seconds(model.transformer, dev, prec, quantized)
            entry: dict[str, Any] = {
                "measured_rates": dev.measured, "explore_precision": prec, "quantized_layers": len(quantized),
                "quantized_share_of_linear_flops": qflops / lin if lin else 0.0, "refresh_s": refresh,
                "producer_fed_layers": len(produced), "producers": len(set(produced.values())),
                "producers_codes_alone": len({p for p, alone in produced.values() if alone}),
            }  # fmt: skip
            for mode in ("eager", "fused"):
                fused = mode == "fused"
                times_bf16 = group_times(ops, dev, "bf16", set(), fused)
                times_q = group_times(ops, dev, prec, quantized, fused, produced=produced)
                t_bf16 = sum(v["s"] for v in times_bf16.values())
                t_q = sum(v["s"] for v in times_q.values())
                t_train = forward_seconds(profiles[tb], dev, "bf16", set(), fused)
                it = iteration_seconds(t_bf16, t_q, t_train, refresh, batch=b, train_batch=tb, **loop)
                base = it["naive_scaling"]
                entry[mode] = {
                    "forward_ms": {"bf16": t_bf16 * 1e3, prec: t_q * 1e3}, "forward_speedup": t_bf16 / t_q,
                    "time_shares": {"bf16": kind_shares(times_bf16), prec: kind_shares(times_q)},
                    "train_forward_ms": t_train * 1e3, "iteration_s": it,
                    "ratios": {f: {"rollout_vs_naive_scaling": base["rollout"] / r["rollout"],
                                   "e2e_vs_naive_scaling": base["total"] / r["total"]} for f, r in it.items()},
                }  # fmt: skip
                if settings.get("context_parallel", 1) > 1:  # each forward over cp ranks (Ulysses), per precision
                    cp = settings["context_parallel"]
                    entry[mode]["context_parallel"] = {"degree": cp, "bf16": context_parallel(ops, dev, "bf16", set(),
                                                                                              cp, fused),
                                                       prec: context_parallel(ops, dev, prec, quantized, cp, fused,
                                                                              produced),
                                                       "train": context_parallel(profiles[tb], dev, "bf16", set(), cp,
                                                                                 fused)}  # fmt: skip
                # low-precision attention in the explore forward only (explore_attention=<fmt>): FP8's kernel where
                # the device has FP8 tensor cores, else SageAttention's INT8 (an A100)
                att = next((f for f in ATTENTION_PRODUCTS if f in dev.rates), None)
                if att is not None:
                    t_qa = forward_seconds(ops, dev, prec, quantized, fused, attention=att, produced=produced)
                    ita = iteration_seconds(t_bf16, t_qa, t_train, refresh, batch=b, train_batch=tb, **loop)
                    entry[mode][f"attention_{att}_explore"] = {
                        "forward_ms": t_qa * 1e3, "forward_speedup": t_bf16 / t_qa,
                        "sol_rl_rollout_vs_naive_scaling": base["rollout"] / ita["sol_rl"]["rollout"],
                        "sol_rl_e2e_vs_naive_scaling": base["total"] / ita["sol_rl"]["total"],
                    }  # fmt: skip
            fam_out["devices"][dev.name] = entry
        out[fam] = fam_out
        comparisons += _compare(fam, model, devices, [m for m in measured if m["model"] == fam])
    return {"families": out, "measured_vs_predicted": comparisons}


def _compare(fam: str, model: Any, devices: list[Device], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured run beside the model's prediction at that run's own batch and settings."""
    dev = next((d for d in devices if d.measured), None)
    if dev is None or not runs:
        return []
    out = []
    for m in runs:
        s = m["settings"]
        ops = profile_forward(model, s["rollout_batch_size"])
        train_ops = profile_forward(model, s["train_batch_size"])
        quantized_run = m["explore_recipe"] not in (None, "") and not str(m["explore_recipe"]).startswith("policy")
        prec = str(m["explore_recipe"]).split("+")[0] if quantized_run else "bf16"
        q = explore_layers(model, fam, prec) if quantized_run else set()
        fused = m["compiled"]  # a compiled run is read against the fused bound, an eager one against eager
        t_fwd = forward_seconds(ops, dev, prec, q, fused)
        it = iteration_seconds(forward_seconds(ops, dev, "bf16", set(), fused), t_fwd,
                               forward_seconds(train_ops, dev, "bf16", set()), 0.0, prompts=s["prompts_per_iter"],
                               n=s["n"], k=s["k"], batch=s["rollout_batch_size"], preview_steps=s["preview_steps"],
                               full_steps=s["full_steps"], timestep_fraction=s["timestep_fraction"],
                               train_batch=s["train_batch_size"])  # fmt: skip
        pred = it[m["family"]] if m["family"] in it else it["naive_scaling"]
        out.append({
            "model": fam, "family": m["family"], "file": m["file"], "gpu": m["gpu"], "compiled": m["compiled"],
            "precision": prec, "model_mode": "fused" if fused else "eager",
            "forward_ms": {"measured": m["forward_s"] * 1e3, "predicted": t_fwd * 1e3},
            "explore_s": {"measured": m["time_explore_s"], "predicted": pred["explore"]},
            "train_s": {"measured": m["time_train_s"], "predicted": pred["train"]},
            "predicted_over_measured_forward": t_fwd / m["forward_s"],
        })  # fmt: skip
    return out


ASSUMPTIONS = [
    "Eager execution: every aten op of the forward is one kernel that reads its inputs and writes its output "
    "once; no overlap between kernels; launch overhead ignored. Compiled/fused runs move fewer bytes.",
    "Per group, time = max(FLOPs / rate, bytes / bandwidth) with the device's achieved (not peak) rates.",
    "Attention (SDPA) is one fused kernel at the BF16 GEMM rate, reading q, k, v and writing its output.",
    "Quantized linears run at the explore precision's GEMM rate with weights and activations at its width "
    "(NVFP4 0.5625 B/element with its block scales) and BF16 outputs, plus one pass that quantizes the activation "
    "at the measured quantize kernel's fraction of copy bandwidth (H100: FP8 row-wise Triton; NVFP4: the CUDA "
    "quantize with its amax pass), assumed the same on A100 and B200.",
    "A100 and B200 rates are ASSUMED: published dense peaks x the H100's measured achieved/peak ratios "
    "(BF16 GEMM for BF16, FP8 GEMM for INT8/FP8/NVFP4, copy for bandwidth). H100 INT8 is likewise assumed.",
    f"Training (same for every family) is ASSUMED to cost {TRAIN_FORWARDS:g} BF16 forwards per sample-timestep "
    "(old and reference no-grad forwards, the policy's forward and a backward through frozen weights) at the "
    "train batch, over K x P samples and int(full_steps x timestep_fraction) timesteps; LoRA branches ignored.",
    "Text encoding, VAE decode and reward scoring are left out (the random-weight models have stand-ins); "
    "refresh = reading BF16 and writing the quantized width of every quantized weight once per iteration.",
    "Context parallelism (--context-parallel N, Ulysses): each rank does 1/N of every op, plus all-to-alls of "
    "q, k, v and the self-attention output ((N - 1) / N of each rank's share of their bytes) at an ASSUMED NVLink "
    "bandwidth per direction (" + ", ".join(f"{k} {v / 1e9:.0f} GB/s" for k, v in LINK_BANDWIDTH.items()) + "), "
    "not overlapped with compute; the embeddings before the split and the gathered output are not priced.",
    "Rollout batches: "
    + ", ".join(f"{k} {v}" for k, v in ROLLOUT_BATCH.items())
    + " (bench/e2e.py's usage); a partial last chunk costs a full batch.",
]


def summary_lines(res: dict[str, Any]) -> list[str]:
    """The one-screen table: per family and device, the eager forwards, seconds per iteration and
    Sol-RL's ratios, then the fused (compiled ideal) forward speedup and ratios."""
    lines = [f"{'':<27}{'':<6}{'-- eager: forward ms, s/iteration/GPU, sol_rl vs naive_scaling --':<66}"
             f"{'-- fused --':>18}",
             f"{'model':<21}{'gpu':<6}{'prec':<6}{'bf16':>8}{'explore':>8}{'fwd x':>7}{'naive':>8}{'sol_rl':>8}"
             f"{'train':>8}{'rollout x':>10}{'e2e x':>7}{'fwd x':>7}{'rollout x':>10}{'e2e x':>7}"]  # fmt: skip
    for fam, f in res["families"].items():
        for name, d in f["devices"].items():
            p, e, fu = d["explore_precision"], d["eager"], d["fused"]
            it = e["iteration_s"]
            tag = name if d["measured_rates"] else name + "*"
            lines.append(
                f"{fam:<21}{tag:<6}{p:<6}{e['forward_ms']['bf16']:>8.0f}{e['forward_ms'][p]:>8.0f}"
                f"{e['forward_speedup']:>7.2f}{it['naive_scaling']['rollout']:>8.1f}{it['sol_rl']['rollout']:>8.1f}"
                f"{it['sol_rl']['train']:>8.1f}{e['ratios']['sol_rl']['rollout_vs_naive_scaling']:>10.2f}"
                f"{e['ratios']['sol_rl']['e2e_vs_naive_scaling']:>7.2f}{fu['forward_speedup']:>7.2f}"
                f"{fu['ratios']['sol_rl']['rollout_vs_naive_scaling']:>10.2f}"
                f"{fu['ratios']['sol_rl']['e2e_vs_naive_scaling']:>7.2f}"
            )  # fmt: skip
    lines.append("* assumed rates (published peak x H100 efficiency). fused: elementwise ops and quantize free (bound)")
    lines.append(f"{'model':<21}{'gpu':<6}{'attention share of the bf16 forward':>36}{'sol_rl rollout x, FP8 (INT8) attention in the explore pass too':>63}")  # noqa: E501
    for fam, f in res["families"].items():
        for name, d in f["devices"].items():
            e = d["eager"]
            share = e["time_shares"]["bf16"].get("attention", 0.0)
            att, opt = next(((a, e[f"attention_{a}_explore"]) for a in ATTENTION_PRODUCTS
                             if f"attention_{a}_explore" in e), (None, None))  # fmt: skip
            got = f"{opt['sol_rl_rollout_vs_naive_scaling']:.2f} (vs {e['ratios']['sol_rl']['rollout_vs_naive_scaling']:.2f}){'' if att == 'fp8' else ' ' + str(att)}" if opt else "- (no 8-bit rate)"  # noqa: E501
            lines.append(f"{fam:<21}{name + ('' if d['measured_rates'] else '*'):<6}{share:>36.0%}{got:>63}")
    cps = [(fam, name, d) for fam, f in res["families"].items() for name, d in f["devices"].items()
           if "context_parallel" in d["eager"]]  # fmt: skip
    if cps:
        lines.append(f"{'model':<21}{'gpu':<6}{'context parallel (eager): bf16 forward ms per rank, comm share, efficiency':>76}")  # noqa: E501
    for fam, name, d in cps:
        c = d["eager"]["context_parallel"]
        b = c["bf16"]
        lines.append(f"{fam:<21}{name + ('' if d['measured_rates'] else '*'):<6}{'cp ' + str(c['degree']):>24}"
                     f"{b['forward_s'] * 1e3:>14.0f}{b['comm_share']:>16.0%}{b['efficiency']:>22.2f}")  # fmt: skip
    for c in res["measured_vs_predicted"]:
        lines.append(
            f"measured {c['model']} {c['family']} ({c['precision']}, {'compiled' if c['compiled'] else 'eager'}, "
            f"{c['gpu']}): forward {c['forward_ms']['measured']:.0f} ms vs predicted {c['forward_ms']['predicted']:.0f}"
            f" ms ({c['model_mode']}); train {c['train_s']['measured']:.2f} s vs {c['train_s']['predicted']:.2f} s"
        )  # fmt: skip
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(IMAGE_FAMILIES), help="sana-1.6b, sd35-large, flux-dev, z-image, "
                    "flux2-klein-4b, qwen-image, qwen-image-edit, and the video ones wan2.1-1.3b, wan2.1-14b, "
                    "sana-video-2b (480 x 832, 81 frames)")  # fmt: skip
    ap.add_argument("--batch", action="append", default=[], help="rollout batch of a family, e.g. flux-dev=16")
    ap.add_argument("--prompts-per-gpu", type=int, default=PAPER["prompts_per_gpu"])
    ap.add_argument("--n", type=int, default=PAPER["n"])
    ap.add_argument("--k", type=int, default=PAPER["k"])
    ap.add_argument("--preview-steps", type=int, default=PAPER["preview_steps"])
    ap.add_argument("--full-steps", type=int, default=PAPER["full_steps"])
    ap.add_argument("--train-batch", type=int, default=None, help="every family's train batch (default: each "
                    "family's paper preset: SD3.5-L 2, FLUX 12, SANA 16)")  # fmt: skip
    ap.add_argument("--context-parallel", type=int, default=1, help="also price each forward split over this many "
                    "ranks (Ulysses: 1/N of the work per rank plus the all-to-alls around attention)")  # fmt: skip
    ap.add_argument("--kernels", default=str(KERNELS_JSON), help="a bench/kernels.py record of the H100")
    ap.add_argument("--measured", action="append", default=[], help="bench/e2e.py records to compare with")
    ap.add_argument("--every-layer", action="store_true", help="price every family's explore format on every "
                    "eligible layer (as INT8's rule), not its own rule: what a wider rule would buy")
    ap.add_argument("--out", default=str(OUT_JSON))
    return ap


def main(argv: list[str] | None = None, arch: dict[str, dict[str, Any]] | None = None,
         resolution: dict[str, int] | None = None) -> Path:  # fmt: skip
    """Predict, print the table, write the JSON (`arch`/`resolution`: tests' tiny overrides)."""
    args = build_parser().parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    batches = dict(ROLLOUT_BATCH)
    for item in args.batch:
        name, _, val = item.partition("=")
        batches[name] = int(val)
    settings = dict(prompts_per_gpu=args.prompts_per_gpu, n=args.n, k=args.k, preview_steps=args.preview_steps,
                    full_steps=args.full_steps, timestep_fraction=None, train_batch=args.train_batch,
                    context_parallel=args.context_parallel, every_layer=args.every_layer,
                    )  # fmt: skip  (None: each family's paper preset)
    h100, taken = h100_from_kernels(Path(args.kernels))
    devices = [h100, assumed_device("A100", h100, taken), assumed_device("B200", h100, taken)]
    measured = measured_runs([Path(p) for p in (args.measured or MEASURED_E2E)])
    res = predict(families, devices, batches, settings, measured, arch, resolution)
    rec = {
        "bench": "speed-model",
        "settings": settings,
        "settings_note": "train_batch / timestep_fraction null: each family's paper preset (families.*.train_batch, "
                         "timestep_fraction)",
        "devices": {d.name: asdict(d) for d in devices},
        "h100_measurements_taken": taken,
        "peaks_assumed": PEAKS,
        "train_forwards_per_sample_timestep": TRAIN_FORWARDS,
        "assumptions": ASSUMPTIONS,
        **res,
    }
    lines = summary_lines(res)
    print("\n".join(lines))
    rec["summary"] = lines
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2, default=sorted))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
