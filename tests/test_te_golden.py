"""Our NVFP4 reference and Triton kernels against Transformer Engine's own reference quantizer.

tests/data/te_nvfp4_golden.safetensors holds inputs of every family and the codes and block scales
that TE's NVFP4QuantizerRef produced for them (see tests/data/make_te_golden.py). Compared bit for
bit, with the sign of zero codes ignored (not part of the contract). For non-finite input our
contract differs from TE on purpose (docs/kernels-and-numerics.md, numerics contract): only finite blocks are compared,
with a static amax, and ours must decode the others to NaN.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from solrl_engine import kernels
from solrl_engine.quant import nvfp4

GOLDEN = load_file(Path(__file__).parent / "data" / "te_nvfp4_golden.safetensors")
STATIC_AMAX = 2.5
CASES = sorted({k.rsplit(".", 1)[0] for k in GOLDEN if k.endswith(".x")})


def _unsigned_zero(codes: torch.Tensor) -> torch.Tensor:
    return torch.where((codes & 7) == 0, torch.zeros_like(codes), codes)


def _check(case: str, quantize) -> None:
    x = GOLDEN[f"{case}.x"]
    nonfinite = not bool(torch.isfinite(x.float()).all())
    for mode in ("dyn", "static"):
        if nonfinite and mode == "dyn":
            continue
        t = quantize(x, None if mode == "dyn" else STATIC_AMAX)
        codes = _unsigned_zero(t.codes().cpu())
        te_codes = _unsigned_zero(nvfp4.unpack_codes(GOLDEN[f"{case}.{mode}.codes"]))
        scales = t.scale.cpu().view(torch.uint8)
        te_scales = GOLDEN[f"{case}.{mode}.scales"][:, : scales.shape[-1]]
        if nonfinite:
            ok = torch.isfinite(x.float()).reshape(*scales.shape, 16).all(-1)
            assert torch.equal(codes.reshape(*scales.shape, 16)[ok], te_codes.reshape(*scales.shape, 16)[ok])
            assert torch.equal(scales[ok], te_scales[ok])
            assert torch.isnan(t.scale.cpu().float()[~ok]).all()
        else:
            assert torch.equal(codes, te_codes), f"{case} {mode}: codes differ"
            assert torch.equal(scales, te_scales), f"{case} {mode}: scales differ"


def test_golden_file_covers_every_family_and_dtype():
    kinds = {c.split(".")[0] for c in CASES}
    assert kinds == {"gaussian", "outlier_channels", "decades", "zero_blocks", "ties", "tiny", "nonfinite"}
    assert {c.split(".")[1] for c in CASES} == {"f32", "bf16", "f16"}


@pytest.mark.parametrize("case", CASES)
def test_reference_is_bit_exact_with_transformer_engine(case):
    _check(case, nvfp4.quantize)


@pytest.mark.parametrize("case", CASES)
def test_triton_is_bit_exact_with_transformer_engine(case, triton_backend, device):
    _check(case, lambda x, amax: kernels.nvfp4_quantize(x.to(device), amax))
