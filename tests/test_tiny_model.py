"""The bundled tiny model: shipped weights, determinism, seeded sampling, save/load, quantization."""

from __future__ import annotations

import pytest
import torch

from solrl_engine.data import shapes as world
from solrl_engine.evaluation import generate
from solrl_engine.models import load_model
from solrl_engine.models.tiny import TinyConfig, TinyT2I, load_tiny
from solrl_engine.nn import quantize_model
from solrl_engine.rewards import load_reward
from solrl_engine.sampling import sample, seeded_noise, sigma_schedule

SMALL = TinyConfig(num_layers=1, heads=2, head_dim=16, text_dim=32, text_layers=1)


def test_shipped_weights_load_offline_and_sample_sensible_images(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model("tiny")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    prompts = world.prompts("heldout")[:24]
    images = generate(model, prompts, list(range(24)), steps=10)
    assert images.shape == (24, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    r = load_reward("shapes")(images, prompts)
    assert r.mean().item() > 0.15  # the model card says 0.28 on all 64 x 4; a random model scores 0.02


def test_forward_is_deterministic_for_a_seed():
    torch.manual_seed(0)
    m = TinyT2I(SMALL).eval()
    cond = m.encode_prompts(["a red circle", "a blue square above a green circle"])
    a = sample(m, cond, [3, 4], steps=3)
    b = sample(m, cond, [3, 4], steps=3)
    assert torch.equal(a, b)
    torch.manual_seed(1)
    m2 = TinyT2I(SMALL).eval()
    m2.load_state_dict(m.state_dict())
    assert torch.equal(sample(m2, cond, [3, 4], steps=3), a)


def test_seeded_noise_is_the_same_whatever_the_batch():
    full = seeded_noise([5, 6, 7, 8], (3, 8, 8))
    assert torch.equal(seeded_noise([7], (3, 8, 8))[0], full[2])
    assert torch.equal(seeded_noise([8, 5], (3, 8, 8), dtype=torch.bfloat16), full[[3, 0]].bfloat16())
    assert not torch.equal(full[0], full[1])


def test_sampler_chunking_does_not_change_results():
    torch.manual_seed(0)
    m = TinyT2I(SMALL).eval()
    cond = m.encode_prompts(["a red circle"] * 4)
    a = sample(m, cond, [0, 1, 2, 3], steps=2)
    b = sample(m, cond, [0, 1, 2, 3], steps=2, batch_size=3)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sigma_schedule_and_its_errors():
    s = sigma_schedule(4)
    assert s.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    shifted = sigma_schedule(4, shift=3.0)
    assert shifted[0] == 1 and shifted[-1] == 0 and (shifted[1:-1] > s[1:-1]).all()
    with pytest.raises(ValueError):
        sigma_schedule(0)


def test_save_and_load_roundtrip(tmp_path):
    torch.manual_seed(0)
    m = TinyT2I(SMALL).eval()
    m.save(tmp_path)
    m2 = load_tiny(tmp_path)
    assert m2.config == SMALL
    for (k, v), (k2, v2) in zip(m.state_dict().items(), m2.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    with pytest.raises(FileNotFoundError, match="pretrain-tiny"):
        load_tiny(tmp_path / "nowhere")


def test_unknown_words_are_a_clear_error():
    m = TinyT2I(SMALL)
    with pytest.raises(ValueError, match="does not know.*hexagon"):
        m.encode_prompts(["a red hexagon"])


def test_the_tiny_transformer_quantizes_like_sd3():
    torch.manual_seed(0)
    m = TinyT2I().eval()
    report = quantize_model(m.transformer, "nvfp4")
    assert len(report.quantized) >= 6 * 6  # q, k, v, out, ff in every block
    assert "proj_out" in report.skipped
    cond = m.encode_prompts(["a red circle"])
    x = sample(m, cond, [0], steps=2)
    assert torch.isfinite(x).all()
