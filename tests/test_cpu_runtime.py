"""The CPU runtime choices (solrl_engine.hw): BF16 where the CPU has BF16 units, inductor where there is
a C++ compiler, and an automatic explore precision that is never slower than the policy's. Each
decision is fed its facts, so both branches run on any machine."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from torch import nn

from solrl_engine import hw
from solrl_engine.explore import choice
from solrl_engine.models.tiny import TinyConfig, TinyT2I
from solrl_engine.rl.config import RLConfig, autocast_for, resolve_policy_dtype, resolve_runtime
from solrl_engine.sampling import GraphedSampler, sample

SMALL = TinyConfig(num_layers=1, heads=2, head_dim=16, text_dim=32, text_layers=1)
AVX512_BF16 = {"fpu", "avx2", "avx512f", "avx512_bf16"}


def _model() -> TinyT2I:
    torch.manual_seed(0)
    return TinyT2I(SMALL).eval()


# --- BF16 on the CPU ------------------------------------------------------------------------------


def test_cpu_flags_reads_the_flags_line():
    text = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\nbogomips\t: 4000\n"
    assert hw.cpu_flags(text) == {"fpu", "sse2", "avx512f", "avx512_bf16", "amx_tile"}
    assert hw.cpu_flags("processor : 0\n") == frozenset()


@pytest.mark.parametrize(
    ("flags", "capability", "machine", "onednn", "native", "unit"),
    [
        (AVX512_BF16, "AVX512", "x86_64", True, True, "AVX512-BF16"),
        (AVX512_BF16 | {"amx_bf16"}, "AVX512", "x86_64", True, True, "AMX-BF16"),
        ({"avx2", "avx512f"}, "AVX512", "x86_64", True, False, ""),  # AVX512 without BF16: emulated
        (AVX512_BF16, "AVX2", "x86_64", True, False, "AVX512-BF16"),  # ATEN_CPU_CAPABILITY lowered
        (AVX512_BF16, "AVX512", "x86_64", False, False, "AVX512-BF16"),  # no oneDNN for the GEMMs
        (AVX512_BF16, "DEFAULT", "aarch64", True, False, ""),  # not x86
    ],
)
def test_cpu_bf16_detection(flags, capability, machine, onednn, native, unit):
    info = hw.cpu_bf16(flags, capability, machine, onednn)
    assert (info.native, info.unit) == (native, unit) and info.reason
    dtype, why = hw.auto_policy_dtype("cpu", info)
    assert dtype == (torch.bfloat16 if native else torch.float32) and why == info.reason


def test_policy_dtype_auto_follows_the_cpu_and_set_values_pass_through(monkeypatch):
    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(hw, "cpu_bf16", lambda native=native: hw.CpuBF16(native, "", "stub"))
        want = torch.bfloat16 if native else torch.float32
        assert resolve_runtime(RLConfig(device="cpu")) == (cpu, want)
        assert resolve_policy_dtype(RLConfig(device="cpu"), cpu) == (want, "stub")
        assert resolve_runtime(RLConfig(device="cpu", policy_dtype="float32"))[1] == torch.float32
        assert resolve_runtime(RLConfig(device="cpu", policy_dtype="bfloat16"))[1] == torch.bfloat16
    assert hw.auto_policy_dtype("cuda")[0] == torch.bfloat16


def test_cpu_autocast_only_for_a_bf16_policy():
    cpu = torch.device("cpu")
    with autocast_for(cpu, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast_for(cpu, torch.float32):
        assert not torch.is_autocast_enabled("cpu")  # an FP32 policy keeps exact FP32 numerics
    with autocast_for(cpu):
        assert not torch.is_autocast_enabled("cpu")


def test_bf16_policy_keeps_lora_and_its_gradients_in_fp32():
    """The GPU path on the CPU: BF16 base, FP32 LoRA (the trainer's cast), BF16 autocast."""
    from solrl_engine.models import model_spec
    from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters

    m = _model().to(torch.bfloat16).requires_grad_(False)
    ad = LoraAdapters(m.transformer, 4, 8, model_spec("tiny").lora_targets)
    for p in ad.params(TRAIN) + ad.params(OLD):
        p.data = p.data.float()
    cond = m.encode_prompts(["a red circle", "a blue square"])
    x = torch.randn(2, 3, 32, 32).bfloat16()
    with autocast_for(torch.device("cpu"), torch.bfloat16):
        v = m.velocity(x, torch.full((2,), 0.5), cond).float()
    v.square().mean().backward()
    ps = ad.params(TRAIN)
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in ps)
    assert all(p.dtype == torch.bfloat16 for n, p in m.transformer.named_parameters() if "lora_" not in n)


def test_a_bf16_model_called_with_fp32_latents_outside_autocast_computes_in_bf16():
    """A user's own code (or a test) calling a BF16 policy with FP32 latents and no autocast: the model
    casts them to its dtype, as a stock diffusers pipeline does, instead of failing in the patch
    embedding's conv ("Input type (float) and bias type (c10::BFloat16) should be the same")."""
    from solrl_engine.nn import quantize_model
    from solrl_engine.quant.recipe import get_recipe

    m = _model()
    prompts = ["a red circle", "a blue square"]
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        want = m.velocity(x, t, m.encode_prompts(prompts))
        m16 = m.to(torch.bfloat16)
        cond = m16.encode_prompts(prompts)
        got = m16.velocity(x, t, cond)
        assert got.dtype == torch.bfloat16 and torch.equal(got, m16.velocity(x.bfloat16(), t, cond))
        assert (got.float() - want).norm() / want.norm() < 0.05  # BF16 rounding only
        # the quantized explore copy of a BF16 policy, swapped in, takes FP32 latents the same way
        q = copy.deepcopy(m16.transformer)
        recipe = get_recipe("nvfp4").with_(include=("transformer_blocks.*.ff.*",), min_dim=16)
        assert quantize_model(q, recipe).quantized
        v = m16.velocity(x, t, cond, transformer=q)
        assert v.dtype == torch.bfloat16 and torch.isfinite(v).all()


# --- inductor on the CPU --------------------------------------------------------------------------


def test_cxx_compiler_lookup():
    found = {"g++": "/usr/bin/g++", "mycc": "/opt/mycc"}
    assert hw.cxx_compiler({"CXX": "mycc"}, found.get) == "/opt/mycc"
    assert hw.cxx_compiler({}, found.get) == "/usr/bin/g++"
    assert hw.cxx_compiler({}, lambda _: None) is None
    ok, why = hw.cpu_compile_available(None)
    assert not ok and "C++ compiler" in why


def test_compiled_cpu_sampler_without_a_compiler_samples_eagerly(monkeypatch):
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    m = _model()
    gs = GraphedSampler(m, cpu_compile=True)
    assert not gs.cpu_compile
    cond = m.encode_prompts(["a red circle"] * 2)
    assert torch.equal(gs.sample(cond, [0, 1], steps=2), sample(m, cond, [0, 1], steps=2))


def test_compiled_cpu_sampler_falls_back_when_compilation_fails(monkeypatch, caplog):
    def broken_compile(mod, **_):
        def run(*a, **k):
            raise RuntimeError("inductor: no luck")

        return run

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: "/usr/bin/g++")
    monkeypatch.setattr(torch, "compile", broken_compile)
    m = _model()
    gs = GraphedSampler(m, cpu_compile=True)
    cond = m.encode_prompts(["a red circle"] * 3)
    with caplog.at_level(logging.WARNING, logger="solrl_engine.sampling"):
        got = gs.sample(cond, [0, 1, 2], steps=2, solver="dpm2")
    assert torch.equal(got, sample(m, cond, [0, 1, 2], steps=2, solver="dpm2"))
    assert "torch.compile failed" in caplog.text and gs.stats.compiles == 0
    assert torch.equal(gs.sample(cond, [0, 1, 2], steps=2, solver="dpm2"), got)  # eager from then on


@pytest.mark.slow
@pytest.mark.skipif(hw.cxx_compiler() is None, reason="inductor on the CPU needs a C++ compiler (g++ or $CXX)")
def test_compiled_cpu_sampler_matches_eager_and_compiles_once_per_shape():
    m = _model()
    cond = m.encode_prompts(["a red circle", "a blue square"] * 2)
    gs = GraphedSampler(m, cpu_compile=True)
    got = gs.sample(cond, list(range(4)), steps=3, solver="dpm2")
    want = sample(m, cond, list(range(4)), steps=3, solver="dpm2")
    assert torch.allclose(got, want, atol=1e-4)
    assert gs.stats.compiles == 1 and gs.stats.compile_s[0] > 0 and gs.stats.overhead_s == gs.stats.compile_s[0]
    again = gs.sample(cond, list(range(4)), steps=2, solver="euler")  # same shapes: no new compile
    assert gs.stats.compiles == 1
    assert torch.allclose(again, sample(m, cond, list(range(4)), steps=2, solver="euler"), atol=1e-4)
    with torch.no_grad():  # in-place weight updates are seen without a recompile
        m.transformer.proj_out.weight.mul_(0.5)
    assert torch.allclose(gs.sample(cond, list(range(4)), steps=2), sample(m, cond, list(range(4)), steps=2), atol=1e-4)
    assert gs.stats.compiles == 1


# --- explore_precision=auto -----------------------------------------------------------------------


def test_auto_explore_never_picks_a_slower_precision():
    # emulated NVFP4 (and every other format) slower than the policy: explore at the policy's precision
    slow = {"policy": 10.0, "nvfp4": 60.0, "nvfp4_weight_only": 30.0, "fp8": 25.0, "fp8_weight_only": 12.0}
    ch = choice.choose_explore_precision(slow)
    assert ch.precision == choice.POLICY and "no quantized precision is faster" in ch.reason
    assert "nvfp4 6.00x" in ch.reason
    # only FP8 weight-only is faster: that one, not the cheaper but slower NVFP4
    ch = choice.choose_explore_precision({**slow, "fp8_weight_only": 6.0})
    assert ch.precision == "fp8_weight_only" and "1.67x faster" in ch.reason
    # several faster: the fastest of them
    assert choice.choose_explore_precision({**slow, "nvfp4": 4.0, "fp8": 5.0}).precision == "nvfp4"
    assert choice.choose_explore_precision({**slow, "nvfp4": 5.0, "fp8": 4.0}).precision == "fp8"
    # within the margin is not faster
    assert choice.choose_explore_precision({**slow, "fp8": 9.8}).precision == choice.POLICY
    rng = random.Random(0)
    for _ in range(200):
        t = {k: rng.uniform(1, 20) for k in ("policy", *choice.EXPLORE_CANDIDATES)}
        ch = choice.choose_explore_precision(t)
        assert ch.precision == choice.POLICY or t[ch.precision] < t["policy"]
        faster = [k for k in choice.EXPLORE_CANDIDATES if t[k] <= 0.95 * t["policy"]]
        assert ch.precision == (min(faster, key=t.__getitem__) if faster else choice.POLICY)
    with pytest.raises(ValueError, match="policy"):
        choice.choose_explore_precision({"nvfp4": 1.0})


def test_resolve_explore_precision_passes_set_values_and_times_the_model_on_cpu():
    assert choice.resolve_explore_precision("nvfp4", "cpu", torch.float32).precision == "nvfp4"
    stub = {"policy": 1.0, "nvfp4": 3.0, "fp8": 0.5}
    assert choice.resolve_explore_precision("auto", "cpu", torch.float32, timings_ms=stub).precision == "fp8"
    m = _model()
    rule = {"include": ("transformer_blocks.*.ff.*",), "min_dim": 16}
    shapes = choice.explore_layer_shapes(m.transformer, rule)
    assert shapes and all(c >= 1 for c in shapes.values())
    state = torch.random.get_rng_state()
    t = choice.probe_explore_timings(shapes, rule, torch.float32, rows=64, reps=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's RNG stream is untouched
    assert set(t) == {"policy", *choice.EXPLORE_CANDIDATES} and all(v > 0 for v in t.values())
    assert choice.probe_explore_timings(shapes, rule, torch.float32, rows=64, reps=1) == t  # cached
    ch = choice.resolve_explore_precision("auto", "cpu", torch.float32, m.transformer, rule)
    assert ch.precision in (choice.POLICY, *choice.EXPLORE_CANDIDATES) and ch.timings_ms
    none = choice.resolve_explore_precision("auto", "cpu", torch.float32, m.transformer, {"include": ("nothing.*",)})
    assert none.precision == choice.POLICY and "no layer" in none.reason


def test_the_plan_builds_the_explore_copy_the_timings_choose(tmp_path, monkeypatch, caplog):
    from solrl_engine.rl.runtime import build_rollouts, explorer_for

    _model().save(tmp_path / "m")
    cfg = RLConfig(model="tiny", model_path=str(tmp_path / "m"), device="cpu", policy_dtype="float32",
                   explore_rht=16, explore_skip_max_dim=0)  # fmt: skip
    monkeypatch.setattr(choice, "probe_explore_timings", lambda *a, **k: {"policy": 1.0, "nvfp4": 5.0, "fp8": 0.5})
    with caplog.at_level(logging.INFO, logger="solrl_engine"):
        ex = explorer_for(cfg)
    assert ex.copy.recipe == "fp8" and ex.spec.precision == "fp8" and ex.spec.dropped == ("rht",)
    assert "explore precision fp8" in caplog.text and "explore_rht apply to NVFP4 only" in caplog.text
    monkeypatch.setattr(choice, "probe_explore_timings", lambda *a, **k: {"policy": 1.0, "nvfp4": 5.0, "fp8": 2.0})
    ex = explorer_for(cfg)  # nothing faster than the policy: no copy, the policy explores itself
    assert ex.copy is None and ex.spec.precision == choice.POLICY and not ex.spec.quantized
    assert ex.recipe_label == "policy (float32)"
    explicit = explorer_for(RLConfig(**{**cfg.__dict__, "explore_precision": "nvfp4"}))
    assert explicit.copy.recipe == "nvfp4+rht16" and explicit.spec.dropped == ()  # still selectable explicitly
    # compile settings reach the sampler: regional compilation defaults off on a CPU, and the keys override
    ro = ex.rollouts
    assert ro.sampler.regional is False and ro.sampler.mode is None and ro.sampler.blocks == ("JointTransformerBlock",
                                                                                              "SD3SingleTransformerBlock")
    tuned = build_rollouts(RLConfig(**{**cfg.__dict__, "compile_regional": True,
                                       "compile_mode": "max-autotune-no-cudagraphs"}))  # fmt: skip
    assert tuned.sampler.regional is True and tuned.sampler.mode == "max-autotune-no-cudagraphs"


def test_every_rank_takes_rank_zeros_explore_choice(tmp_path, monkeypatch):
    """Under torchrun each rank times the candidates itself; the copy must be the same on all of them."""
    from solrl_engine.rl.runtime import explorer_for

    _model().save(tmp_path / "m")
    cfg = RLConfig(model="tiny", model_path=str(tmp_path / "m"), device="cpu", policy_dtype="float32")
    monkeypatch.setattr(choice, "probe_explore_timings", lambda *a, **k: {"policy": 1.0, "nvfp4": 5.0, "fp8": 5.0})

    class RankZeroSaysFP8:
        def broadcast_object(self, obj):
            assert isinstance(obj, choice.ExploreChoice) and obj.precision == choice.POLICY  # this rank's own choice
            return choice.ExploreChoice("fp8", "rank 0's timings")

    ex = explorer_for(cfg, agree=RankZeroSaysFP8().broadcast_object)
    assert ex.copy is not None and ex.copy.recipe == "fp8" and ex.spec.reason == "rank 0's timings"


def test_a_burst_of_load_while_the_policy_is_timed_does_not_pick_a_slower_candidate(monkeypatch):
    """The policy is timed again after the candidates and each layer keeps its fastest call: load on the
    machine only adds time, so a policy pass slowed 4x by other work must not lose to a 2.8x slower
    candidate (what a loaded machine did to `auto` before)."""
    true_ms = {"policy": 1.0, "fp8_weight_only": 2.8}
    state = {"policy_passes": 0}

    def fake_call_ms(fn, dev):
        mod = fn.__defaults__[0]
        name = "policy" if isinstance(mod, nn.Linear) else mod.recipe.name
        if name == "policy" and state["policy_passes"] < 2:  # warm-up and the first timed pass, under load
            state["policy_passes"] += 1
            return 4.0 * true_ms[name]
        return true_ms[name]

    choice._PROBE_CACHE.clear()
    monkeypatch.setattr(choice, "_call_ms", fake_call_ms)
    t = choice.probe_explore_timings({(64, 64): 1}, {}, torch.float32, rows=16, reps=1, candidates=["fp8_weight_only"])
    assert t == {"policy": 1.0, "fp8_weight_only": 2.8}
    picked = choice.resolve_explore_precision("auto", "cpu", torch.float32, timings_ms=t)
    assert picked.precision == choice.POLICY
    choice._PROBE_CACHE.clear()
