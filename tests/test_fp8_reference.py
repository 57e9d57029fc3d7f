"""FP8 E4M3 reference: scale rules, rounding against an enumerated grid, non-finite handling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import SHAPES, families
from test_nvfp4_reference import E4M3, _nearest_even

from solrl_engine.quant import fp8


def test_rowwise_scales_and_hand_values():
    x = torch.tensor([[448.0, 1.0, -0.5, 0.0], [2.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q = fp8.quantize_rowwise(x)
    assert q.scale.shape == (3, 1)
    assert q.scale[:, 0].tolist() == [1.0, pytest.approx(2.0 / 448.0, rel=1e-7), 1.0]
    assert q.data[0].float().tolist() == [448.0, 1.0, -0.5, 0.0]
    assert q.data[1, 0].float().item() == 448.0  # the row max maps to the format max
    assert torch.equal(q.dequantize(torch.float32)[2], torch.zeros(4))


@pytest.mark.parametrize("shape", [(4, 16), (3, 100)])
def test_rowwise_matches_enumerated_grid(shape):
    for kind, x in families(shape, seed=7):
        if kind == "nonfinite":
            continue
        q = fp8.quantize_rowwise(x)
        xs = x.float().numpy().astype(np.float32)
        for r in range(shape[0]):
            a = np.float32(np.abs(xs[r]).max())
            enc = np.float32(1.0) if a == 0 else min(np.float32(448.0) / a, np.float32(np.finfo(np.float32).max))
            for j in range(shape[1]):
                v = float(np.clip(np.float32(xs[r, j]) * enc, -448, 448))
                code = _nearest_even(E4M3, abs(v))
                got = q.data.view(torch.uint8)[r, j].item()
                assert got & 0x7F == code, (kind, r, j)
                if code:
                    assert got >> 7 == int(v < 0)


def test_nonfinite_becomes_nan_not_a_finite_value():
    x = torch.randn(3, 8)
    x[0, 1] = float("inf")
    x[1, 2] = float("nan")
    x[2, 3] = float("-inf")
    q = fp8.quantize_rowwise(x)
    y = q.dequantize(torch.float32)
    assert torch.isnan(y[0, 1]) and torch.isnan(y[1, 2]) and torch.isnan(y[2, 3])
    assert torch.isfinite(y).sum() == 24 - 3
    # the finite values keep a sensible scale (the Inf did not set the amax)
    assert q.scale[0, 0].item() == pytest.approx(x[0][torch.isfinite(x[0])].abs().max().item() / 448, rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_rowwise_error_bound(shape):
    for kind, x in families(shape, seed=3):
        if kind == "nonfinite":
            continue
        y = fp8.fake_quantize_rowwise(x)
        amax = x.abs().amax(-1, keepdim=True)
        # relative half-ulp of E4M3 normals is 2^-4; subnormals are 2^-10 of the row amax apart
        tol = x.abs() * 2**-4 + amax * 2**-10 + 1e-37
        assert ((x - y).abs() <= tol).all(), kind


def test_tensorwise_and_static_amax():
    x = torch.randn(5, 7)
    q = fp8.quantize_tensorwise(x)
    assert q.scale.dim() == 0
    assert q.scale.item() == pytest.approx(x.abs().max().item() / 448, rel=1e-6)
    q2 = fp8.quantize_tensorwise(x, amax=448.0)
    assert q2.scale.item() == 1.0
    with pytest.raises(ValueError, match="amax"):
        fp8.quantize_tensorwise(x, amax=float("inf"))


def test_empty_last_dim_is_a_clear_error():
    with pytest.raises(ValueError, match="last dimension"):
        fp8.quantize_rowwise(torch.zeros(3, 0))
