"""The graph-captured sampler: eager fallback off-GPU, and (GPU) capture, replay, in-place updates."""

from __future__ import annotations

import pytest
import torch

from solrl_engine.models.tiny import TinyConfig, TinyT2I
from solrl_engine.nn import quantize_model, requantize_
from solrl_engine.quant.recipe import QuantRecipe
from solrl_engine.sampling import GraphedSampler, sample

SMALL = TinyConfig(num_layers=1, heads=2, head_dim=16, text_dim=32, text_layers=1)


def _model(device: str = "cpu") -> TinyT2I:
    torch.manual_seed(0)
    return TinyT2I(SMALL).eval().to(device)


def test_cpu_falls_back_to_the_eager_sampler():
    m = _model()
    cond = m.encode_prompts(["a red circle", "a blue square"] * 3)
    gs = GraphedSampler(m)
    for solver in ("euler", "dpm2"):
        want = sample(m, cond, list(range(6)), steps=4, solver=solver, batch_size=4)
        got = gs.sample(cond, list(range(6)), steps=4, solver=solver, batch_size=4)
        assert torch.equal(got, want)
    uncond = m.encode_prompts([""])
    want = sample(m, cond, list(range(6)), steps=3, guidance_scale=2.0, uncond=uncond)
    assert torch.equal(gs.sample(cond, list(range(6)), steps=3, guidance_scale=2.0, uncond=uncond), want)
    assert gs.stats.captures == 0


def test_skip_max_dim_is_sol_rls_layer_rule():
    """Layers no wider than skip_max_dim stay in high precision; wider ones (the MLPs) quantize."""
    m = _model()
    rep = quantize_model(m.transformer, QuantRecipe("nvfp4", skip_max_dim=32, min_dim=16))
    assert rep.quantized and all(".ff" in n for n in rep.quantized)
    assert any("skip_max_dim" in why for why in rep.skipped.values())


@pytest.mark.gpu
@pytest.mark.parametrize("solver", ["euler", "dpm2"])
def test_graph_replay_matches_eager_and_sees_in_place_requantize(solver):
    m = _model("cuda")
    q = _model("cuda")
    quantize_model(q.transformer, "nvfp4")
    cond = m.encode_prompts(["a red circle", "a green triangle", "a blue square"]).to("cuda")
    seeds = [11, 12, 13]
    gs = GraphedSampler(m, compile=False)
    want = sample(m, cond, seeds, steps=4, solver=solver, transformer=q.transformer, batch_size=2)
    got = gs.sample(cond, seeds, steps=4, solver=solver, transformer=q.transformer, batch_size=2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the ragged last chunk (1 of batch 2) has a graph of its own size: no padded rows computed
    assert gs.stats.captures == 2 and gs.stats.replays == 2
    assert sorted(len(g.x) for g in gs._graphs.values()) == [1, 2]
    # an update written in place must show in the next replay, with no new capture
    with torch.no_grad():
        for p in m.transformer.parameters():
            p.mul_(1.01)
    requantize_(q.transformer, m.transformer)
    want2 = sample(m, cond, seeds, steps=4, solver=solver, transformer=q.transformer, batch_size=2)
    got2 = gs.sample(cond, seeds, steps=4, solver=solver, transformer=q.transformer, batch_size=2)
    assert not torch.allclose(want2, want)
    torch.testing.assert_close(got2, want2, rtol=1e-4, atol=1e-4)
    assert gs.stats.captures == 2


@pytest.mark.gpu
def test_compiled_graph_sampler_is_close_to_eager():
    m = _model("cuda")
    cond = m.encode_prompts(["a red circle"] * 4).to("cuda")
    gs = GraphedSampler(m, compile=True)
    want = sample(m, cond, [0, 1, 2, 3], steps=3)
    got = gs.sample(cond, [0, 1, 2, 3], steps=3)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_quantized_model_compiles_without_graph_breaks():
    """The quantized linears are custom ops: torch.compile(fullgraph=True) takes a quantized model
    whole, matches eager, and sees in-place requantize_ without recompiling."""
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    new = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    quantize_model(m, QuantRecipe("nvfp4", skip=()))
    x = torch.randn(5, 64)
    cm = torch.compile(m, fullgraph=True)
    torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-6)
    before = m(x)
    requantize_(m, new)
    assert not torch.allclose(m(x), before)
    torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_graph_owns_what_it_reads_and_replays_guidance():
    """The schedule and the unconditional embedding live as long as the graph: churn the allocator
    after capture, change `uncond`, and replays still match eager sampling."""
    m = _model("cuda")
    cond = m.encode_prompts(["a red circle", "a blue square"]).to("cuda")
    u1 = m.encode_prompts([""]).to("cuda")
    gs = GraphedSampler(m, compile=False)
    gs.sample(cond, [1, 2], steps=4, solver="dpm2", guidance_scale=3.0, uncond=u1)
    junk = [torch.full((k % 7 + 1,), float(k), device="cuda") for k in range(2000)]  # reuse freed blocks
    u2 = m.encode_prompts(["a green triangle"]).to("cuda")
    for u in (u1, u2):
        want = sample(m, cond, [1, 2], steps=4, solver="dpm2", guidance_scale=3.0, uncond=u)
        got = gs.sample(cond, [1, 2], steps=4, solver="dpm2", guidance_scale=3.0, uncond=u)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert gs.stats.captures == 1 and len(junk) == 2000
    with pytest.raises(ValueError, match="uncond"):
        gs.sample(cond, [1, 2], steps=4, guidance_scale=3.0)


def test_graph_sampler_needs_a_warmup():
    with pytest.raises(ValueError, match="warmup"):
        GraphedSampler(_model(), warmup=0)
