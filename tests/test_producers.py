"""The quantize where its input is made: adaLN producers that emit their output's 8-bit codes (nn.producers).

Three layers: the Triton kernel (norm, modulation and row-wise codes in one pass) against the reference on fresh
data of several shapes and kinds; the `Prequantized` hand-over (every op sees y, a QuantLinear of the format takes
the codes); the explore copies of the real FLUX.1 and SD3 classes, fused as ModelSpec.producers says, against the
same copies unfused (bit for bit on the reference backend), with the quantize passes they skip counted and what
ran recorded at a simulated GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from families import families
from tiny_pipelines import (
    SIZES,
    LazyPipes,
    build_flux,
    build_flux2,
    build_qwenimage,
    build_sana,
    build_sana_video,
    build_sd3,
    build_wan,
    build_z_image,
)

from solrl_engine import kernels
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.explore.plan import ExploreSpec
from solrl_engine.kernels import dispatch
from solrl_engine.models import load_model, model_spec
from solrl_engine.nn import QuantLinear
from solrl_engine.nn.producers import fuse_producers, keep_outputs
from solrl_engine.nn.quant_linear import Prequantized, QuantConv1x1
from solrl_engine.quant import int8 as int8_numerics
from solrl_engine.quant import producers
from solrl_engine.quant.formats import numerics

SHAPES = [(1, 3, 16), (2, 7, 48), (2, 5, 96), (1, 33, 1040)]  # [B, T, K]; K not a power of two included


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN of the same pattern)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


def _modulation(b: int, k: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = (torch.randn(b, k, generator=g) * 0.5).to(dtype)
    return 1 + scale, (torch.randn(b, k, generator=g) * 0.3).to(dtype)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize(("dtype", "out"), [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.float32, torch.bfloat16)])  # fmt: skip
def test_the_kernels_codes_are_the_formats_rowwise_codes_of_its_output(shape, fmt, dtype, out, device):
    """The Triton kernel's y agrees with the stock module's ops (FP32: to FP32 rounding, its norm's sums are ordered
    otherwise; BF16 outside autocast: every step rounded to BF16 as PyTorch's ops round it; FP32 cast to BF16 at the
    end, as SANA's and Wan's blocks cast it) and its codes and scales are the format's row-wise quantize of that y
    (of the BF16 y where it is cast), bit for bit (quant/<fmt>.py's contract), on every input family: Gaussian,
    outlier channels, decades, zero rows, ties, tiny, NaN/Inf."""
    b, t, k = shape
    onep, shift = _modulation(b, k, 3, dtype)
    for kind, x in families(shape, seed=21):
        x = x.to(dtype)
        want = producers.adaln(x, onep, shift, 1e-6, fp32_norm=False)
        want = want if out is None else want.to(out)
        y, codes, scale = torch.ops.solrl.adaln_quantize(x.to(device), onep.to(device), shift.to(device), 1e-6, fmt,
                                                         False, "kernel test", out)  # fmt: skip
        assert dispatch.runs()["kernel test"].impl.startswith("triton"), dispatch.runs()["kernel test"]
        y, codes, scale = y.cpu(), codes.cpu(), scale.cpu()
        assert y.dtype == want.dtype == (out or dtype)
        tol = {"rtol": 1e-5, "atol": 1e-5} if y.dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
        torch.testing.assert_close(y, want, equal_nan=True, **tol, msg=lambda m, kind=kind: f"{kind}: {m}")
        if y.dtype == torch.bfloat16:  # a last-bit difference of the norm's sums may flip a BF16 rounding, rarely
            differ = (y.view(torch.int16) != want.view(torch.int16)) & ~torch.isnan(want)  # NaNs: any pattern
            assert differ.float().mean() < 0.02, kind
        q = numerics(fmt).rowwise(y)
        assert _same(codes, q.data) and _same(scale, q.scale), kind
        if kind == "nonfinite":  # a non-finite x makes its row's y NaN: the codes say so, never a finite number
            bad = ~torch.isfinite(x).all(-1)
            assert torch.isnan(y[bad]).all()
            assert (torch.isnan(scale[bad]).all() if fmt == "int8" else (codes[bad].view(torch.uint8) == 0x7F).all())


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize(("x_dt", "w_dt", "s_dt"), [(torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.float32, torch.float32),
                                                    (torch.bfloat16, torch.float32, torch.bfloat16),
                                                    (torch.bfloat16, None, torch.bfloat16),
                                                    (torch.bfloat16, torch.bfloat16, None)])  # fmt: skip
def test_the_rms_kernels_codes_are_the_formats_rowwise_codes_of_its_output(shape, fmt, x_dt, w_dt, s_dt, device):
    """The fused RMS norm's Triton kernel (Z-Image: diffusers' RMSNorm with its weight, times the sample's
    modulation scale): its y agrees with the module's ops in their dtypes (a BF16 weight: cast before it
    multiplies; an FP32 one: an FP32 y; none: x's dtype; the scale's product rounded as PyTorch rounds it; the mean
    square's sum is ordered otherwise, so to FP32 rounding, a last BF16 bit apart rarely) and its codes and scales
    are the format's row-wise quantize of that y bit for bit, on every input family."""
    b, t, k = shape
    g = torch.Generator().manual_seed(4)
    w = None if w_dt is None else (1 + 0.3 * torch.randn(k, generator=g)).to(w_dt)
    sc = None if s_dt is None else (1 + 0.5 * torch.randn(b, k, generator=g)).to(s_dt)
    for kind, x in families(shape, seed=23):
        x = x.to(x_dt)
        want = producers.rms_scaled(x, w, 1e-5, sc)
        on = (lambda v: None if v is None else v.to(device))  # noqa: E731
        y, codes, scale = torch.ops.solrl.rms_quantize(x.to(device), on(w), 1e-5, on(sc), fmt, "rms test")
        assert dispatch.runs()["rms test"].impl.startswith("triton: RMS"), dispatch.runs()["rms test"]
        y, codes, scale = y.cpu(), codes.cpu(), scale.cpu()
        assert y.dtype == want.dtype, (y.dtype, want.dtype)
        tol = {"rtol": 1e-5, "atol": 1e-5} if y.dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
        torch.testing.assert_close(y, want, equal_nan=True, **tol, msg=lambda m, kind=kind: f"{kind}: {m}")
        if y.dtype == torch.bfloat16:
            differ = (y.view(torch.int16) != want.view(torch.int16)) & ~torch.isnan(want)
            assert differ.float().mean() < 0.02, kind
        q = numerics(fmt).rowwise(y)
        assert _same(codes, q.data) and _same(scale, q.scale), kind


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gelu_kernels_codes_are_the_formats_rowwise_codes_of_its_output(shape, fmt, dtype, device):
    """The fused GELU's Triton kernel: its y agrees with PyTorch's tanh GELU (FP32: to a few FP32 roundings, its
    tanh is computed otherwise; BF16: rounded as PyTorch rounds its FP32 result, a last bit apart rarely; in the
    negative tail both lose 1 + tanh to cancellation, to 1e-6 absolute) and its
    codes and scales are the format's row-wise quantize of that y, bit for bit, on every input family (NaN/Inf
    included: -inf gives NaN, as PyTorch's formula does)."""
    for kind, x in families(shape, seed=5):
        x = x.to(dtype)
        want = torch.nn.functional.gelu(x, approximate="tanh")
        y, codes, scale = torch.ops.solrl.gelu_quantize(x.to(device), fmt, "gelu kernel test")
        assert dispatch.runs()["gelu kernel test"].impl.startswith("triton: GELU"), dispatch.runs()["gelu kernel test"]
        y, codes, scale = y.cpu(), codes.cpu(), scale.cpu()
        assert y.dtype == dtype and scale.shape == (*shape[:-1], 1)
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
        torch.testing.assert_close(y, want, equal_nan=True, **tol, msg=lambda m, kind=kind: f"{kind}: {m}")
        if dtype == torch.bfloat16:  # below x = -3, 1 + tanh cancels to a few FP32 ulps in both: atol covers it
            differ = (y.view(torch.int16) != want.view(torch.int16)) & ~torch.isnan(want) & (x.float() >= -3)
            assert differ.float().mean() < 0.02, kind
        q = numerics(fmt).rowwise(y)
        assert _same(codes, q.data) and _same(scale, q.scale), kind


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gelu_kernel_joins_a_prefix_before_the_activation(fmt, dtype, device):
    """FLUX.1's single block: y = cat([prefix, gelu(x)]), the codes of the whole row (its amax over both parts): the
    prefix passes through unchanged, the rest is the GELU of x, and the codes are the format's quantize of y bit for
    bit, on prefixes and activations of every input family (a row's outlier may sit in either part)."""
    for (kind, x), (_, p) in zip(families((2, 5, 48), seed=7), families((2, 5, 16), seed=8), strict=True):
        x, p = x.to(dtype), (p * 3).to(dtype)
        y, codes, scale = torch.ops.solrl.gelu_quantize(x.to(device), fmt, "gelu cat test", p.to(device))
        assert dispatch.runs()["gelu cat test"].impl.startswith("triton: GELU")
        y, codes, scale = y.cpu(), codes.cpu(), scale.cpu()
        assert y.shape == (2, 5, 64), kind  # the prefix unchanged (a NaN may come back with another payload)
        torch.testing.assert_close(y[..., :16], p, equal_nan=True, rtol=0, atol=0)
        want = torch.nn.functional.gelu(x, approximate="tanh")
        torch.testing.assert_close(y[..., 16:], want, equal_nan=True, rtol=1e-5 if dtype == torch.float32 else 2**-7,
                                   atol=1e-6)  # fmt: skip
        q = numerics(fmt).rowwise(y)
        assert _same(codes, q.data) and _same(scale, q.scale), kind
    with pytest.raises(ValueError, match="prefix of x's dtype"):
        dispatch.triton_module("producers").gelu_quantize(torch.randn(1, 2, 8), fmt,
                                                          torch.randn(1, 2, 8, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("shape", [(1, 3, 32), (2, 7, 96), (1, 3, 5, 2080)])  # [..., 2K]: pixel rows of an NCHW map
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("gate_first", "two"), [(False, False), (True, False), (True, True)])
def test_the_gate_kernels_codes_are_the_formats_rowwise_codes_of_its_output(shape, fmt, dtype, gate_first, two,
                                                                           device):  # fmt: skip
    """The fused gate's Triton kernel (SANA's GLUMBConv: y = a * silu(g) of a row's halves [a, g]; FLUX.2's SwiGLU
    silu(first) * second with `gate_first`; Z-Image's, whose halves are two linears' outputs: `second`): its y
    agrees with PyTorch's ops (FP32: to FP32 rounding, its exp is another's; BF16: silu rounded, then the product,
    as PyTorch's BF16 ops round, a last bit apart rarely) and its codes and scales are the format's row-wise
    quantize of that y bit for bit, on every input family in either half (an outlier, a NaN or an Inf in the gate
    or in the value)."""
    for (kind, a), (_, g) in zip(families((*shape[:-1], shape[-1] // 2), seed=9),
                                 families((*shape[:-1], shape[-1] // 2), seed=10), strict=True):  # fmt: skip
        x = torch.cat([g * 4, a] if gate_first else [a, g * 4], dim=-1).to(dtype)
        first, second = x.chunk(2, dim=-1)
        silu = torch.nn.functional.silu
        want = silu(first) * second if gate_first else first * silu(second)
        halves = (first.contiguous().to(device), None, second.contiguous().to(device)) if two else (x.to(device),)
        y, codes, scale = torch.ops.solrl.glu_quantize(halves[0], fmt, "gate kernel test", gate_first, *halves[1:])
        assert dispatch.runs()["gate kernel test"].impl.startswith("triton: gate"), dispatch.runs()["gate kernel test"]
        y, codes, scale = y.cpu(), codes.cpu(), scale.cpu()
        assert y.dtype == dtype and y.shape == want.shape and scale.shape == (*shape[:-1], 1)
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
        torch.testing.assert_close(y, want, equal_nan=True, **tol, msg=lambda m, kind=kind: f"{kind}: {m}")
        if dtype == torch.bfloat16:
            differ = (y.view(torch.int16) != want.view(torch.int16)) & ~torch.isnan(want)
            assert differ.float().mean() < 0.02, kind
        q = numerics(fmt).rowwise(y)
        assert _same(codes, q.data) and _same(scale, q.scale), kind
        if kind == "nonfinite":  # a row holding a NaN or an Inf product: its codes say so, never a finite number
            bad = ~torch.isfinite(want).all(-1)
            nan_code = (codes[bad].view(torch.uint8) == 0x7F).any(-1)
            assert torch.isnan(scale[bad]).all() if fmt == "int8" else nan_code.all()
    with pytest.raises(ValueError, match="odd 7"):
        torch.ops.solrl.glu_quantize(torch.randn(2, 7), fmt, "")
    with pytest.raises(ValueError, match=r"a second of its shape; got \(2, 6\) beside \(2, 7\)"):
        torch.ops.solrl.glu_quantize(torch.randn(2, 7), fmt, "", True, None, torch.randn(2, 6))


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_kernel_joins_a_prefix_before_the_gate(fmt, dtype, device):
    """FLUX.2's single block: y = cat([attention output, silu(first) * second]), the codes of the whole row (its
    amax over both parts): the prefix passes through unchanged, the rest is the SwiGLU, and the codes are the
    format's quantize of y bit for bit, on prefixes and activations of every input family."""
    for (kind, x), (_, p) in zip(families((2, 5, 96), seed=11), families((2, 5, 16), seed=12), strict=True):
        x, p = x.to(dtype), (p * 3).to(dtype)
        y, codes, scale = torch.ops.solrl.glu_quantize(x.to(device), fmt, "gate cat test", True, p.to(device))
        assert dispatch.runs()["gate cat test"].impl.startswith("triton: gate")
        y, codes, scale = y.cpu(), codes.cpu(), scale.cpu()
        assert y.shape == (2, 5, 64), kind
        torch.testing.assert_close(y[..., :16], p, equal_nan=True, rtol=0, atol=0)
        first, second = x.chunk(2, dim=-1)
        torch.testing.assert_close(y[..., 16:], torch.nn.functional.silu(first) * second, equal_nan=True,
                                   rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-6)  # fmt: skip
        q = numerics(fmt).rowwise(y)
        assert _same(codes, q.data) and _same(scale, q.scale), kind
    with pytest.raises(ValueError, match="a second of x's dtype"):
        dispatch.triton_module("producers").glu_quantize(torch.randn(1, 2, 8), fmt, True,
                                                         torch.randn(1, 2, 8, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_producer_whose_output_no_op_reads_writes_the_same_codes_alone(fmt, backend, device, request):
    """keep_y=False (every linear the producer feeds takes the codes): each of the four ops gives the codes and
    scales it gives beside y, bit for bit, on every input family; the record says y was not written (the Triton
    kernels skip its store), and the reference's y is all NaN, so that a reader the plan missed shows."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
        mod = dispatch.triton_module("producers")
        real = mod._outputs

        def sentinel(*args):  # noqa: ANN002, ANN202  (y filled with 7: what a kernel that skips its store leaves)
            y, q, sc = real(*args)
            return y.fill_(7.0), q, sc

        request.getfixturevalue("monkeypatch").setattr(mod, "_outputs", sentinel)
    else:
        request.getfixturevalue("monkeypatch").setenv("SOLRL_BACKEND", "reference")
    ops = torch.ops.solrl
    b, t, k = 2, 5, 96
    onep, shift = _modulation(b, k, 5, torch.bfloat16)
    w, sc = (1 + 0.3 * torch.randn(k)).to(torch.bfloat16), onep
    calls = {
        "adaln": lambda x, keep: ops.adaln_quantize(x, onep.to(x.device), shift.to(x.device), 1e-6, fmt, False,
                                                    "alone", None, keep),  # fmt: skip
        "rms": lambda x, keep: ops.rms_quantize(x, w.to(x.device), 1e-5, sc.to(x.device), fmt, "alone", keep),
        "gelu": lambda x, keep: ops.gelu_quantize(x, fmt, "alone", x[..., :16], keep),
        "gate": lambda x, keep: ops.glu_quantize(x, fmt, "alone", True, x[..., :16], None, keep),
    }
    for kind, x in families((b, t, k), seed=31):
        x = x.to(torch.bfloat16).to(device)
        for op, call in calls.items():
            y, codes, scale = call(x, True)
            assert not dispatch.runs()["alone"].impl.endswith("(y unwritten)")
            y2, codes2, scale2 = call(x, False)
            impl = dispatch.runs()["alone"].impl
            assert impl.startswith(backend) and impl.endswith("codes alone (y unwritten)"), (op, impl)
            assert y2.shape == y.shape and y2.dtype == y.dtype, op
            assert _same(codes2.cpu(), codes.cpu()) and _same(scale2.cpu(), scale.cpu()), (op, kind)
            assert (y2.isnan() if backend == "reference" else y2 == 7.0).all(), op


def test_the_op_chooses_and_records_where_it_ran(monkeypatch):
    """On a CPU the reference runs; on a (simulated) GPU the Triton kernel for rows that fit, the reference with the
    reason otherwise; the record names it; a format without row-wise codes is refused, naming those with them."""
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    x = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    onep, shift = _modulation(1, 64, 0, torch.bfloat16)
    torch.ops.solrl.adaln_quantize(x, onep, shift, 1e-6, "fp8", False, "op test")
    assert dispatch.runs()["op test"].impl == "reference"
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    torch.ops.solrl.adaln_quantize(x, onep, shift, 1e-6, "int8", False, "op test")
    assert dispatch.runs()["op test"].impl.startswith("triton: layer norm, modulation")
    b, why = kernels.choose("adaln_quantize", "cpu", k=20000, x_dtype=torch.bfloat16,
                            modulation_dtype=torch.bfloat16, fp32_norm=False, fmt="fp8")  # fmt: skip
    assert b == "reference" and "at most 16384" in why
    with pytest.raises(ValueError, match=r"row-wise codes of \('fp8', 'int8'\)"):
        torch.ops.solrl.adaln_quantize(x, onep, shift, 1e-6, "nvfp4", False, "")


def test_a_prequantized_tensor_is_its_value_to_every_op_and_its_codes_to_a_linear_of_its_format():
    y = torch.randn(2, 3, 32)
    q = numerics("fp8").rowwise(y)
    p = Prequantized(y, q.data, q.scale, "fp8")
    out = p * 2 + 1
    assert type(out) is torch.Tensor and torch.equal(out, y * 2 + 1)
    lin = torch.nn.Linear(32, 48)
    for fmt in ("fp8", "int8", "nvfp4"):
        ql = QuantLinear.from_linear(lin, fmt)
        got = ql(p)
        assert dispatch.runs()[ql.kernel_tag].impl.endswith("(input codes from its producer)") == (fmt == "fp8")
        assert torch.equal(got, ql(y)), fmt  # the same codes (fp8), or its own quantize of the value (the others)
    # codes alone (the producer wrote no y): a linear of its format takes the codes; anything that reads y raises
    alone = Prequantized(torch.full_like(y, float("nan")), q.data, q.scale, "fp8", written=False)
    assert torch.equal(QuantLinear.from_linear(lin, "fp8")(alone), QuantLinear.from_linear(lin, "fp8")(y))
    for read in (lambda t: t * 2, lambda t: t.bfloat16(), lambda t: QuantLinear.from_linear(lin, "int8")(t),
                 lambda t: torch.nn.functional.linear(t, lin.weight)):  # fmt: skip
        with pytest.raises(RuntimeError, match="keep_outputs"):
            read(alone)
    assert "codes alone" in repr(alone)
    # a 1x1 convolution's unbatched [C, H, W] input takes a producer's codes as a batched one does
    qc = QuantConv1x1.from_linear(torch.nn.Conv2d(32, 48, 1), "fp8")
    pix = torch.randn(32, 3, 5)
    rows = numerics("fp8").rowwise(pix.permute(1, 2, 0))
    fed = Prequantized(torch.full_like(pix, float("nan")), rows.data.permute(2, 0, 1), rows.scale.permute(2, 0, 1),
                       "fp8", written=False)  # fmt: skip
    assert torch.equal(qc(fed), qc(pix))


BUILDERS = {"flux": build_flux, "sd3": build_sd3, "sana": build_sana, "wan": build_wan, "qwenimage": build_qwenimage,
            "flux2": build_flux2, "sana_video": build_sana_video, "z_image": build_z_image}


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return LazyPipes(tmp_path_factory.mktemp("producers"), BUILDERS)


def _count_quantizes(monkeypatch: pytest.MonkeyPatch, fmt: str) -> list[int]:
    """Count the activation quantizes the linears run themselves: the GEMMs call kernels.<fmt>_quantize_rowwise (the
    INT8 reference, quant.int8.linear, calls quant.int8's own)."""
    calls = [0]
    targets = [(getattr(kernels, fmt), f"{fmt}_quantize_rowwise")] + ([(int8_numerics, "quantize_rowwise")]
                                                                      if fmt == "int8" else [])  # fmt: skip
    def counting(real):  # noqa: ANN001, ANN202
        def counted(x: torch.Tensor):  # noqa: ANN202
            calls[0] += 1
            return real(x)

        return counted

    for mod, name in targets:
        monkeypatch.setattr(mod, name, counting(getattr(mod, name)))
    return calls


@pytest.mark.parametrize(("name", "fmt", "sm"), [("flux", "fp8", None), ("sd3", "int8", None), ("sd3", "fp8", None),
                                                 ("flux", "int8", "80"),
                                                 ("flux", "fp8", "90"), ("sana", "int8", None), ("sana", "fp8", "90"),
                                                 ("wan", "fp8", None), ("wan", "int8", "90"),
                                                 ("qwenimage", "int8", None), ("qwenimage", "fp8", "90"),
                                                 ("flux2", "fp8", None), ("flux2", "int8", "90"),
                                                 ("sana_video", "int8", None),
                                                 ("sana_video", "fp8", "90"), ("z_image", "fp8", None),
                                                 ("z_image", "int8", "90")])  # fmt: skip
def test_a_fused_copy_computes_what_the_unfused_one_does_and_skips_its_consumers_quantizes(name, fmt, sm, pipes,
                                                                                            monkeypatch):  # fmt: skip
    """The real classes' explore copies (tiny FLUX.1, SD3.5 with adaLN modules; SANA, Wan, Qwen-Image, FLUX.2 whose
    blocks modulate inline and get their family's fused forward, FLUX.1's and SD3.5's too; saved and reloaded),
    fused as the family's spec says (through ExploreSpec, as the trainer builds them), under BF16 autocast: the same
    velocity bit for bit as the unfused copy (the producers whose every reader takes the codes write no y: NaN on
    the reference, so a reader the family's list missed would show), with every consumer's own activation quantize
    skipped (counted:
    SANA's FFN convolution too, its codes handed over in NCHW) and its record saying its input codes came from the
    producer; at a simulated GPU the producer ran the Triton kernel. Module names and state dicts are unchanged
    (refreshes match by name)."""
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    if sm:
        monkeypatch.setenv("SOLRL_SIMULATE_SM", sm)
    model = load_model(name, pipes[name], "cpu", torch.bfloat16, resolution=SIZES[name])
    spec = model_spec(name)
    rule = {**spec.explore_rule, **spec.explore_rule_by_format.get(fmt, {})}
    plain = ExploreCopy(model.transformer, fmt, changes=rule)
    fused = ExploreCopy.from_spec(model.transformer, ExploreSpec(fmt, rule, "test", producers=spec.producers,
                                                                 producer_blocks=spec.producer_blocks))  # fmt: skip
    assert fused.producers.fused and not plain.producers.fused
    assert fused.transformer.state_dict().keys() == plain.transformer.state_dict().keys()
    takers = sum(len(v) for v in fused.producers.fused.values())
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red apple", "a blue cup"])
    calls = _count_quantizes(monkeypatch, fmt)
    outs = []
    for copy in (plain, fused):
        calls[0] = 0
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append((model.velocity(x, torch.tensor([0.7, 0.3]), cond, transformer=copy.transformer), calls[0]))
    (a, n_plain), (b, n_fused) = outs
    assert _same(a, b)
    assert n_plain - n_fused == takers, (n_plain, n_fused, takers)
    runs = dispatch.runs()
    assert fused.producers.codes_only  # some producers write their codes alone (on the reference: y all NaN)
    for prod, consumers in fused.producers.fused.items():
        impl = runs[f"{prod} (producer)"].impl
        assert impl.startswith("triton" if sm else "reference")
        assert impl.endswith("codes alone (y unwritten)") == (prod in fused.producers.codes_only), (prod, impl)
        parent = prod.rpartition(".")[0]
        for c in consumers:
            tag = fused.transformer.get_submodule(f"{parent}.{c}").kernel_tag
            assert runs[tag].impl.endswith("(input codes from its producer)"), (tag, runs[tag])


def test_a_producer_whose_rows_the_kernels_cannot_hold_is_left_to_its_linears(pipes, monkeypatch):
    """Rows wider than the fused kernels hold (FLUX.2-dev's 18,432-wide SwiGLU against 16,384) would run the op's
    reference, slower than the consumers' own quantize kernels: the plan leaves such a producer, saying why, and
    fuses the narrower ones."""
    model = load_model("flux", pipes["flux"], "cpu", torch.float32, resolution=SIZES["flux"])
    spec = model_spec("flux")
    wide = ExploreCopy(model.transformer, "fp8", changes={"skip_max_dim": 0}, producers=spec.producers,
                       producer_blocks=spec.producer_blocks).producers  # fmt: skip
    widths = {n: model.transformer.get_submodule(f"{n.rpartition('.')[0]}.{c[0]}").in_features
              for n, c in wide.fused.items()}  # fmt: skip
    cut = min(widths.values()) if len(set(widths.values())) > 1 else None
    assert cut is not None, widths  # the tiny FLUX.1 has norms (hidden width) and FFN GELUs (4x) to tell apart
    monkeypatch.setattr(kernels.producers, "MAX_K", cut)
    got = ExploreCopy(model.transformer, "fp8", changes={"skip_max_dim": 0}, producers=spec.producers,
                      producer_blocks=spec.producer_blocks).producers  # fmt: skip
    assert set(got.fused) == {n for n, w in widths.items() if w <= cut} and got.fused
    for n, w in widths.items():
        if w > cut:
            assert got.left[n] == (f"rows of {w} values: the fused kernels hold at most {cut}, so its linears "
                                   "quantize for themselves")  # fmt: skip


def test_paused_producers_compute_the_unfused_copy_and_resume(pipes, monkeypatch):
    """`paused`: inside, a fused copy's consumers quantize for themselves (counted) and its velocity is the unfused
    copy's bit for bit; after, the producers feed them again (what the GPU session times on one copy)."""
    from solrl_engine.nn.producers import paused

    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    model = load_model("sana", pipes["sana"], "cpu", torch.bfloat16, resolution=SIZES["sana"])
    spec = model_spec("sana")
    copy = ExploreCopy(model.transformer, "int8", changes=spec.explore_rule, producers=spec.producers,
                       producer_blocks=spec.producer_blocks)  # fmt: skip
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red apple", "a blue cup"])
    calls = _count_quantizes(monkeypatch, "int8")

    def run() -> tuple[torch.Tensor, int]:
        calls[0] = 0
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model.velocity(x, torch.tensor([0.7, 0.3]), cond, transformer=copy.transformer), calls[0]

    fused, n_fused = run()
    with paused(copy.transformer, copy.producers):
        plain, n_plain = run()
    again, n_again = run()
    takers = sum(len(v) for v in copy.producers.fused.values())
    assert n_plain - n_fused == takers > 0 and n_again == n_fused
    assert _same(plain, fused) and _same(again, fused)
    unfused = ExploreCopy(model.transformer, "int8", changes=spec.explore_rule)
    calls[0] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert _same(model.velocity(x, torch.tensor([0.7, 0.3]), cond, transformer=unfused.transformer), plain)
    assert calls[0] == n_plain


def test_what_is_not_fused_is_said_and_keeps_the_stock_path(pipes):
    """A pattern naming a module that is no producer class, a copy whose format has no row-wise codes (NVFP4),
    consumers kept in BF16 by the rule: nothing fused, each with its reason. With autograd recording, a fused
    producer computes the stock expression (a plain tensor)."""
    model = load_model("flux", pipes["flux"], "cpu", torch.float32, resolution=SIZES["flux"])
    spec = model_spec("flux")
    nv = ExploreCopy(model.transformer, "nvfp4", changes={"skip_max_dim": 0}, producers=spec.producers)
    assert not nv.producers.fused  # no row-wise codes in NVFP4: nothing to emit
    copy = ExploreCopy(model.transformer, "fp8", changes={"skip_max_dim": 0, "extra_skip": ("*attn.to_*",)})
    got = fuse_producers(copy.transformer, {**spec.producers, "transformer_blocks.*.ff": ("net.2",)})
    assert set(got.fused) == {"single_transformer_blocks.0.norm", "single_transformer_blocks.1.norm",
                              "transformer_blocks.0.norm1_context", "transformer_blocks.1.norm1_context",
                              *(f"transformer_blocks.{i}.{ff}.net.0" for i in (0, 1) for ff in ("ff", "ff_context"))}
    assert got.fused["single_transformer_blocks.0.norm"] == ["proj_mlp"]
    assert got.fused["transformer_blocks.0.ff.net.0"] == ["2"]  # an FFN's GELU module: a producer without blocks
    assert "none of the linears it feeds" in got.left["transformer_blocks.0.norm1"]
    assert "FeedForward is not a producer class" in got.left["transformer_blocks.0.ff"]
    assert "activation whose block (FluxTransformerBlock)" in got.left["transformer_blocks.0.norm2"]
    assert "8 producer(s) emit fp8 codes for 12 linear(s)" in got.summary()
    norm = copy.transformer.get_submodule("single_transformer_blocks.0.norm")
    h = torch.randn(1, 4, norm.norm.normalized_shape[0], requires_grad=True)
    emb = torch.randn(1, norm.linear.in_features)
    y, _ = norm(h, emb=emb)
    assert type(y) is torch.Tensor and y.requires_grad
    with torch.no_grad():
        assert type(norm(h, emb=emb)[0]) is Prequantized


def test_an_inline_producer_needs_its_blocks_fused_forward_and_keeps_the_stock_expression_otherwise(pipes):
    """A LayerNorm a block modulates inline is a producer only where the family gives that block a fused forward
    and the norm has no weight of its own (Wan's cross-attention norm is affine): each left one says why. A fused
    norm given a per-token modulation [B, T, K] (Wan2.2-TI2V's 4-D timestep), or called with autograd recording,
    computes the block's stock expression as a plain tensor; one row per sample gets the codes."""
    from solrl_engine.nn.producers import modulate

    model = load_model("wan", pipes["wan"], "cpu", torch.float32, resolution=SIZES["wan"])
    spec = model_spec("wan")
    copy = ExploreCopy(model.transformer, "int8", changes=spec.explore_rule)
    got = fuse_producers(copy.transformer, {"blocks.*.norm1": ("attn1.to_q",), "blocks.*.norm2": ("attn2.to_q",)})
    assert not got.fused and "activation whose block (WanTransformerBlock)" in got.left["blocks.0.norm1"]
    got = fuse_producers(copy.transformer, {"blocks.*.norm1": ("attn1.to_q",), "blocks.*.norm2": ("attn2.to_q",)},
                         spec.producer_blocks)  # fmt: skip
    assert set(got.fused) == {"blocks.0.norm1", "blocks.1.norm1"}
    assert "an affine LayerNorm" in got.left["blocks.0.norm2"]
    block = copy.transformer.get_submodule("blocks.0")
    assert type(block).__name__ == "WanTransformerBlock" and type(block).forward is spec.producer_blocks[
        "WanTransformerBlock"]  # fmt: skip
    norm = block.norm1
    k = norm.normalized_shape[0]
    x = torch.randn(2, 5, k)
    per_token, per_sample = torch.randn(2, 5, k), torch.randn(2, 1, k)
    y = modulate(norm, x, per_token, per_token, torch.bfloat16)
    assert type(y) is torch.Tensor and torch.equal(y, (norm(x) * (1 + per_token) + per_token).to(torch.bfloat16))
    want = (norm(x) * (1 + per_sample) + per_sample).to(torch.bfloat16)
    # the one linear it feeds takes the codes, so y is not written (NaN on the reference: a reader would show) ...
    assert got.codes_only == {"blocks.0.norm1", "blocks.1.norm1"}
    with torch.no_grad():
        y = modulate(norm, x, per_sample, per_sample, torch.bfloat16)
    assert type(y) is Prequantized and y.dtype == torch.bfloat16 and y.value.isnan().all()
    assert _same(y.codes, numerics("int8").rowwise(want).data)
    # ... until the linear reads its input too (an unmerged LoRA's side branch): then y is written
    assert keep_outputs(copy.transformer, got, {"blocks.0.attn1.to_q": None}) == 1
    assert got.codes_only == {"blocks.1.norm1"}
    with torch.no_grad():
        y = modulate(norm, x, per_sample, per_sample, torch.bfloat16)
    assert torch.equal(y.value, want) and _same(y.codes, numerics("int8").rowwise(y.value).data)
    x.requires_grad_(True)
    assert type(modulate(norm, x, per_sample, per_sample)) is torch.Tensor


def test_a_fused_rms_norm_takes_one_scale_per_sample_and_keeps_the_stock_expression_otherwise(pipes):
    """Z-Image's modulated RMS norms: one scale row per sample gets the codes (of exactly the stock expression's
    value), and so does the norm alone (no scale); a per-token scale [B, T, K] (the edit path's `noise_mask`) or
    autograd recording give the stock expression as a plain tensor. The context refiner's blocks (unmodulated)
    are not producers."""
    from solrl_engine.nn.producers import scaled_rms

    model = load_model("z_image", pipes["z_image"], "cpu", torch.float32, resolution=SIZES["z_image"])
    spec = model_spec("z_image")
    copy = ExploreCopy(model.transformer, "int8", changes=spec.explore_rule, producers=spec.producers,
                       producer_blocks=spec.producer_blocks)  # fmt: skip
    assert not any(n.startswith("context_refiner") and "norm" in n for n in copy.producers.fused)
    norm = copy.transformer.get_submodule("layers.0.attention_norm1")
    k = norm.weight.shape[0]
    x = torch.randn(2, 5, k)
    per_token, per_sample = 1 + torch.randn(2, 5, k), 1 + torch.randn(2, 1, k)
    y = scaled_rms(norm, x, per_token)
    assert type(y) is torch.Tensor and torch.equal(y, norm(x) * per_token)
    with torch.no_grad():
        y = scaled_rms(norm, x, per_sample)
        bare = scaled_rms(norm, x, None)
    # q, k and v take the codes (Z-Image's int8 rule quantizes them): y is not written, NaN on the reference
    assert "layers.0.attention_norm1" in copy.producers.codes_only
    assert type(y) is Prequantized and y.value.isnan().all() and type(bare) is Prequantized
    assert _same(y.codes, numerics("int8").rowwise(norm(x) * per_sample).data)
    assert _same(bare.codes, numerics("int8").rowwise(norm(x)).data)
    keep_outputs(copy.transformer, copy.producers, ["layers.0.attention.to_q"])
    with torch.no_grad():
        y = scaled_rms(norm, x, per_sample)
        bare = scaled_rms(norm, x, None)
    assert type(y) is Prequantized and torch.equal(y.value, norm(x) * per_sample)
    assert _same(y.codes, numerics("int8").rowwise(y.value).data)
    assert type(bare) is Prequantized and torch.equal(bare.value, norm(x))
    x.requires_grad_(True)
    assert type(scaled_rms(norm, x, per_sample)) is torch.Tensor


def _flux_fp8_copies(pipes: LazyPipes, changes: dict | None = None) -> tuple[Any, ExploreCopy, ExploreCopy]:
    """Tiny FLUX.1 in FP32 and two FP8 explore copies of it under its rule (with `changes`): unfused, fused."""
    model = load_model("flux", pipes["flux"], "cpu", torch.float32, resolution=SIZES["flux"])
    spec = model_spec("flux")
    rule = {**spec.explore_rule, **(changes or {})}
    plain = ExploreCopy(model.transformer, "fp8", changes=rule)
    fused = ExploreCopy(model.transformer, "fp8", changes=rule, producers=spec.producers,
                        producer_blocks=spec.producer_blocks)  # fmt: skip
    return model, plain, fused


def _velocity(model: Any, copy: ExploreCopy) -> torch.Tensor:
    """One velocity of `copy` on fixed latents and prompts."""
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model.velocity(x, torch.tensor([0.7, 0.3]), model.encode_prompts(["a red apple", "a blue cup"]),
                              transformer=copy.transformer)  # fmt: skip


def test_a_producer_feeding_a_linear_left_in_bf16_writes_its_output(pipes):
    """A producer some of whose linears a rule leaves in BF16 (here every to_q of FLUX.1) writes y beside the codes
    (the BF16 linear reads y); the others write their codes alone; the copy computes what the unfused one does."""
    model, plain, fused = _flux_fp8_copies(pipes, {"extra_skip": ("*attn.to_q",)})
    partial = {"transformer_blocks.0.norm1", "single_transformer_blocks.0.norm"}
    assert partial <= set(fused.producers.fused) and not partial & fused.producers.codes_only
    assert "transformer_blocks.0.norm1_context" in fused.producers.codes_only
    a, b = (_velocity(model, c) for c in (plain, fused))
    assert torch.isfinite(b).all() and _same(a, b)


def test_an_unmerged_loras_side_branch_makes_the_producers_it_reads_write_their_output(pipes):
    """merge_lora=False: the copy's LoRA layers add a BF16 side branch that reads their input, so the producers
    feeding them write y again (keep_outputs, on attach), and only those; the fused copy computes what the unfused
    one does, bit for bit (a codes-only y is NaN on the reference: a side branch reading it would show)."""
    from solrl_engine.rl.adapters import OLD, LoraAdapters

    model, plain, fused = _flux_fp8_copies(pipes)
    ad = LoraAdapters(model.transformer, 4, 8, ("attn.to_q", "ff.net.2"))
    with torch.no_grad():
        for p in ad.params(OLD)[1::2]:  # a nonzero "old" B: the side branch adds something
            p.normal_(0, 0.5)
    before = set(fused.producers.codes_only)
    for copy in (plain, fused):
        copy.attach(ad, merge=False)
    blocks = len(model.transformer.transformer_blocks)
    read = {f"transformer_blocks.{i}.{n}" for i in range(blocks) for n in ("norm1", "ff.net.0")}
    read |= {f"single_transformer_blocks.{i}.norm" for i in range(len(model.transformer.single_transformer_blocks))}
    assert before - fused.producers.codes_only == read
    assert fused.producers.codes_only  # the others (the context stream's, the single blocks' GELU) still do not
    a, b = (_velocity(model, c) for c in (plain, fused))
    assert torch.isfinite(b).all() and _same(a, b)


def test_a_hook_reading_a_fed_layers_input_is_told_how_to_keep_the_producers_output(pipes):
    """A user's hook on a linear whose producer writes its codes alone would read memory nobody wrote: it raises,
    naming keep_outputs, which makes that producer write its output again."""
    model, _, fused = _flux_fp8_copies(pipes)
    seen = []
    fused.transformer.get_submodule("transformer_blocks.0.attn.to_k").register_forward_pre_hook(
        lambda _m, inp: seen.append(inp[0].float().abs().mean()))  # fmt: skip
    with pytest.raises(RuntimeError, match="keep_outputs"):
        _velocity(model, fused)
    assert keep_outputs(fused.transformer, fused.producers, ["transformer_blocks.0.attn.to_k"]) == 1
    assert torch.isfinite(_velocity(model, fused)).all() and torch.isfinite(seen[-1])


def test_every_family_running_a_block_class_with_a_fused_forward_declares_its_producers():
    """A family whose repeated blocks are a class some family fuses (FLUX.1 Kontext runs FLUX.1's blocks, Wan I2V
    Wan's, the Qwen editors Qwen-Image's) declares the same producers and fused forwards: a family added later
    cannot silently explore without them."""
    from solrl_engine.models import MODELS

    specs = [model_spec(n) for n in MODELS]
    fused = {cls: fwd for s in specs for cls, fwd in s.producer_blocks.items()}
    for s in specs:
        for cls in set(s.repeated_blocks) & set(fused):
            assert s.producer_blocks.get(cls) is fused[cls], (s.name, cls)
            assert s.producers, s.name
