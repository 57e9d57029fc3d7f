"""NVIDIA ModelOpt's NVFP4 against ours (the TE recipe): equal where the recipes agree, and each
documented difference pinned on a hand-made input (solrl_engine/quant/modelopt_peer.py)."""

import pytest
import torch
from torch import nn

pytest.importorskip("modelopt.torch.quantization.qtensor", reason="pip install nvidia-modelopt")

from solrl_engine.nn import QuantLinear  # noqa: E402
from solrl_engine.quant import nvfp4  # noqa: E402
from solrl_engine.quant.modelopt_peer import load_modelopt_nvfp4, modelopt_fake_quantize, modelopt_quantize  # noqa: E402


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("kind", ["gaussian", "outliers", "bf16"])
def test_codes_and_block_scales_agree_on_ordinary_data(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g)
    if kind == "outliers":
        x[:, ::50] *= 60
    if kind == "bf16":
        x = x.bfloat16()
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    assert torch.equal(_u8(a.scale), _u8(b.scale))
    # difference 1: the second-level scale is amax / 2688 there, 1 / (2688 / amax) here: <= 1 ulp apart,
    # which moves a value sitting exactly on an E2M1 rounding tie to the neighbouring code (2 in 8192 here)
    assert torch.allclose(a.global_scale, b.global_scale, rtol=2**-23, atol=0)
    differ = a.codes() != b.codes()
    assert differ.float().mean() < 1e-3
    scaled = (x.float().reshape(32, 16, 16) / (b.scale.float() * b.global_scale).unsqueeze(-1)).reshape(32, 256)
    ties = torch.tensor(nvfp4.E2M1_TIES_DOWN + nvfp4.E2M1_TIES_UP)
    assert ((scaled[differ].abs().unsqueeze(-1) - ties).abs().amin(-1) < 1e-5).all()


def test_second_level_scale_is_a_division_there_and_a_reciprocal_here():
    x = torch.randn(4, 64)
    x[0, 0] = 25341.097  # an amax whose two roundings differ
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    amax = x.abs().amax()
    assert a.global_scale == amax / torch.tensor(2688.0)
    assert b.global_scale == 1 / (torch.tensor(2688.0) / amax)
    assert a.global_scale != b.global_scale


def test_tiny_blocks_keep_a_subnormal_scale_there_and_flush_here():
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0  # sets the tensor scale
    x[0, 16:] = 1e-3  # a block whose scale (4.5e-4) rounds below E4M3's smallest subnormal, 2^-9
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    assert a.scale[0, 1].float() == 2**-9 and b.scale[0, 1].float() == 0
    assert (modelopt_fake_quantize(x)[0, 16:] != 0).all() and (nvfp4.fake_quantize(x)[0, 16:] == 0).all()


def test_zero_blocks_get_scale_one_there_and_zero_here():
    x = torch.zeros(2, 32)
    x[1] = torch.randn(32)
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    assert (a.scale[0].float() == 1).all() and (b.scale[0].float() == 0).all()
    assert (modelopt_fake_quantize(x)[0] == 0).all() and (nvfp4.fake_quantize(x)[0] == 0).all()


def test_nonfinite_input_poisons_the_whole_tensor_there_and_its_blocks_here():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    mo, ours = modelopt_fake_quantize(x), nvfp4.fake_quantize(x)
    assert torch.isnan(mo).all()
    assert torch.isnan(ours[0, :16]).all() and torch.isfinite(ours[0, 16:]).all() and torch.isfinite(ours[1]).all()


def test_a_modelopt_checkpoint_loads_into_quant_linear_without_requantizing():
    torch.manual_seed(0)
    lin = nn.Linear(128, 48)
    t = modelopt_quantize(lin.weight.detach())  # what ModelOpt's export writes: weight, weight_scale, weight_scale_2
    q = QuantLinear(128, 48, recipe="nvfp4_weight_only")
    load_modelopt_nvfp4(q, t.qdata, t.scale, t.global_scale)
    want = modelopt_fake_quantize(lin.weight.detach())
    assert torch.equal(q.weight, want)  # ModelOpt's own decode, bit for bit
    x = torch.randn(3, 128)
    assert torch.allclose(q(x), x @ want.T, atol=1e-5)
    with pytest.raises(ValueError, match="weight_scale has shape"):
        load_modelopt_nvfp4(q, t.qdata, t.scale[:, :4], t.global_scale)
    with pytest.raises(ValueError, match="plain 'nvfp4' recipe"):
        load_modelopt_nvfp4(QuantLinear(128, 48, recipe="nvfp4_rht16"), t.qdata, t.scale, t.global_scale)
