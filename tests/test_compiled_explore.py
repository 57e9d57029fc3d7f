"""Compiled explore with the quantize traced, proven on a CPU through inductor (C++), at a simulated
GPU capability (SOLRL_SIMULATE_SM) where torch._scaled_mm and torch._int_mm run on the CPU:

- the traced forms of the FP8 and INT8 layers give the eager fast path's bits under torch.compile;
- inductor fuses the activation's row amax and cast into the kernel that produces the activation;
- the compiled graphs hold scaled GEMMs and no opaque quantized op (the census records it);
- regional compilation compiles a rollout copy's repeated block once, never a training module in place;
- the compiled sampler on the tiny model and the tiny real-class pipelines (saved, reloaded) gives the
  eager explore's outputs to the precision's tolerance.
"""

from __future__ import annotations

import copy as copy_module
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from families import families
from tiny_pipelines import (
    SIZES,
    LazyPipes,
    build_flux,
    build_flux2,
    build_qwenimage,
    build_sana,
    build_sana_video,
    build_sd3,
    build_wan,
    build_z_image,
)
from torch import nn

from solrl_engine.explore.copy import POLICY, ExploreCopy
from solrl_engine.hw import cpu_compile_available
from solrl_engine.kernels import set_trace_quantize
from solrl_engine.kernels.nvfp4 import nvfp4_activation_operands
from solrl_engine.models import load_model, model_spec
from solrl_engine.nn import QuantLinear, fast_path
from solrl_engine.rl.config import ConfigError, RLConfig
from solrl_engine.sampling import GraphedSampler, sample
from solrl_engine.sampling.compile import (
    FED,
    OPAQUE,
    PRODUCER_KINDS,
    TRACED_KINDS,
    Census,
    census_backend,
    compile_regions,
    repeated_blocks,
    use_cache_dir,
)

pytestmark = pytest.mark.skipif(not cpu_compile_available()[0], reason="inductor needs a C++ compiler on a CPU")

SM = {"fp8": "90", "int8": "80"}  # the GPU generation whose fast GEMM each format's layer takes


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    set_trace_quantize(True)


def _compiled(fn, census: Census):
    return torch.compile(fn, backend=census_backend(census), dynamic=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_traced_layer_gives_the_eager_fast_paths_numbers(fmt, dtype, monkeypatch):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", SM[fmt])
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    torch.manual_seed(0)
    for shape in [(7, 48), (3, 5, 128)]:
        lin = nn.Linear(shape[-1], 32)
        layer = QuantLinear.from_linear(lin, fmt)
        assert layer.choose_kernel()[0] == "cuda"
        census = Census()
        fn = _compiled(layer, census)
        for name, x in families(shape, seed=len(shape)):
            x = x.to(dtype)
            want = layer(x)
            assert fast_path(nn.Sequential(layer)).fast == ["0"], f"{name}: eager ran {fast_path(layer).summary()}"
            got = fn(x)
            assert got.dtype == want.dtype == dtype
            if fmt == "fp8":  # the quantize and cuBLASLt's GEMM as eager runs them: the same bits
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
            else:  # the same codes and INT32 sums; inductor may contract the epilogue's scale and bias into an FMA
                torch.testing.assert_close(got, want, rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=0,
                                           equal_nan=True, msg=name)  # fmt: skip
        assert census.traced == len(census.graphs) == 1 and census.opaque == 0, census.summary()


def _norm_then_quantized(fmt: str) -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(64, elementwise_affine=False)
            self.proj = QuantLinear.from_linear(nn.Linear(64, 128), fmt)

        def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.proj(self.norm(x) * (1 + scale) + shift)  # adaLN modulation, as a DiT block has

    return Block()


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_activation_quantize_fuses_into_the_norm_that_produces_it(fmt, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("SOLRL_SIMULATE_SM", SM[fmt])
    torch.manual_seed(1)
    block = _norm_then_quantized(fmt)
    x, shift, scale = torch.randn(4, 16, 64), torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    census = Census()
    _, code = run_and_get_code(_compiled(block, census), x, shift, scale)
    kernels = set(re.findall(r"\b(cpp_fused_\w+)", "\n".join(code)))
    fused = [k for k in kernels if "native_layer_norm" in k and "amax" in k]
    assert fused, f"no kernel computes the norm and the row amax together: {sorted(kernels)}"
    gemm = "_scaled_mm" if fmt == "fp8" else "_int_mm"
    assert re.search(rf"extern_kernels\.{gemm}\(", "\n".join(code)), "the scaled GEMM is not cuBLASLt's (extern) op"
    assert census.traced == 1 and census.opaque == 0
    # the opaque custom op, for contrast: inductor cannot see into it
    torch._dynamo.reset()
    set_trace_quantize(False)
    opaque = Census()
    _, code = run_and_get_code(_compiled(block, opaque), x, shift, scale)
    assert opaque.total()[OPAQUE] == 1 and opaque.traced == 0
    assert not any("amax" in k for k in re.findall(r"\b(cpp_fused_\w+)", "\n".join(code)))


def test_regional_compile_traces_each_block_class_once_and_never_a_training_module():
    torch.manual_seed(2)
    model = load_model("tiny")
    spec = model_spec("tiny")
    copy = ExploreCopy(model.transformer, POLICY)
    blocks = repeated_blocks(copy.transformer, spec.repeated_blocks)
    assert len(blocks) == model.config.num_layers
    census = Census()
    assert compile_regions(copy.transformer, census_backend(census), spec.repeated_blocks) == len(blocks)
    cond = model.encode_prompts(["a red circle", "a blue square"])
    x, t = torch.randn(2, *model.latent_shape), torch.full((), 0.6)
    with torch.no_grad():
        got = model.velocity(x, t, cond, transformer=copy.transformer)
        want = model.velocity(x, t, cond)  # the eager policy: same weights, no LoRA yet
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # six blocks, at most three variants of one class (SD3's last block is context-only): traced once each
    assert 1 <= len(census.graphs) <= 3, census.summary()
    # a module that trains (the policy, evaluated with an adapter active): its blocks run compiled while the
    # sampler calls it and eager after, so the training step never runs them
    gs = GraphedSampler(model, cpu_compile=True, blocks=spec.repeated_blocks)
    model.transformer.requires_grad_(True)
    seen: list[bool] = []
    first = repeated_blocks(model.transformer, spec.repeated_blocks)[0]
    first.register_forward_pre_hook(lambda m, a: seen.append(getattr(m, "_compiled_call_impl", None) is not None))
    got = gs.sample(cond, [5, 6], 1)
    want = sample(model, cond, [5, 6], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    c = gs.stats.census
    assert 1 <= len(c.graphs) <= 3 and "conv2d (full precision)" not in c.total(), c.summary()  # blocks only
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in repeated_blocks(model.transformer,
                                                                                        spec.repeated_blocks))
    assert seen and seen[-1] is False  # the eager sample after it ran the block eagerly


BUILDERS = {"sd3": build_sd3, "flux": build_flux, "sana": build_sana, "wan": build_wan, "qwenimage": build_qwenimage,
            "z_image": build_z_image, "flux2": build_flux2, "sana_video": build_sana_video}


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return LazyPipes(tmp_path_factory.mktemp("compiled"), BUILDERS)


def _explore(model, spec, fmt: str) -> tuple[dict[str, float], Census, ExploreCopy]:
    """The compiled sampler against the eager one on the same quantized copy, beside quantization's own
    error (mean absolute differences of the samples). One step compares the same computation; over
    several steps a trajectory is chaotic in FP8/INT8 codes (a last-bit difference upstream flips a
    code, which moves the sample by a quantization step), so there the two are compared by accuracy."""
    copy = ExploreCopy(model.transformer, fmt, changes=spec.explore_rule)
    cond = model.encode_prompts(["a red circle", "a blue square"])
    seeds = [3, 4]
    gs = GraphedSampler(model, cpu_compile=True, blocks=spec.repeated_blocks)
    out: dict[str, float] = {}
    for steps in (1, 3):
        policy = sample(model, cond, seeds, steps)
        eager = sample(model, cond, seeds, steps, transformer=copy.transformer)
        got = gs.sample(cond, seeds, steps, transformer=copy.transformer)
        out[f"compiled_vs_eager_{steps}"] = float((got - eager).abs().mean())
        out[f"eager_vs_policy_{steps}"] = float((eager - policy).abs().mean())
        out[f"compiled_vs_policy_{steps}"] = float((got - policy).abs().mean())
    assert gs.stats.compiles == 1 and gs.stats.compile_s[0] > 0  # one denoiser graph serves both step counts
    return out, gs.stats.census, copy


@pytest.mark.parametrize(("name", "fmt"), [("tiny", "fp8"), ("tiny", "int8"), ("sd3", "fp8"), ("flux", "fp8"),
                                           ("sana", "int8")])  # fmt: skip
def test_compiled_explore_matches_eager_on_the_real_classes(name, fmt, pipes, monkeypatch):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", SM[fmt])
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    torch.manual_seed(3)
    model = load_model("tiny") if name == "tiny" else load_model(name, pipes[name], "cpu", torch.float32,
                                                                 resolution=SIZES[name])  # fmt: skip
    spec = model_spec(name)
    err, census, copy = _explore(model, spec, fmt)
    in_blocks = sum(isinstance(m, QuantLinear) for b in repeated_blocks(copy.transformer, spec.repeated_blocks)
                    for m in b.modules())  # fmt: skip
    assert in_blocks, "the family's rule quantizes nothing inside its repeated blocks"
    # every compiled graph's quantized GEMMs are traced scaled GEMMs; none is an opaque op
    assert census.traced >= 1 and census.opaque == 0, census.summary()
    # one step: compiled explore computes what eager explore does, far inside quantization's own error
    assert err["eager_vs_policy_1"] > 0
    assert err["compiled_vs_eager_1"] <= 0.05 * err["eager_vs_policy_1"], err
    # three steps: compiled explore is as accurate as eager explore
    assert err["compiled_vs_policy_3"] <= 1.5 * err["eager_vs_policy_3"], err


def _fed_and_quantized(copy: ExploreCopy, spec: Any) -> set[tuple[int, int]]:
    """(linears fed by a producer, linears quantizing their input) of each repeated block (SD3.5's last joint block,
    context_pre_only, has fewer; Z-Image's context refiner none fed)."""
    out = set()
    for name, m in copy.transformer.named_modules():
        if type(m).__name__ not in spec.repeated_blocks:
            continue
        fed = sum(len(v) for p, v in copy.producers.fused.items() if p.startswith(name + "."))
        quantized = sum(1 for n, q in m.named_modules() if isinstance(q, QuantLinear) and q.recipe.quantize_activations)
        out.add((fed, quantized))
    return out


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_familys_8bit_explore_copies_compile_without_a_graph_break(name, pipes, monkeypatch):
    """The explore copy of every family, in FP8 (sm_90), INT8 through torch._int_mm (sm_80) and INT8 through the
    Triton GEMM (sm_90, the interpreter), its repeated blocks compiled as the sampler compiles them (dynamo's
    tracing; BF16 weights under autocast, as a GPU runs them): no graph break, and every quantized GEMM traced (the
    quantize as torch ops, none an opaque op), with the family's producers (fused forwards included) in the graph,
    each codes-alone producer's codes reaching its linears (tracing an op that reads its unwritten y raises: an
    FFN's nn.Dropout did, handing the second linear a plain tensor, so the copy's dropouts are identities).
    A graph break would leave part of each block eager (the H200 record of SANA's compiled FP8 copy had 19)."""
    from torch._dynamo.utils import counters, guard_failures

    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    size = {"resolution": SIZES[name]} if name in SIZES else {}
    model = load_model(name, pipes[name], "cpu", torch.bfloat16, **size)
    spec = model_spec(name)
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red apple", "a blue cup"])

    def graphs(net: nn.Module) -> Census:
        torch._dynamo.reset()
        counters.clear()
        guard_failures.clear()
        census = Census()
        assert compile_regions(net, census_backend(census, inner="eager"), spec.repeated_blocks) >= 1
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model.velocity(x, torch.tensor([0.7, 0.3]), cond, transformer=net)
        return census

    policy_graphs = len(graphs(copy_module.deepcopy(model.transformer)).graphs)
    for fmt, sm, gemm in (("fp8", "90", "scaled_mm"), ("int8", "80", "int_mm"), ("int8", "90", "int8_gemm")):
        monkeypatch.setenv("SOLRL_SIMULATE_SM", sm)
        rule = {**spec.explore_rule, **spec.explore_rule_by_format.get(fmt, {})}
        copy = ExploreCopy(model.transformer, fmt, changes=rule, producers=spec.producers,
                           producer_blocks=spec.producer_blocks)  # fmt: skip
        census = graphs(copy.transformer)
        assert dict(counters["graph_break"]) == {}, (fmt, sm, dict(counters["graph_break"]))
        # as many graphs as the BF16 policy compiles: no block compiled again for an engine attribute (a producer's
        # per-instance tag once was a guard, so every block instance compiled its own graph)
        ours = [r for rs in guard_failures.values() for r in rs if "_solrl" in str(r)]
        assert not ours and len(census.graphs) == policy_graphs, (fmt, sm, len(census.graphs), ours[:2])
        kinds = census.total()
        assert census.opaque == 0 and census.traced >= 1, (fmt, sm, census.summary())
        assert all(k.startswith(gemm) for k in kinds if k in TRACED_KINDS), (fmt, sm, census.summary())
        assert (sum(kinds[k] for k in PRODUCER_KINDS) >= 1) == bool(copy.producers.fused), census.summary()
        # a family with producers (adaLN modules: FLUX.1, SD3.5; inline-modulated norms: those and SANA, Wan,
        # Qwen-Image; FFN activations: GELUs, SANA's and SANA-Video's gates) fuses some in every 8-bit copy; a norm
        # is left only where the rule keeps its consumers in BF16 (SANA's FP8 self-attention)
        assert bool(copy.producers.fused) == bool(spec.producers), copy.producers
        assert bool(copy.producers.codes_only) == bool(spec.producers), copy.producers
        # each graph (one block) reads its producers' codes in as many GEMMs as the block has fed linears, and traces
        # a quantize only for the rest: (fed, traced) of every graph is that of some block
        assert {(g[FED], sum(g[k] for k in TRACED_KINDS)) for g in census.graphs} <= _fed_and_quantized(copy, spec)
        assert set(copy.producers.left.values()) <= {"none of the linears it feeds is quantized with row-wise codes"}
        del copy


def test_compile_config_keys_are_checked_and_read():
    with pytest.raises(ConfigError, match="compile_mode"):
        RLConfig(compile_mode="max-autotune").validate()
    RLConfig(compile_mode="max-autotune-no-cudagraphs", compile_regional=False).validate()
    gs = GraphedSampler(load_model("tiny"), cpu_compile=True, mode="max-autotune-no-cudagraphs", regional=False)
    assert gs.mode == "max-autotune-no-cudagraphs" and not gs.regional


def test_a_cache_dir_makes_the_second_process_load_compiled_code(tmp_path):
    """compile_cache_dir: a second run (a fresh process, as a new job or machine given the directory)
    finds the first's FX graph in the cache instead of compiling it."""
    script = textwrap.dedent(f"""
        import torch
        from solrl_engine.sampling.compile import use_cache_dir
        use_cache_dir({str(tmp_path / "cache")!r})
        f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
        f(torch.randn(8, 8))
        c = torch._dynamo.utils.counters["inductor"]
        print("HITS", c["fxgraph_cache_hit"], "MISSES", c["fxgraph_cache_miss"])
    """)  # fmt: skip
    outs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300) for _ in "ab"]
    for o in outs:
        assert o.returncode == 0, o.stderr[-2000:]
    first, second = (re.search(r"HITS (\d+) MISSES (\d+)", o.stdout).groups() for o in outs)
    assert first == ("0", "1") and second == ("1", "0"), (first, second)
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").rglob("*"))
    assert use_cache_dir(None) is None


def test_nvfp4_layers_keep_their_block_scales_pre_swizzled_through_requantize():
    """Blackwell's FP4 GEMM reads the weight's block scales in the 128x4 tiled order: the layer writes
    that copy with the scales (construction, requantize_), in place, not per call; it is not saved."""
    from solrl_engine.nn import requantize_
    from solrl_engine.quant import nvfp4

    torch.manual_seed(4)
    src = nn.Sequential(nn.Linear(64, 48))
    layer = QuantLinear.from_linear(src[0], "nvfp4")
    torch.testing.assert_close(layer.w_scale_swizzled, nvfp4.swizzle_scales(layer.w_scale).view(torch.uint8),
                               rtol=0, atol=0)  # fmt: skip
    assert "w_scale_swizzled" not in layer.state_dict()
    q = nn.Sequential(layer)
    ptr, before = layer.w_scale_swizzled.data_ptr(), layer.w_scale_swizzled.clone()
    with torch.no_grad():
        src[0].weight.mul_(3.0).add_(torch.randn_like(src[0].weight))
    requantize_(q, src)
    assert layer.w_scale_swizzled.data_ptr() == ptr and not torch.equal(layer.w_scale_swizzled, before)
    torch.testing.assert_close(layer.w_scale_swizzled, nvfp4.swizzle_scales(layer.w_scale).view(torch.uint8),
                               rtol=0, atol=0)  # fmt: skip


def test_traced_nvfp4_activation_operands_are_the_references_bits_under_inductor():
    """The traced W4A4 form's activation side (quantize + scale swizzle), compiled by inductor, against the
    eager reference on every input family; its GEMM (cuBLASLt FP4) runs on Blackwell only (test_gpu)."""
    from solrl_engine.quant import nvfp4

    def operands(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, sa, g = nvfp4_activation_operands(x)
        return a.view(torch.uint8), sa.view(torch.uint8), g

    def reference(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = nvfp4.quantize(x)
        return t.qdata, nvfp4.swizzle_scales(t.scale).view(torch.uint8), t.global_scale

    census = Census()
    fn = _compiled(operands, census)
    for shape in [(7, 48), (64, 256)]:
        for name, x in families(shape, seed=5):
            for got, want in zip(fn(x), reference(x), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
    assert len(census.graphs) == 2  # one per shape, no graph breaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0),
                    reason="cuBLASLt's FP4 GEMM needs Blackwell (sm_100+)")  # fmt: skip
def test_compiled_nvfp4_layer_matches_eager_on_blackwell():
    torch.manual_seed(6)
    layer = QuantLinear.from_linear(nn.Linear(256, 128).cuda(), "nvfp4")
    assert layer.choose_kernel()[0] == "cuda"
    census = Census()
    fn = _compiled(layer, census)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = layer(x), fn(x)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert census.traced == 1 and census.opaque == 0


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "need"), [("fp8", (8, 9)), ("int8", (8, 0))])
def test_compiled_8bit_layer_matches_eager_on_a_gpu(fmt, need):
    """On a real GPU the traced quantize is Triton code inductor generated: the same codes as the eager
    kernels up to its division and FMA rounding, so the layer's output agrees to BF16 rounding."""
    if torch.cuda.get_device_capability() < need:
        pytest.skip(f"{fmt} tensor cores need sm_{need[0]}{need[1]}+")
    torch.manual_seed(7)
    block = _norm_then_quantized(fmt).cuda()
    assert block.proj.choose_kernel()[0] == "cuda"
    x, shift, scale = (torch.randn(4, 64, 64, device="cuda"), torch.randn(4, 1, 64, device="cuda"),
                       torch.randn(4, 1, 64, device="cuda"))  # fmt: skip
    census = Census()
    fn = _compiled(block, census)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = block(x, shift, scale), fn(x, shift, scale)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert census.traced == 1 and census.opaque == 0
