"""quantize_model / requantize_ / QuantLinear: outputs, reports, in-place refresh, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from solrl_engine.nn import QuantLinear, quantize_model, requantize_
from solrl_engine.quant import QuantRecipe, fp8, nvfp4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time_embed = nn.Linear(64, 64)  # skipped by pattern
        self.attn = nn.Linear(64, 192)
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.odd = nn.Linear(40, 64)  # K not a multiple of 16
        self.small = nn.Linear(64, 8)  # below min_dim
        self.proj_out = nn.Linear(64, 48)  # skipped by pattern

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.time_embed(x) + self.mlp(x)
        return self.proj_out(h + self.attn(x)[..., :64])


def test_report_says_what_was_quantized_and_why_not():
    m = Block()
    report = quantize_model(m, "nvfp4")
    assert sorted(report.quantized) == ["attn", "mlp.0", "mlp.2"]
    sk = report.skipped
    assert "skip pattern" in sk["time_embed"] and "skip pattern" in sk["proj_out"]
    assert "min_dim" in sk["small"]
    assert sk["odd"] == "in_features 40 is not a multiple of 16"
    assert isinstance(m.attn, QuantLinear) and type(m.time_embed) is nn.Linear
    text = str(report)
    assert "3 of 7" in text and "skipped proj_out" in text
    before, after = report.weight_bytes()
    assert after < before / 3


def test_k_not_multiple_of_16_is_skipped_with_reason():
    m = nn.Sequential(nn.Linear(40, 64), nn.Linear(64, 64))
    report = quantize_model(m, QuantRecipe("nvfp4", skip=()))
    assert report.skipped == {"0": "in_features 40 is not a multiple of 16"}
    assert report.quantized == ["1"]
    # FP8 has no block constraint
    m2 = nn.Sequential(nn.Linear(40, 64))
    assert quantize_model(m2, QuantRecipe("fp8", skip=())).quantized == ["0"]


@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_equals_dequantize_then_matmul(act, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(128, 96).to(dtype)
    ql = QuantLinear.from_linear(lin, QuantRecipe("nvfp4", quantize_activations=act))
    x = torch.randn(3, 5, 128, dtype=dtype)
    w = nvfp4.fake_quantize(lin.weight.detach().float())
    xin = nvfp4.fake_quantize(x.float()) if act else x.float()
    want = (xin @ w.t() + lin.bias.detach().float()).to(dtype)
    got = ql(x)
    assert got.dtype == dtype and got.shape == (3, 5, 96)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # and it is close to the unquantized layer (a sanity bound, not the contract)
    rel = (got.float() - lin(x).float()).norm() / lin(x).float().norm()
    assert rel < (0.2 if act else 0.12)


def test_fp8_and_bf16_recipes():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(4, 64)
    q8 = QuantLinear.from_linear(lin, "fp8")
    xq = fp8.quantize_rowwise(x)
    wq = fp8.quantize_rowwise(lin.weight.detach())
    want = xq.dequantize(torch.float32) @ wq.dequantize(torch.float32).t() + lin.bias.detach()
    torch.testing.assert_close(q8(x), want, rtol=1e-5, atol=1e-5)
    q8w = QuantLinear.from_linear(lin, "fp8_weight_only")
    torch.testing.assert_close(q8w(x), x @ wq.dequantize(torch.float32).t() + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    qb = QuantLinear.from_linear(lin, "bf16")
    assert qb.w_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(qb(x), lin(x), rtol=2e-2, atol=2e-2)


def test_requantize_keeps_storage_and_follows_new_weights():
    torch.manual_seed(0)
    policy = Block()
    explore = copy.deepcopy(policy)
    quantize_model(explore, "nvfp4")
    ql = explore.attn
    ptrs = [b.data_ptr() for b in ql.buffers()]
    x = torch.randn(2, 64)
    before = explore(x)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert requantize_(explore, source=policy) == 3
    assert [b.data_ptr() for b in ql.buffers()] == ptrs
    after = explore(x)
    assert not torch.allclose(before, after)
    fresh = copy.deepcopy(policy)
    quantize_model(fresh, "nvfp4")
    torch.testing.assert_close(after, fresh(x), rtol=0, atol=0)


def test_requantize_from_master_weights_and_state_dict():
    torch.manual_seed(0)
    m = Block()
    quantize_model(m, "nvfp4", keep_master=True)
    master = m.mlp[0].master_weight
    with torch.no_grad():
        master.mul_(2.0)
    requantize_(m)
    torch.testing.assert_close(m.mlp[0].weight, nvfp4.fake_quantize(master.detach()))
    sd = {
        f"{n}.weight": torch.ones(lay.out_features, lay.in_features)
        for n, lay in m.named_modules()
        if isinstance(lay, QuantLinear)
    }
    requantize_(m, source=sd)
    assert torch.equal(m.attn.weight, torch.ones(192, 64))


def test_bad_source_is_rejected_and_leaves_the_model_unchanged():
    torch.manual_seed(0)
    m = Block()
    quantize_model(m, "nvfp4")
    snapshot = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="keep_master"):
        requantize_(m)
    bad = {
        "attn.weight": torch.randn(192, 64),
        "mlp.0.weight": torch.randn(256, 64),
        "mlp.2.weight": torch.randn(64, 128),
    }
    with pytest.raises(ValueError, match="mlp.2"):
        requantize_(m, source=bad)
    with pytest.raises(KeyError, match="lacks"):
        requantize_(m, source={"attn.weight": torch.randn(192, 64)})
    with pytest.raises(KeyError, match="lacks"):
        requantize_(m, source=nn.Sequential(nn.Linear(64, 64)))
    for k, v in m.state_dict().items():
        assert torch.equal(
            v.view(torch.uint8) if v.element_size() == 1 else v,
            snapshot[k].view(torch.uint8) if v.element_size() == 1 else snapshot[k],
        ), k


def test_bad_arguments_have_clear_errors():
    with pytest.raises(ValueError, match="unknown recipe"):
        quantize_model(Block(), "int3")
    with pytest.raises(TypeError, match="Sequential"):
        quantize_model(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="unknown quantization format"):
        QuantRecipe("int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantLinear(40, 64, recipe="nvfp4")


def test_state_dict_roundtrip_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    m = Block()
    quantize_model(m, "nvfp4")
    save_file(m.state_dict(), tmp_path / "q.safetensors")
    m2 = Block()
    quantize_model(m2, "nvfp4")
    m2.load_state_dict(load_file(tmp_path / "q.safetensors"))
    x = torch.randn(3, 64)
    assert torch.equal(m(x), m2(x))


def test_quantize_a_diffusers_sd3_transformer_from_a_tiny_config():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
    ).eval()
    ref = copy.deepcopy(model)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8),
        encoder_hidden_states=torch.randn(2, 5, 32),
        pooled_projections=torch.randn(2, 16),
        timestep=torch.tensor([500.0, 20.0]),
    )
    report = quantize_model(model, "nvfp4")
    assert any(".attn.to_q" in n for n in report.quantized)
    assert any(".ff.net" in n for n in report.quantized)
    skipped = report.skipped
    assert any("time_text_embed" in n for n in skipped) and "proj_out" in skipped
    assert any(n.endswith("norm1.linear") for n in skipped)
    with torch.no_grad():
        out = model(**inputs).sample
        want = ref(**inputs).sample
    assert out.shape == want.shape and torch.isfinite(out).all()
    rel = (out - want).norm() / want.norm()
    assert 0 < rel < 0.3
    # refreshing from the BF16 model restores exactly the same quantized weights
    assert requantize_(model, source=ref) == len(report.quantized)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, out)


def test_the_hardware_plan_follows_the_tensor_cores(monkeypatch):
    from solrl_engine.explore.choice import formats_with_tensor_cores, hardware_plan

    assert hardware_plan("cpu") == "nvfp4"  # CPU: emulated NVFP4 (a fidelity study's proxy)
    for sm, want in (("90", "fp8"), ("89", "fp8"), ("80", "int8"), ("86", "int8"), ("75", "nvfp4"), ("100", "nvfp4"),
                     ("120", "nvfp4")):  # fmt: skip
        monkeypatch.setenv("SOLRL_SIMULATE_SM", sm)
        assert hardware_plan("cpu") == want, sm  # a simulated GPU is that GPU
    assert formats_with_tensor_cores((9, 0)) == ("fp8", "int8") and formats_with_tensor_cores(None) == ()


def test_te_explore_says_what_to_install_when_unavailable():
    from solrl_engine.nn import te

    reason = te.te_unavailable_reason()
    if reason is None:
        pytest.skip("Transformer Engine is usable here; the GPU tests cover it")
    assert "transformer" in reason.lower() or "cuda" in reason.lower()
    with pytest.raises(RuntimeError, match="te_nvfp4"):
        te.to_te_(nn.Sequential(nn.Linear(64, 64)))
