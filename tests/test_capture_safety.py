"""What the rollouts and the GPU session capture in CUDA graphs holds nothing a capture cannot: no host sync,
no host tensor, no host-to-device copy. Rehearsed on the CPU with the meta device standing for the GPU
(solrl_engine.sampling.capture.CaptureGuard), for the real SD3.5 / FLUX.1 / SANA classes and the bundled model,
BF16 and their FP8 / INT8 explore copies (at a simulated sm_90, so the copies' GPU GEMM path is what runs)."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from bench_scripts import load_bench

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models.tiny.model import load_tiny
from solrl_engine.nn import fast_path, reset_fast_path
from solrl_engine.sampling.capture import CaptureGuard, CaptureViolation, check_capture, rehearse_capture
from solrl_engine.sampling.graphed import GraphedSampler

META = torch.device("meta")


def _meta(v):
    return v.to(META) if isinstance(v, torch.Tensor) else v.map(lambda a: a.to(META))


@pytest.fixture(scope="module")
def session():
    """bench/session_common.py: the GPU session's models, inputs and timed forward."""
    return load_bench("session_common")


# --- the guard catches what a capture cannot hold (each a positive control) ------------------------------


def test_the_guard_names_a_host_sync_and_its_line():
    x = torch.ones(4, device=META)
    found = rehearse_capture(lambda: x.sum().item())
    assert [v.kind for v in found] == ["host sync"] and found[0].op == "aten::_local_scalar_dense"
    assert "test_capture_safety.py" in found[0].where


def test_the_guard_catches_nonzero_a_host_tensor_and_a_host_copy():
    x = torch.ones(4, device=META)
    host = torch.tensor(0.5)
    assert [v.kind for v in rehearse_capture(lambda: x.nonzero())] == ["host sync"]
    assert [v.kind for v in rehearse_capture(lambda: x * host)] == ["host tensor"]
    assert [v.kind for v in rehearse_capture(lambda: x * host.to(META))] == ["host-to-device copy"]
    made_inside = rehearse_capture(lambda: x + torch.arange(4))  # a CPU tensor created inside the region
    assert [v.kind for v in made_inside] == ["host tensor"] and "shape (4,)" in made_inside[0].detail
    assert rehearse_capture(lambda: (x * 2 + x.float().mean()).clamp(0, 1)) == []  # device-only ops pass


def test_check_capture_lists_every_violation():
    x = torch.ones(4, device=META)
    a, b = torch.ones(4), torch.ones(4)
    with pytest.raises(CaptureViolation, match="cannot be captured") as e:
        check_capture(lambda: x * a + x * b, META, "the region")
    assert str(e.value).count("host tensor: aten::mul") == 2


def test_the_guard_runs_a_region_on_its_device_without_kernels():
    with CaptureGuard(META) as g:
        y = torch.ones(3, device=META) @ torch.ones(3, 5, device=META)
    assert y.device == META and y.shape == (5,) and g.violations == []


# --- the GPU session's timed forward, captured by graphed_ms ---------------------------------------------


@pytest.mark.parametrize("alias", ["sana-1.6b", "flux-dev", "sd35-large"])
def test_the_sessions_captured_forward_reads_only_device_tensors(alias, session, monkeypatch):
    """What gpu_session.graphed_ms captures: forward_fn of forward_inputs through BF16 and each 8-bit explore
    copy. The flow time used to be a CPU tensor moved to the GPU inside the capture."""
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    model = session.build_model(alias, torch.device("cpu"), session.TINY[alias], session.TINY_RES[alias])
    inputs = session.predict.forward_inputs(model, 2, device=META, dtype=torch.bfloat16)
    for fmt in ("bf16", "fp8", "int8"):
        net = model.transformer if fmt == "bf16" else ExploreCopy(model.transformer, fmt).transformer
        net = deepcopy(net).to(META)
        reset_fast_path(net)
        found = rehearse_capture(session.forward_fn(model, net, inputs, META), META)
        assert found == [], f"{alias} {fmt}: " + "; ".join(map(str, found))
        if fmt != "bf16":  # the copy's GPU GEMMs are what ran, on the meta device
            rec = fast_path(net)
            assert rec.layers and not rec.reference, rec.summary()


# --- the rollouts' sampler: the loop GraphedSampler captures ---------------------------------------------


@pytest.mark.parametrize("fmt", ["policy", "fp8", "int8"])
def test_the_samplers_captured_loop_reads_only_device_tensors(fmt, monkeypatch):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    model = load_tiny()
    cond = model.encode_prompts(["a red circle", "a blue square"])
    net = None if fmt == "policy" else ExploreCopy(model.transformer, fmt).transformer.to(META)
    model.transformer.to(META)
    sampler = GraphedSampler(model, compile=False)
    for solver in ("euler", "dpm2"):
        found = sampler.rehearse(_meta(cond), [0, 1], steps=3, solver=solver, dtype=torch.bfloat16, transformer=net)
        assert found == [], f"{fmt} {solver}: " + "; ".join(map(str, found))


@pytest.mark.parametrize("fmt", ["policy", "fp8"])
def test_the_update_predictions_captured_call_reads_only_device_tensors(fmt, monkeypatch):
    """GraphedSampler.predict's captured region (one velocity call at rows of their own flow times): the update's
    fixed predictions, graph-captured on a GPU."""
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    model = load_tiny()
    cond = model.encode_prompts(["a red circle", "a blue square", "a green triangle"])
    net = None if fmt == "policy" else ExploreCopy(model.transformer, fmt).transformer.to(META)
    model.transformer.to(META)
    sampler = GraphedSampler(model, compile=False)
    x = torch.randn(3, *model.latent_shape, device=META, dtype=torch.bfloat16)
    t = torch.rand(3, device=META)
    found = sampler.rehearse_predict(x, t, _meta(cond), transformer=net)
    assert found == [], "; ".join(map(str, found))
    bad = sampler.rehearse_predict(x, torch.rand(3), _meta(cond), transformer=net)  # flow times left on the host
    assert bad and bad[0].kind in ("host tensor", "host-to-device copy")
