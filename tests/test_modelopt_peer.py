"""NVIDIA ModelOpt's NVFP4 against ours (the TE recipe): equal where the recipes agree, and each
documented difference (solrl_engine/nn/modelopt_peer.py, numbered there) pinned on a hand-made input."""

import pytest
import torch
from torch import nn

pytest.importorskip("modelopt.torch.quantization.qtensor", reason="pip install nvidia-modelopt")

from solrl_engine.nn import QuantLinear  # noqa: E402
from solrl_engine.nn.modelopt_peer import (  # noqa: E402
    load_modelopt_nvfp4,
    modelopt_fake_quantize,
    modelopt_quantize,
    quantize_model_modelopt,
)
from solrl_engine.quant import nvfp4  # noqa: E402


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _at_ties(x: torch.Tensor, t: nvfp4.NVFP4Tensor, where: torch.Tensor) -> bool:
    """Whether every element in `where` sits (within 1e-5) on an E2M1 rounding tie once scaled."""
    k = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], k // 16, 16)
    scaled = (blocks / (t.scale.float() * t.global_scale).unsqueeze(-1)).reshape(x.shape)
    ties = torch.tensor(nvfp4.E2M1_TIES_DOWN + nvfp4.E2M1_TIES_UP)
    return bool(((scaled[where].abs().unsqueeze(-1) - ties).abs().amin(-1) < 1e-5).all())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ulps apart (same-sign values; -0.0 == 0.0: a zero code's sign is not part of the format)."""
    d = (a.float().view(torch.int32).long() - b.float().view(torch.int32).long()).abs()
    return torch.where(a.float() == b.float(), 0, d)


@pytest.mark.parametrize("kind", ["gaussian", "outlier_channels", "bf16", "calibrated_amax"])
def test_codes_and_block_scales_agree_on_ordinary_data(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g)
    amax = None
    if kind == "outlier_channels":
        x[:, ::50] *= 60
    if kind == "bf16":
        x = x.bfloat16()
    if kind == "calibrated_amax":  # a static amax below the data's: both saturate at 6 * 448
        amax = 2.0
    a, b = modelopt_quantize(x, amax), nvfp4.quantize(x, amax)
    assert torch.equal(_u8(a.scale), _u8(b.scale))
    # difference 1: the second-level scale, <= 1 FP32 ulp apart
    assert _ulps(a.global_scale, b.global_scale) <= 1
    # difference 2: codes differ only at E2M1 rounding ties, rarely
    differ = a.codes() != b.codes()
    assert differ.float().mean() < 1e-3
    assert _at_ties(x, b, differ)
    if kind == "calibrated_amax":
        assert (a.codes() & 7 == 7).sum() > 100  # many saturated codes, all agreeing


def test_decades_spread_data_differs_only_by_the_subnormal_scale_clamp():
    """difference 4 in the wild: values spread over 8 decades, block by block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * 10 ** (-8 * torch.rand(64, 16, 1, generator=g)).expand(64, 16, 16).reshape(
        64, 256)  # fmt: skip
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    sa, sb = a.scale.float(), b.scale.float()
    kept = sb > 0
    assert torch.equal(sa[kept], sb[kept])  # every scale TE keeps, ModelOpt has bit for bit
    flushed = ~kept
    assert flushed.sum() > 50  # blocks ~1e-4 of the amax and below: TE's scale rounds to 0 ...
    assert (sa[flushed] == 2**-9).all()  # ... ModelOpt clamps it to E4M3's smallest subnormal
    codes_kept = kept.repeat_interleave(16, dim=-1)
    differ = (a.codes() != b.codes()) & codes_kept
    assert _at_ties(x, b, differ)
    da, db = modelopt_fake_quantize(x), nvfp4.fake_quantize(x)
    assert (db[~codes_kept] == 0).all() and (da[~codes_kept] != 0).any()


def test_second_level_scale_is_a_division_there_and_a_reciprocal_here():
    x = torch.randn(4, 64)
    x[0, 0] = 25341.097  # an amax whose two roundings differ
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    amax = x.abs().amax()
    assert a.global_scale == amax / torch.tensor(2688.0)
    assert b.global_scale == 1 / (torch.tensor(2688.0) / amax)
    assert a.global_scale != b.global_scale


def test_encode_divides_there_and_multiplies_by_the_reciprocal_here():
    """difference 2 by hand: with amax 2688 both global scales are exactly 1; the block scale is
    15/512 (0.029296875), whose reciprocal rounds up, so 1.25 * 15/512 lands exactly on the 1.25 tie
    there (even: 1.0) and just above it here (1.5)."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16] = 6 * 15 / 512  # block max: scale 15/512 on both sides
    x[0, 17] = 1.25 * 15 / 512
    a, b = modelopt_quantize(x), nvfp4.quantize(x)
    assert a.global_scale == b.global_scale == 1
    assert a.scale[0, 1].float() == b.scale[0, 1].float() == 15 / 512
    assert nvfp4.e2m1_decode(a.codes()[0, 17]) == 1.0 and nvfp4.e2m1_decode(b.codes()[0, 17]) == 1.5


def test_decode_order_differs_by_one_ulp_on_equal_codes_and_scales():
    """difference 3: e2m1 * (s * scale_2) there, (e2m1 * s) * g here; only codes 1.5, 3, 6 can differ."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    x = x / x.abs().amax() * 3  # amax 3: scale_2 = 3 / 2688, whose products with the block scales round
    t = modelopt_quantize(x)
    theirs, ours = modelopt_fake_quantize(x), nvfp4.dequantize(t)
    d = _ulps(theirs, ours)
    assert d.max() == 1 and (d > 0).float().mean() > 0.01
    mag = nvfp4.e2m1_decode(t.codes()).abs()
    assert torch.isin(mag[d > 0], torch.tensor([1.5, 3.0, 6.0])).all()


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


def test_an_all_zero_tensor_decodes_to_nan_there_and_zeros_here():
    """difference 6: amax 0 gives scale_2 = 0 and block scales 0 / 0 = NaN in NVFP4QTensor."""
    x = torch.zeros(4, 32)
    a = modelopt_quantize(x)
    assert a.global_scale == 0 and torch.isnan(a.scale.float()).all()
    assert torch.isnan(modelopt_fake_quantize(x)).all()
    assert torch.equal(nvfp4.fake_quantize(x), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_poisons_the_whole_tensor_there_and_its_blocks_here(bad):
    x = torch.randn(2, 64)
    x[0, 3] = bad
    mo, ours = modelopt_fake_quantize(x), nvfp4.fake_quantize(x)
    assert torch.isnan(mo).all()
    assert torch.isnan(ours[0, :16]).all() and torch.isfinite(ours[0, 16:]).all() and torch.isfinite(ours[1]).all()


def test_a_last_dimension_off_the_block_is_padded_there_and_refused_here():
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    x = torch.randn(3, 24)
    q, scale, _ = NVFP4QTensor.quantize(x, 16)
    assert scale.shape == (3, 2)  # 24 -> 32, zero-padded
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(x)
    with pytest.raises(ValueError, match="multiple of 16"):
        modelopt_fake_quantize(x)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))


def test_mtq_quantize_runs_on_cpu_through_nvfp4qtensor():
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    q = quantize_model_modelopt(model, lambda m: m(x))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the original is untouched
    assert "QuantLinear" in type(q[0]).__name__ and q[0].weight_quantizer.amax is not None
    with torch.no_grad():
        y = q(x)
        # ModelOpt's forward is exactly F.linear on its fake-quantized input and weight (calibrated amaxes)
        h = x
        for lin in (q[0], q[2]):
            xq = modelopt_fake_quantize(h, lin.input_quantizer.amax)
            h = nn.functional.linear(xq, modelopt_fake_quantize(lin.weight, lin.weight_quantizer.amax), lin.bias)
            if lin is q[0]:
                h = nn.functional.gelu(h)
        assert torch.equal(y, h)
        # ... and within the documented differences of ours on the same amaxes
        ref = model(x)
        h = x
        for lin, src in ((q[0], model[0]), (q[2], model[2])):
            xq = nvfp4.fake_quantize(h, lin.input_quantizer.amax)
            h = nn.functional.linear(xq, nvfp4.fake_quantize(src.weight), src.bias)
            if lin is q[0]:
                h = nn.functional.gelu(h)
        assert (y - h).abs().max() < 0.02 * (ref - h).abs().max() + 1e-6  # far below the 4-bit error itself


def test_a_modelopt_export_loads_into_quant_linear_without_requantizing():
    """ModelOpt's own export step (the one writing weight / weight_scale / weight_scale_2 /
    input_scale for TensorRT-LLM and vLLM) on a layer it quantized; nothing is re-quantized here."""
    export = pytest.importorskip("modelopt.torch.export.unified_export_hf")
    fn = getattr(export, "_export_quantized_weight", None)
    if fn is None:
        pytest.skip("this ModelOpt has no _export_quantized_weight")
    model = _mlp()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    q = quantize_model_modelopt(model, lambda m: m(x))
    lin = q[0]
    w_amax, in_amax = lin.weight_quantizer.amax.clone(), lin.input_quantizer.amax.clone()
    fn(lin, torch.float32)
    packed, scale, scale_2, in_scale = lin.weight, lin.weight_scale, lin.weight_scale_2, lin.input_scale
    assert packed.dtype == torch.uint8 and packed.shape == (96, 32)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (96, 4)
    assert scale_2 == w_amax / 2688 and in_scale == in_amax / 2688
    # the export's bytes are NVFP4QTensor's: element 2i in the low nibble, as ours
    t = modelopt_quantize(model[0].weight.detach())
    assert torch.equal(packed, t.qdata) and torch.equal(_u8(scale), _u8(t.scale))

    ql = QuantLinear(64, 96, recipe="nvfp4_weight_only")
    load_modelopt_nvfp4(ql, packed, scale, scale_2, input_scale=in_scale, bias=lin.bias)
    assert torch.equal(ql.w_qdata, packed) and ql.w_global_scale == scale_2
    assert torch.equal(ql.weight, nvfp4.dequantize(t))  # our decode order on ModelOpt's codes and scales
    want = modelopt_fake_quantize(model[0].weight.detach())
    assert _ulps(ql.weight, want).max() <= 1  # difference 3: within one ulp of ModelOpt's own decode
    assert torch.allclose(ql.modelopt_input_amax, in_amax)
    # our codes from the original weight match the checkpoint except at ties
    ours = nvfp4.quantize(model[0].weight.detach())
    assert torch.equal(_u8(ours.scale), _u8(scale)) and (ours.codes() != t.codes()).float().mean() < 1e-3
    xx = torch.randn(3, 64)
    assert torch.allclose(
        ql(xx), xx @ ql.weight.T + ql.bias.float(), atol=1e-5
    )  # its bias: the checkpoint's, stored as the layer keeps biases


def test_load_rejects_what_does_not_fit():
    t = modelopt_quantize(torch.randn(48, 128))
    q = QuantLinear(128, 48, recipe="nvfp4_weight_only")
    with pytest.raises(ValueError, match="weight_scale has shape"):
        load_modelopt_nvfp4(q, t.qdata, t.scale[:, :4], t.global_scale)
    with pytest.raises(TypeError, match="1-byte"):
        load_modelopt_nvfp4(q, t.qdata.float(), t.scale, t.global_scale)
    with pytest.raises(ValueError, match="weight_scale_2 must be one finite value"):
        load_modelopt_nvfp4(q, t.qdata, t.scale, torch.ones(2))
    with pytest.raises(ValueError, match="plain 'nvfp4' recipe"):
        load_modelopt_nvfp4(QuantLinear(128, 48, recipe="nvfp4_rht16"), t.qdata, t.scale, t.global_scale)
