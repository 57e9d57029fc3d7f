"""The family adapters' random-weight mode (model_path="random", for benchmarks), with tiny
architecture overrides built here; the published configs' sizes checked on the meta device."""

from __future__ import annotations

import pytest
import torch

from solrl_engine.models import ARCH_ALIASES, load_model, model_spec
from solrl_engine.nn import quantize_model
from solrl_engine.sampling import sample

TINY = {
    "sd3": dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                caption_projection_dim=32, pooled_projection_dim=32, sample_size=8, pos_embed_max_size=16),
    "flux": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "sana": dict(num_attention_heads=2, attention_head_dim=16, num_layers=1, num_cross_attention_heads=2,
                 cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32, sample_size=4),
    "qwenimage": dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                      axes_dims_rope=(4, 6, 6)),
}  # fmt: skip
RES = {"sd3": 64, "flux": 64, "sana": 128, "qwenimage": 64}


@pytest.mark.parametrize("name", sorted(TINY))
def test_random_mode_samples_quantizes_and_decodes(name):
    torch.manual_seed(0)
    m = load_model(name, "random", dtype=torch.float32, resolution=RES[name], arch=TINY[name])
    cond = m.encode_prompts(["a red circle", "a blue square"])
    assert torch.equal(cond.hidden[0], m.encode_prompts(["a red circle"]).hidden[0])  # deterministic per prompt
    x = sample(m, cond, [1, 2], steps=2, solver="dpm2")
    assert x.shape == (2, *m.latent_shape) and torch.isfinite(x).all()
    img = m.decode(x)
    assert img.shape == (2, 3, 32, 32) and 0 <= img.min() and img.max() <= 1
    rep = quantize_model(m.transformer, "nvfp4")
    assert rep.quantized  # the DiT linears go to NVFP4
    assert torch.isfinite(sample(m, cond, [1, 2], steps=2)).all()


def test_published_configs_have_the_published_sizes():
    """Parameter counts of the full configs, built on the meta device (no memory)."""
    import diffusers

    # Qwen-Image: "20B" (its model card), its published config counts 20,430,401,088; SANA-Video "2B": 2,056,862,144;
    # Z-Image "6B": 6,154,908,736; FLUX.2 [klein] "4B": 3,875,544,576; Wan2.1-I2V-14B: 16,394,878,784 (the T2V 14B
    # and the image cross-attention); Qwen-Image-Edit (and -2509) is Qwen-Image's transformer
    want = {"sd35-large": (7.8e9, 8.4e9), "flux-dev": (11.5e9, 12.2e9), "sana-1.6b": (1.5e9, 1.7e9),
            "wan2.1-1.3b": (1.3e9, 1.5e9), "wan2.1-14b": (13.5e9, 14.8e9), "wan2.2-5b": (4.8e9, 5.2e9),
            "qwen-image": (20.3e9, 20.6e9), "qwen-image-edit": (20.3e9, 20.6e9),
            "qwen-image-edit-2509": (20.3e9, 20.6e9), "sana-video-2b": (2.0e9, 2.1e9), "z-image": (6.1e9, 6.2e9),
            "flux2-klein-4b": (3.8e9, 4.0e9), "wan2.1-i2v-14b": (16.3e9, 16.5e9)}  # fmt: skip
    aliases = {**ARCH_ALIASES, "wan2.2-5b": "wan"}  # the 5B has a config (ALIAS_CONFIGS) but no speed-model row
    for alias, family in aliases.items():
        adapter = model_spec(family).adapter_object()
        config = {**adapter.FULL_CONFIG, **getattr(adapter, "ALIAS_CONFIGS", {}).get(alias, {})}
        with torch.device("meta"):
            net = getattr(diffusers, adapter.TRANSFORMER_CLASS)(**config)
        n = sum(p.numel() for p in net.parameters())
        lo, hi = want[alias]
        assert lo <= n <= hi, (alias, n)
    assert set(want) == set(aliases)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="available"):
        model_spec("sdxl")
    with pytest.raises(ValueError, match="available"):
        load_model("sdxl")


@pytest.mark.parametrize("name", ["flux", "sana"])
def test_random_vae_is_the_published_class_at_its_published_size_and_decodes_at_full_resolution(name):
    """model_path="random+vae": the family's published VAE (class and config; its parameter count is the model
    spec's published size) decodes through the real path: images at the model's resolution, not the stand-in's
    32 x 32. A family that declares no published VAE says so and names the stand-in mode."""
    torch.manual_seed(0)
    m = load_model(name, "random+vae", dtype=torch.float32, resolution=RES[name], arch=TINY[name])
    vae = m.pipe.vae
    assert type(vae).__name__ == m.RANDOM_VAE_CONFIG[0]
    assert sum(p.numel() for p in vae.parameters()) / 1e9 == pytest.approx(model_spec(name).vae_params_b, rel=0.01)
    img = m.decode(torch.randn(1, *m.latent_shape))
    assert img.shape == (1, 3, RES[name], RES[name]) and 0 <= img.min() and img.max() <= 1
    with pytest.raises(ValueError, match="declares no published VAE.*model_path='random'"):
        load_model("qwenimage", "random+vae", dtype=torch.float32, resolution=RES["qwenimage"], arch=TINY["qwenimage"])
