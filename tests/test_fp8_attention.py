"""explore_attention=fp8: the FP8 attention's operands and reference (quant.fp8), its Triton kernel (under the
interpreter), and the explore copy running it, or INT8's (SageAttention's recipe), where the device can (the
fast-path record says which ran); key-padding masks through both kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_TRITON
from families import families
from torch import nn

from solrl_engine.quant import fp8

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install -e '.[dev]')")

# (batch x heads, queries, keys, head dim): query and key counts below, at and across the 128-query and 64-key tiles
SHAPES = [(2, 130, 70, 64), (1, 5, 200, 16), (3, 128, 64, 32), (1, 1, 1, 128), (1, 70, 130, 112)]


def _qkv(shape: tuple[int, int, int, int], seed: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Input kind -> (q, k, v) [1, bh, tokens, d] drawn from the numerics tests' families (each its own draw)."""
    bh, n, m, d = shape
    out: dict[str, list[torch.Tensor]] = {}
    for i, (rows, s) in enumerate(((n, seed), (m, seed + 1), (m, seed + 2))):
        for kind, x in families((1, bh, rows, d), seed=s + 17 * i):
            out.setdefault(kind, []).append(x)
    return {kind: tuple(t) for kind, t in out.items() if kind != "ties"}  # ties are an NVFP4 concern


def test_operands_scale_q_and_k_per_token_v_per_channel_and_poison_non_finite_rows():
    """q and k take the linear's row-wise rule (a scale per token and head), v one scale per channel over all its
    tokens (stored transposed); a row (of q or k) or channel (of v) holding a NaN or an Inf has a NaN scale."""
    q, k, v = _qkv((2, 130, 70, 64), seed=3)["gaussian"]
    qt, kt, vt = fp8.attention_operands(q, k, v)
    for t, x in ((qt, q), (kt, k)):
        ref = fp8.quantize_rowwise(x)
        assert torch.equal(t.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(t.scale, ref.scale)
    ref = fp8.quantize_rowwise(v.transpose(-1, -2))
    assert vt.data.shape == (1, 2, 64, 70) and torch.equal(vt.scale, ref.scale)
    q, k, v = q.clone(), k.clone(), v.clone()
    q[0, 1, 7, 3], k[0, 0, 9, 0], v[0, 1, 40, 5] = float("nan"), float("inf"), float("-inf")
    qt, kt, vt = fp8.attention_operands(q, k, v)
    assert torch.isnan(qt.scale).nonzero().tolist() == [[0, 1, 7, 0]]
    assert torch.isnan(kt.scale).nonzero().tolist() == [[0, 0, 9, 0]]
    assert torch.isnan(vt.scale).nonzero().tolist() == [[0, 1, 5, 0]]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_near_exact_attention_and_non_finite_reaches_where_it_would(shape):
    """The reference (E4M3 Q K^T, FP32 online softmax over 64-key blocks, E4M3 P V) on every input kind: within a
    few percent of the exact attention of its decoded operands (P's rounding), and of exact attention itself where
    the scores are moderate (outlier channels in q and k make logits of 1e4, whose argmax any 8-bit, or BF16,
    rounding moves). A NaN or Inf in the inputs leaves the output NaN wherever exact attention's is NaN or
    infinite, and on every row and channel it reaches: an Inf in a key, which exact attention may weigh 0 for some
    queries, has no E4M3 code, so its row is NaN as the linears' FP8 makes it (visible, never a finite guess)."""
    for kind, (q, k, v) in _qkv(shape, seed=sum(shape)).items():
        got = fp8.attention(q, k, v)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
        assert got.shape == exact.shape and got.dtype == q.dtype
        if kind == "nonfinite":
            assert (torch.isnan(got) >= ~torch.isfinite(exact)).all() and torch.isnan(got).any(), kind
            continue
        assert torch.isfinite(got).all(), kind
        emulated = F.scaled_dot_product_attention(*(t.double() for t in fp8.attention_rounding(q, k, v))).float()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

        assert rel(got, emulated) < 0.05, (kind, rel(got, emulated))
        logits = (q @ k.transpose(-1, -2)).abs().amax() * shape[-1] ** -0.5
        if logits < 30:
            assert rel(got, exact) < 0.1, (kind, rel(got, exact))


def test_p_is_what_the_reference_rounds_beyond_the_operands(monkeypatch):
    """Over many keys the reference's only rounding beyond its operands' is P's: it stands a percent or two from
    the exact attention of the decoded operands, and with P's encode made exact it lands on it."""
    q, k, v = _qkv((2, 64, 512, 64), seed=5)["gaussian"]
    emulated = F.scaled_dot_product_attention(*(t.double() for t in fp8.attention_rounding(q, k, v)))
    rel = ((fp8.attention(q, k, v).double() - emulated).norm() / emulated.norm()).item()
    assert 1e-3 < rel < 0.05, rel
    monkeypatch.setattr(fp8, "_p_codes", lambda p: p * fp8.P_ENCODE)  # P scaled, not rounded
    unrounded = fp8.attention(q, k, v).double()
    assert (unrounded - emulated).norm() / emulated.norm() < 1e-5


@needs_triton
@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over a poisoned row
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_fp8_attention_matches_its_reference(shape):
    """The Triton kernel (Q K^T and P V on the FP8 tensor cores, under the interpreter here) against
    quant.fp8.attention on every input kind, FP32, BF16 and FP16 out: the same codes, scales and key blocks, so
    only the sums' order and exp's last bit differ; NaN exactly where the reference has NaN."""
    tr = pytest.importorskip("solrl_triton.attention")
    d = shape[-1]
    for i, (kind, (q, k, v)) in enumerate(_qkv(shape, seed=11 * sum(shape)).items()):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        qt, kt, vt = fp8.attention_operands(q, k, v)
        got = tr.fp8_attention(qt.data, qt.scale, kt.data, kt.scale, vt.data, vt.scale, d**-0.5, dtype,
                               fp8.P_ENCODE).float()  # fmt: skip
        want = fp8.attention(q, k, v).float()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), kind
        ok = ~torch.isnan(want)
        if not ok.any():  # an Inf key poisons every query of its head
            continue
        rng = want[ok].abs().amax().clamp_min(1e-30)
        diff = (got - want)[ok].abs() / rng
        out_ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
        # nearly every element agrees to the sums' order (and the output's rounding); exp's last bit may move a
        # P code a step on some CPU, which moves its row by a part in a few hundred, never more
        assert diff.quantile(0.99) <= 1e-4 + 2 * out_ulp and diff.max() <= 2e-3 + 2 * out_ulp, (kind, dtype)


@needs_triton
@pytest.mark.parametrize("d", [112, 72, 8])
def test_attention_kernels_take_any_head_dim_up_to_256(d, monkeypatch):
    """A head dim that is not a power of two (SANA-Video's 112) runs padded to one in registers, the padded channels
    zero and never stored: both kernels match their references as at a power of two; past 256 they refuse, and
    dispatch then chooses the reference and says why."""
    from solrl_engine.kernels import dispatch
    from solrl_engine.quant import int8

    tr = pytest.importorskip("solrl_triton.attention")
    q, k, v = _qkv((2, 130, 70, d), seed=d)["gaussian"]
    qt, kt, vt = fp8.attention_operands(q, k, v)
    got = tr.fp8_attention(qt.data, qt.scale, kt.data, kt.scale, vt.data, vt.scale, d**-0.5, torch.float32)
    want = fp8.attention(q, k, v)
    assert got.shape == want.shape and ((got - want).abs() / want.abs().amax()).max() <= 2e-3
    qi, ki = int8.quantize_blocks(q, int8.Q_BLOCK), int8.quantize_blocks(int8.smooth_k(k), int8.K_BLOCK)
    got = tr.int8_attention(qi.data, qi.scale, ki.data, ki.scale, v, d**-0.5, torch.float32)
    want = int8.attention(q, k, v)
    assert got.shape == want.shape and (got - want).abs().max() < 2e-2 * want.abs().max()
    codes, sc = torch.zeros(1, 4, 264, dtype=torch.float8_e4m3fn), torch.ones(1, 4, 1)
    with pytest.raises(ValueError, match="head dims up to 256"):
        tr.fp8_attention(codes, sc, codes, sc, codes.transpose(-1, -2), torch.ones(1, 264, 1), 1.0, torch.float32)
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")  # a GPU with FP8 tensor cores: only the head dim passes Triton over
    why = dispatch.choose("fp8_attention", "cpu", d=264)[1]
    assert why.startswith("reference") and "takes head dims up to 256; got 264" in why, why


def _padding(bh: int, m: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the SDPA mask [1, bh, 1, m], the same as an additive key bias [1, bh, m]): each row keeps a random number of
    leading keys, at least one, and the first head drops its first 70 (a whole 64-key block masked before any key
    is kept); `kind` "bool" (False drops a key) or "additive" (SANA's -10000)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(m)[None, :] < torch.randint(1, m + 1, (bh, 1), generator=g)
    keep[0] = torch.arange(m) >= min(70, m - 1)
    if kind == "bool":
        return keep[None, :, None, :], torch.zeros(1, bh, m).masked_fill(~keep[None], float("-inf"))
    add = torch.zeros(1, bh, m).masked_fill(~keep[None], -10000.0)
    return add[:, :, None, :], add


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_key_padding_bias_reads_masks_that_mask_keys_only(kind):
    from solrl_engine.explore.copy import key_padding_bias

    q, k = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 20, 16)
    mask, _ = _padding(3, 20, kind, seed=1)
    for m in (mask, mask[:, :1], mask[0, 0]):  # per head, broadcast over heads, one row for all
        bias = key_padding_bias(m.expand(2, *m.shape[1:]) if m.dim() == 4 else m, q, k)
        want = m.float() if kind == "additive" else torch.zeros(m.shape).masked_fill(~m, float("-inf"))
        assert bias.shape == (2, 3, 20) and torch.equal(bias, want.squeeze(-2).expand(2, 3, 20)), m.shape
    assert key_padding_bias(None, q, k) is None
    assert key_padding_bias(torch.ones(10, 20, dtype=torch.bool), q, k) is None  # a per-query mask
    assert key_padding_bias(torch.ones(2, 3, 1, 19, dtype=torch.bool), q, k) is None  # not the keys' length
    assert key_padding_bias(torch.ones(4, 3, 1, 20, dtype=torch.bool), q, k) is None  # batches that do not match


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_references_take_a_key_padding_mask_as_exact_attention_does(fmt, kind):
    """With a key-padding mask (as an additive bias over the keys) each reference stays near exact attention under
    the same mask, and a row whose first key block is wholly masked is finite. The masked keys' values weigh
    nothing: INT8's output does not move when they do (FP8's V channel scales see them, so FP8's may)."""
    from solrl_engine.quant import int8

    reference = {"fp8": fp8.attention, "int8": int8.attention}[fmt]
    q, k, v = _qkv((3, 130, 150, 32), seed=4)["gaussian"]
    mask, bias = _padding(3, 150, kind, seed=2)
    got = reference(q, k, v, None, bias)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.expand(1, 3, 130, 150)
                                           if kind == "bool" else mask.double())  # fmt: skip
    assert torch.isfinite(got).all()
    assert (got - exact).norm() / exact.norm() < 0.1, (got - exact).norm() / exact.norm()
    v2 = v.clone()
    v2[0, 0, :70] = 1e3  # the masked keys' values: their weight is 0 (V's FP8 channel scales do see them)
    if fmt == "int8":
        assert torch.equal(reference(q, k, v2, None, bias)[0, 0], got[0, 0])


@needs_triton
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_triton_attention_kernels_take_a_key_padding_bias(kind):
    """Both Triton kernels with a key bias against their references: the same agreement as without (FP8: the sums'
    order; INT8: the softmax's order and P's FP16 rounding), a wholly masked first key block included."""
    from solrl_engine.quant import int8

    tr = pytest.importorskip("solrl_triton.attention")
    q, k, v = _qkv((3, 130, 150, 32), seed=6)["gaussian"]
    _, bias = _padding(3, 150, kind, seed=3)
    qt, kt, vt = fp8.attention_operands(q, k, v)
    got = tr.fp8_attention(qt.data, qt.scale, kt.data, kt.scale, vt.data, vt.scale, 32**-0.5, torch.float32,
                           fp8.P_ENCODE, bias)  # fmt: skip
    want = fp8.attention(q, k, v, None, bias)
    assert ((got - want).abs() / want.abs().amax()).quantile(0.99) <= 1e-4
    assert ((got - want).abs() / want.abs().amax()).max() <= 2e-3
    qi, ki = int8.quantize_blocks(q, int8.Q_BLOCK), int8.quantize_blocks(int8.smooth_k(k), int8.K_BLOCK)
    got = tr.int8_attention(qi.data, qi.scale, ki.data, ki.scale, v, 32**-0.5, torch.float32, bias)
    want = int8.attention(q, k, v, None, bias)
    assert torch.isfinite(got).all() and (got - want).abs().max() < 2e-2 * want.abs().max()


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(*x.shape[:2], 3, 4, 16).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(*x.shape))


# format -> (its Triton kernel's record, the simulated sm where it runs, kernel vs reference after the layer, the
# reference's distance from exact attention)
KERNEL = {"fp8": ("triton: FP8 Q K^T, FP8 P V attention", "90", 5e-3, 0.08),
          "int8": ("triton: INT8 Q K^T, FP16 P V attention", "80", 2e-2, 0.05)}


@needs_triton
@pytest.mark.parametrize("fmt", sorted(KERNEL))
def test_explore_attention_runs_its_kernel_where_it_can_and_the_reference_elsewhere(fmt, monkeypatch):
    """explore_attention=fp8 / int8 on an explore copy: at a simulated GPU with the format's tensor cores (Triton under
    the interpreter; FP8 from sm_89, INT8 from sm_80) every plain attention call runs the format's Triton kernel,
    elsewhere (a plain CPU; FP8 at sm_80) its reference. The record says which ran and why; kernel and reference
    agree to the sums' order; a per-query mask is emulated (no op runs), a key-padding mask goes to the kernel;
    under torch.compile the op stays whole (no graph break) and gives the eager numbers."""
    from torch._dynamo.utils import counters

    from solrl_engine.explore.copy import ATTENTION_TAG, ExploreCopy
    from solrl_engine.kernels import dispatch

    kernel, from_sm, agree, near = KERNEL[fmt]
    torch.manual_seed(0)
    net, x = _Attn(), torch.randn(2, 150, 64)
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    outs = {}
    for sm in ("", "80", "90"):
        if sm:
            monkeypatch.setenv("SOLRL_SIMULATE_SM", sm)
        else:
            monkeypatch.delenv("SOLRL_SIMULATE_SM", raising=False)
        copy = ExploreCopy(net, fmt, changes={"skip": ("*",)})  # no linear quantized: attention alone
        copy.set_attention(fmt)
        assert copy.attention_ran().startswith("emulated")  # nothing ran yet: the last copy's record is forgotten
        with torch.no_grad():
            outs[sm] = copy.transformer(x)
        ran = dispatch.runs().get(ATTENTION_TAG)
        assert ran is not None and ran.impl == (kernel if sm and sm >= from_sm else "reference"), (sm, ran)
        assert copy.attention_ran() == ran.impl
    if fmt == "fp8":  # at sm_80 the reference, and the choice says why
        monkeypatch.setenv("SOLRL_SIMULATE_SM", "80")
        why = dispatch.choose("fp8_attention", "cpu", d=16)[1]
        assert why.startswith("reference") and "triton: sm_80 has no FP8 tensor cores" in why, why
        monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    with torch.no_grad():
        exact = net(x)
    assert torch.equal(outs["80"], outs["" if fmt == "fp8" else "90"])
    assert (outs["90"] - outs[""]).abs().max() < agree * outs[""].abs().max()
    assert 0 < (outs[""] - exact).norm() / exact.norm() < near
    dispatch.forget_run(ATTENTION_TAG)
    with torch.no_grad():
        masked = copy.transformer(x, torch.ones(150, 150, dtype=torch.bool))  # masked: emulated, no kernel
    assert ATTENTION_TAG not in dispatch.runs() and copy.attention_ran().startswith("emulated")
    assert (masked - outs["90"]).norm() / outs["90"].norm() < near
    pad = torch.ones(2, 1, 1, 150, dtype=torch.bool)  # a key-padding mask (SANA's, Qwen-Image's kind): the kernel
    pad[1, ..., 100:] = False
    with torch.no_grad():
        padded, exact_padded = copy.transformer(x, pad), net(x, pad)
    assert dispatch.runs()[ATTENTION_TAG].impl == kernel
    assert torch.equal(padded[0], outs["90"][0])  # the sample with nothing padded: as unmasked, bit for bit
    assert (padded - exact_padded).norm() / exact_padded.norm() < near
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = torch.compile(copy.transformer.forward, backend="eager")
        got, got_padded = compiled(x), compiled(x, pad)
    assert dict(counters["graph_break"]) == {} and torch.equal(got, outs["90"]) and torch.equal(got_padded, padded)
    torch._dynamo.reset()


def test_fp8_attention_is_refused_at_plan_time_where_the_gpu_has_no_fp8_tensor_cores():
    """An A100 (sm_80) would run explore_attention=fp8 through the reference at a crawl: refused when the run is
    planned, naming what it can run; an H100 takes it."""
    from solrl_engine.explore.plan import ExploreSettings, device_problems

    (field, why), = device_problems(ExploreSettings(precision="int8", attention="fp8"), (8, 0))
    assert field == "attention" and "sm_80 has no FP8 tensor cores" in why and "bf16 or int8" in why
    assert device_problems(ExploreSettings(precision="fp8", attention="fp8"), (9, 0)) == []
