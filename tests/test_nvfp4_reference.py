"""The NVFP4 reference against hand-computed vectors and an independent scalar oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import SHAPES, families

from solrl_engine.quant import nvfp4

F = np.float32


def _e4m3_grid() -> np.ndarray:
    """All non-negative finite E4M3 values, indexed by code 0..126."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_grid()
E2M1 = np.array(nvfp4.E2M1_VALUES)


def _nearest_even(grid: np.ndarray, v: float) -> int:
    """Index of the grid value nearest to v (float64 distances), ties to the even index."""
    d = np.abs(grid - v)
    best = np.flatnonzero(d == d.min())
    return int(best[0]) if len(best) == 1 else int(best[best % 2 == 0][0])


def oracle_quantize(x: torch.Tensor, amax: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Scalar-by-scalar NVFP4 of a finite 2-D tensor in numpy float32 (codes unpacked, scale codes)."""
    xs = x.float().numpy().astype(F)
    a = F(np.abs(xs).max()) if amax is None else F(amax)
    s_enc = F(1.0) if a == 0 else min(F(2688.0) / a, F(np.finfo(F).max))
    g = F(1.0) / s_enc
    rows, k = xs.shape
    codes = np.zeros((rows, k), dtype=np.uint8)
    scodes = np.zeros((rows, k // 16), dtype=np.uint8)
    for r in range(rows):
        for b in range(k // 16):
            blk = xs[r, b * 16 : (b + 1) * 16]
            v = min(F(np.abs(blk).max()) * (s_enc * F(1.0 / 6.0)), F(448.0))
            sc = _nearest_even(E4M3, float(v))
            scodes[r, b] = sc
            s = F(E4M3[sc])
            mult = min(F(1.0) / (s * g), F(np.finfo(F).max))
            for j, xv in enumerate(blk):
                y = float(np.clip(F(xv) * mult, -6.0, 6.0))
                codes[r, b * 16 + j] = _nearest_even(E2M1, abs(y)) | (8 if y < 0 else 0)
    return codes, scodes, float(g)


def test_hand_computed_ties_and_packing():
    # Static amax 10.5 gives S_enc = 256 exactly; a block with amax 6 gets scale 256, so the
    # element multiplier is exactly 1 and the values below hit the E2M1 ties unchanged.
    block = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0.5]
    t = nvfp4.quantize(torch.tensor([block]), amax=10.5)
    assert t.global_scale.item() == 2.0**-8
    assert t.scale.float().tolist() == [[256.0]]
    assert t.codes().tolist() == [[7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 1]]
    # low nibble = even element
    assert t.qdata.tolist() == [[0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x1E]]
    assert t.dequantize(torch.float32).tolist() == [[6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 0.5]]


def test_just_past_a_tie_rounds_away():
    eps = 1e-6
    block = [6.0, 0.25 + eps, 1.25 + eps, 2.5 + eps, 5 + eps] + [0.0] * 11
    codes = nvfp4.quantize(torch.tensor([block]), amax=10.5).codes()[0, :5].tolist()
    assert codes == [7, 1, 3, 5, 7]


def test_scale_chain_by_hand():
    # amax 3 -> S_enc = 896, g = 1/896. Block amax 1.5 -> 1.5*896/6 = 224 (exact in E4M3).
    x = torch.zeros(2, 16)
    x[0, 0] = 3.0
    x[1, 0] = 1.5
    x[1, 1] = 0.1
    t = nvfp4.quantize(x)
    assert t.global_scale.item() == pytest.approx(1 / 896, rel=1e-7)
    assert t.scale.float()[:, 0].tolist() == [448.0, 224.0]
    # 0.1 * 224 / ... : 0.1 * (1/(224/896)) = 0.4 -> nearest E2M1 is 0.5 (code 1)
    assert t.codes()[1, :2].tolist() == [7, 1]


def test_all_zero_tensor_has_unit_scale_and_zero_output():
    t = nvfp4.quantize(torch.zeros(4, 32))
    assert t.global_scale.item() == 1.0
    assert (t.qdata == 0).all() and (t.scale.float() == 0).all()
    assert (t.dequantize(torch.float32) == 0).all()


def test_tiny_block_scale_underflows_to_zero_and_decodes_to_zero():
    # A block 1e-6 of the tensor amax gets a scale below E4M3's smallest subnormal: scale 0,
    # multiplier capped at the fp32 max, codes saturate to +-6 (as TE does), decoded value 0.
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 16] = 1e-6
    x[0, 17] = -1e-6
    t = nvfp4.quantize(x)
    assert t.scale.float()[0, 1].item() == 0.0
    assert t.codes()[0, 16:18].tolist() == [7, 15]
    assert t.dequantize(torch.float32)[0, 16:].abs().max().item() == 0.0


@pytest.mark.parametrize("shape", [(1, 16), (5, 64), (9, 160)])
@pytest.mark.parametrize("kind", ["gaussian", "outlier_channels", "decades", "zero_blocks", "ties", "tiny"])
def test_reference_matches_scalar_oracle(shape, kind):
    x = dict(families(shape, seed=hash((shape, kind)) % 1000))[kind]
    for amax in (None, 2.5):
        codes, scodes, g = oracle_quantize(x, amax)
        t = nvfp4.quantize(x, amax=amax)
        assert np.array_equal(t.codes().numpy(), codes)
        assert np.array_equal(t.scale.view(torch.uint8).numpy(), scodes)
        assert t.global_scale.item() == g


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_error_is_bounded(shape, dtype):
    for kind, x in families(shape, seed=1):
        if kind == "nonfinite":
            continue
        x = x.to(dtype)
        y = nvfp4.fake_quantize(x)
        assert y.dtype == dtype and y.shape == x.shape
        xf, yf = x.float(), y.float()
        # Per block: |err| <= half an E2M1 step at the top (1.0 of 6) times the block scale,
        # plus the E4M3 rounding of that scale (1/16), plus the output cast.
        blk_amax = xf.reshape(-1, 16).abs().amax(-1, keepdim=True)
        err = (xf - yf).reshape(-1, 16).abs()
        tol = blk_amax * (1.0 / 6.0 * 1.07) + blk_amax * 2**-7 + 1e-30
        small = blk_amax < xf.abs().max() * 2**-17  # scale underflow: such blocks decode to ~0
        assert ((err <= tol) | small).all(), f"{kind}: max excess {(err - tol).max().item()}"


def test_nonfinite_blocks_decode_to_nan_and_others_stay_finite():
    x = torch.randn(4, 64)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[2, 40] = float("-inf")
    t = nvfp4.quantize(x)
    y = t.dequantize(torch.float32).reshape(4, 4, 16)
    bad = {(0, 0), (1, 1), (2, 2)}
    for r in range(4):
        for b in range(4):
            if (r, b) in bad:
                assert torch.isnan(y[r, b]).all()
                assert torch.isnan(t.scale[r, b].float())
            else:
                assert torch.isfinite(y[r, b]).all()
    # The tensor scale comes from the finite values only.
    finite = x[torch.isfinite(x)].abs().max()
    assert t.global_scale.item() == pytest.approx(finite.item() / 2688.0, rel=1e-6)


def test_static_amax_is_used():
    x = torch.randn(3, 32)
    t = nvfp4.quantize(x, amax=100.0)
    assert t.global_scale.item() == pytest.approx(100.0 / 2688.0, rel=1e-7)
    # a static amax below the data saturates the top block values at 6 * scale
    t2 = nvfp4.quantize(torch.full((1, 16), 10.0), amax=1.0)
    assert t2.dequantize(torch.float32).max().item() == pytest.approx(6 * 448 / 2688, rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_static_amax_is_rejected(bad):
    with pytest.raises(ValueError, match="amax"):
        nvfp4.quantize(torch.randn(2, 16), amax=bad)


def test_last_dim_not_multiple_of_16_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of 16.*[Pp]ad"):
        nvfp4.quantize(torch.randn(4, 20))
    with pytest.raises(TypeError, match="floating-point"):
        nvfp4.quantize(torch.ones(4, 16, dtype=torch.int32))


def test_shapes_and_dtypes_of_the_public_object():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    t = nvfp4.quantize(x)
    assert t.qdata.dtype == torch.uint8 and t.qdata.shape == (2, 3, 32)
    assert t.scale.dtype == torch.float8_e4m3fn and t.scale.shape == (2, 3, 4)
    assert t.global_scale.dtype == torch.float32 and t.global_scale.dim() == 0
    assert t.shape == x.shape
    assert t.dequantize().dtype == torch.bfloat16
    assert torch.equal(nvfp4.unpack_codes(nvfp4.pack_codes(t.codes())), t.codes())


def test_swizzle_offsets_from_the_spec():
    s = torch.arange(128 * 128, dtype=torch.int32).reshape(128, 128)
    s8 = (s % 251).to(torch.uint8)
    sw = nvfp4.swizzle_scales(s8)
    assert sw.numel() == 128 * 128
    assert sw[82].item() == s8[5, 2].item()
    assert sw[593].item() == s8[5, 5].item()
    off = nvfp4.swizzle_offsets(128, 128)
    assert off[5, 2].item() == 82 and off[5, 5].item() == 593
    assert off.unique().numel() == 128 * 128


@pytest.mark.parametrize("rows,cols", [(1, 1), (100, 3), (128, 4), (130, 9), (300, 64)])
def test_swizzle_roundtrip_and_zero_padding(rows, cols):
    s = torch.rand(rows, cols).mul(400).to(torch.float8_e4m3fn)
    s = torch.where(s.float() == 0, torch.ones(()), s.float()).to(torch.float8_e4m3fn)  # no zeros
    sw = nvfp4.swizzle_scales(s)
    assert sw.dtype == torch.float8_e4m3fn
    assert sw.numel() == -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert (sw.view(torch.uint8) != 0).sum().item() == rows * cols  # padding is zero
    back = nvfp4.unswizzle_scales(sw, rows, cols)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    with pytest.raises(ValueError, match="padded"):
        nvfp4.unswizzle_scales(sw[:-1], rows, cols)


def test_swizzle_flattens_leading_dims():
    s = torch.rand(2, 70, 8).mul(100).to(torch.float8_e4m3fn)
    sw = nvfp4.swizzle_scales(s)
    assert torch.equal(nvfp4.unswizzle_scales(sw, 140, 8).view(torch.uint8), s.reshape(140, 8).view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_unit_equals_decoding_the_codes(shape, dtype):
    for kind, x in families(shape, seed=21):
        x = x.to(dtype)
        for amax in (None, 0.75):
            t = nvfp4.quantize(x, amax)
            one = torch.ones((), dtype=torch.float32)
            want = nvfp4.dequantize(nvfp4.NVFP4Tensor(t.qdata, t.scale, one), torch.float32)
            got, g = nvfp4.fake_quantize_unit(x, amax)
            assert torch.equal(g, t.global_scale), kind
            same = (got == want) | (torch.isnan(got) & torch.isnan(want))
            assert same.all(), f"{kind}: {(~same).sum().item()} values differ"
