"""bench/predict.py: the meta-device FLOP count agrees with hooks on a real model, the roofline takes
the slower bound, the ratios follow the explore speed, and the JSON carries its assumptions."""

import json

import pytest
import torch
from bench_scripts import load_bench

from solrl_engine.models import ARCH_ALIASES, load_model
from solrl_engine.nn.flops import count_linear_flops

# tiny configs of the three families: the GPU session's smoke configs, by family name
_SESSION = load_bench("session_common")
TINY = {ARCH_ALIASES[alias]: arch for alias, arch in _SESSION.TINY.items()}
RES = {ARCH_ALIASES[alias]: res for alias, res in _SESSION.TINY_RES.items()}


@pytest.fixture(scope="module")
def predict():
    return load_bench("predict")


@pytest.mark.parametrize("family", sorted(TINY))
def test_meta_linear_flops_match_hooks_on_a_real_cpu_model(predict, family):
    """The dispatch-level count on meta (torch's flop formulas on aten ops) and count_linear_flops'
    module hooks on a real FP32 CPU model of the same config are two independent counts: they agree
    per layer group, and the attention FLOPs follow 2 x 2 x B x heads x T^2 x head_dim."""
    batch = 3
    meta = predict.build_meta_model(family, TINY[family], RES[family])
    assert next(meta.transformer.parameters()).device.type == "meta"
    ops = predict.profile_forward(meta, batch)
    got = {c.group: c.flops for c in ops if c.kind == "linear"}

    torch.manual_seed(0)
    real = load_model(family, "random", dtype=torch.float32, resolution=RES[family], arch=TINY[family])
    x, t, cond = predict.forward_inputs(real, batch, device="cpu", dtype=torch.float32)
    want = count_linear_flops(real.transformer, lambda: real.velocity(x, t, cond)).by_group()
    assert got == pytest.approx(want, rel=1e-9)
    assert sum(want.values()) > 0

    attn = sum(c.flops for c in ops if c.kind == "attention")
    if family == "sd3":  # joint attention over image + text tokens in every block
        cfg = real.transformer.config
        tokens = (RES[family] // 8 // cfg.patch_size) ** 2 + real.TEXT_TOKENS
        heads, dim = cfg.num_attention_heads, cfg.attention_head_dim
        assert attn == 2 * 2 * batch * heads * tokens**2 * dim * cfg.num_layers


def test_quantized_layers_follow_the_family_rule(predict):
    meta = predict.build_meta_model("sd3", TINY["sd3"], RES["sd3"])
    q = predict.explore_layers(meta, "sd3", "fp8")
    assert q and all(".ff." in n and "ff_context" not in n for n in q)  # SD3.5-L's rule: image-stream MLPs


def test_roofline_takes_the_slower_bound(predict):
    assert predict.roofline(1e12, 1e9, rate=1e12, bandwidth=1e12) == pytest.approx(1.0)  # compute-bound
    assert predict.roofline(1e9, 4e12, rate=1e12, bandwidth=1e12) == pytest.approx(4.0)  # memory-bound
    assert predict.roofline(0, 2e12, rate=1e12, bandwidth=1e12) == pytest.approx(2.0)


def _device(predict, low_rate: float):
    return predict.Device("X", {"bf16": 1e12, "fp8": low_rate}, 1e12, {"fp8": 0.5}, "fp8", False, "test")


def test_explore_attention_is_priced_by_the_products_its_kernel_runs_low(predict):
    """explore_attention=fp8's kernel runs Q K^T and P V (equal halves of attention's FLOPs) on FP8 tensor cores
    from 1-byte q, k, v; SageAttention's INT8 runs Q K^T in INT8 and P V in FP16 (BF16's rate) from 2-byte V. So a
    compute-bound attention at twice BF16's rate takes 1/2 of BF16's time in FP8 and 3/4 in INT8; a memory-bound
    one moves (3 x 1 + 2) / 8 of BF16's bytes in FP8 and (2 x 1 + 2 + 2) / 8 in INT8."""
    dev = predict.Device("X", {"bf16": 1e12, "fp8": 2e12, "int8": 2e12}, 1e12, {}, "fp8", False, "test")
    compute = [predict.OpCost("blocks.*.attn1", "attention", flops=4e12, bytes=1e9)]
    memory = [predict.OpCost("blocks.*.attn1", "attention", flops=1e6, bytes=8e12)]

    def t(ops: list, att: str) -> float:
        return predict.forward_seconds(ops, dev, "fp8", set(), attention=att)

    assert [t(compute, a) for a in ("bf16", "fp8", "int8")] == pytest.approx([4.0, 2.0, 3.0])
    assert [t(memory, a) for a in ("bf16", "fp8", "int8")] == pytest.approx([8.0, 5.0, 6.0])


def test_quantized_gemms_are_priced_at_the_low_precision_rate(predict):
    rows, kin, kout = 64, 128, 256
    elems = dict(in_elems=rows * kin, weight_elems=kin * kout, out_elems=rows * kout)
    c = predict.OpCost("blocks.*.ff", "linear", flops=2 * rows * kin * kout, bytes=2 * sum(elems.values()),
                       layers={"blocks.0.ff"}, **elems)  # fmt: skip
    fast, slow = _device(predict, 4e12), _device(predict, 0.5e12)
    bf16 = predict.forward_seconds([c], fast, "bf16", set())
    assert predict.forward_seconds([c], fast, "bf16", {"blocks.0.ff"}) == bf16  # BF16: nothing quantized
    q_fast = predict.group_times([c], fast, "fp8", {"blocks.0.ff"})
    assert set(q_fast) == {"blocks.*.ff [linear] fp8", "blocks.*.ff [quantize fp8]"}
    assert q_fast["blocks.*.ff [linear] fp8"]["s"] < bf16
    # the quantize pass reads BF16 and writes one byte per element at half the bandwidth
    assert q_fast["blocks.*.ff [quantize fp8]"]["s"] == pytest.approx(64 * 128 * 3 / 0.5e12)
    assert predict.forward_seconds([c], slow, "fp8", {"blocks.0.ff"}) > bf16
    # fused: the quantize pass and elementwise work cost nothing
    e = predict.OpCost("blocks.*.norm", "elementwise", bytes=1e9)
    assert predict.forward_seconds([c, e], fast, "fp8", {"blocks.0.ff"}, fused=True) == pytest.approx(
        q_fast["blocks.*.ff [linear] fp8"]["s"])  # fmt: skip


def test_a_producer_writes_its_codes_once_in_place_of_its_linears_quantize_passes(predict, monkeypatch):
    """Eager explore with the trainer's fused producers: a linear fed by one has no quantize pass of its own, and
    its producer writes one byte per element once for all the linears it feeds (q, k, v: one write, not three
    passes that read BF16 and write codes); a linear with no producer keeps its pass."""
    rows, k = 64, 128
    elems = dict(in_elems=2 * rows * k, weight_elems=2 * k * k, out_elems=2 * rows * k)  # two blocks' layers
    qkv = [predict.OpCost(f"blocks.*.attn.to_{n}", "linear", flops=1.0, bytes=1.0, **elems,
                          layers={f"blocks.{b}.attn.to_{n}" for b in (0, 1)}) for n in "qkv"]  # fmt: skip
    out = predict.OpCost("blocks.*.attn.to_out", "linear", flops=1.0, bytes=1.0, **elems,
                         layers={"blocks.0.attn.to_out", "blocks.1.attn.to_out"})  # fmt: skip
    layers = {n for c in [*qkv, out] for n in c.layers}
    produced = {f"blocks.{b}.attn.to_{n}": (f"blocks.{b}.norm1", False) for b in (0, 1) for n in "qkv"}
    dev = _device(predict, 4e12)
    plain = predict.group_times([*qkv, out], dev, "fp8", layers)
    fused = predict.group_times([*qkv, out], dev, "fp8", layers, produced=produced)
    assert {k for k in plain if "quantize" in k} == {f"{c.group} [quantize fp8]" for c in [*qkv, out]}
    assert {k for k in fused if "quantize" in k or "producer" in k} == {"blocks.*.attn.to_out [quantize fp8]",
                                                                         "blocks.*.attn.to_q [producer codes fp8]"}
    assert fused["blocks.*.attn.to_q [producer codes fp8]"]["bytes"] == 2 * rows * k  # two norms, one byte each
    saved = sum(v["s"] for v in plain.values()) - sum(v["s"] for v in fused.values())
    assert saved == pytest.approx((3 * 2 * rows * k * 3 - 2 * rows * k) / 0.5e12)
    # a forward split over ranks (context parallelism) is priced with the same producers
    monkeypatch.setitem(predict.LINK_BANDWIDTH, dev.name, 1e10)
    split = predict.context_parallel([*qkv, out], dev, "fp8", layers, 4, produced=produced)
    assert split["compute_s"] == pytest.approx(sum(v["s"] for v in fused.values()) / 4)
    # producers whose y no op reads (codes alone) do not write it: its BF16 bytes come off the elementwise work
    alone = predict.group_times([*qkv, out], dev, "fp8", layers, produced={n: (p, True) for n, (p, _) in
                                                                          produced.items()})  # fmt: skip
    assert set(alone) - set(fused) == {"blocks.*.attn.to_q [elementwise saved: y unwritten]"}
    assert alone["blocks.*.attn.to_q [elementwise saved: y unwritten]"]["bytes"] == -2 * rows * k * 2
    assert sum(v["s"] for v in fused.values()) - sum(v["s"] for v in alone.values()) == pytest.approx(
        2 * rows * k * 2 / dev.bandwidth)  # fmt: skip


def test_the_meta_models_producers_are_the_trainers(predict):
    """producer_fed plans on the meta model what the explore copy fuses: FLUX.1's FP8 copy feeds its attention
    projections and FFN linears from producers; NVFP4 has no row-wise codes."""
    meta = predict.build_meta_model("flux", TINY["flux"], RES["flux"])
    q = predict.explore_layers(meta, "flux", "fp8")
    fed = predict.producer_fed(meta, "flux", "fp8", q)
    assert fed and set(fed) <= q
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2",
            "single_transformer_blocks.0.proj_mlp"} <= set(fed)  # fmt: skip
    assert fed["transformer_blocks.0.ff.net.2"] == ("transformer_blocks.0.ff.net.0", True)  # its one reader: codes
    assert all(alone for _, alone in fed.values())  # FLUX.1's FP8 copy quantizes every linear its producers feed
    assert predict.producer_fed(meta, "flux", "nvfp4", predict.explore_layers(meta, "flux", "nvfp4")) == {}


def test_every_layer_prices_a_format_on_every_eligible_layer(predict):
    """--every-layer: SANA's FP8 rule keeps its self-attention in BF16; priced on every eligible layer, the FP8 copy
    quantizes what INT8's rule does (a superset, the self-attention included)."""
    meta = predict.build_meta_model("sana-1.6b", TINY["sana"], RES["sana"])
    own = predict.explore_layers(meta, "sana-1.6b", "fp8")
    every = predict.explore_layers(meta, "sana-1.6b", "fp8", every_layer=True)
    assert own < every == predict.explore_layers(meta, "sana-1.6b", "int8")
    assert "transformer_blocks.0.attn1.to_q" in every - own


@pytest.mark.parametrize("t_explore,faster", [(0.25, True), (1.0, True), (3.0, False)])
def test_sol_rl_ratios_follow_the_explore_forward(predict, t_explore, faster):
    """Sol-RL's rollout beats naive_scaling when its previews are cheap enough; at equal forward
    speed it still wins by its step budget (96 x 10 against 96 x 6 + 24 x 10); a slow proxy loses."""
    it = predict.iteration_seconds(1.0, t_explore, 1.0, 0.5, prompts=6, n=96, k=24, batch=24, preview_steps=6,
                                   full_steps=10, timestep_fraction=0.6, train_batch=16)  # fmt: skip
    naive, sol = it["naive_scaling"], it["sol_rl"]
    assert naive["rollout"] == pytest.approx(24 * 10 * 1.0)
    assert sol["rollout"] == pytest.approx(24 * 6 * t_explore + 6 * 10 * 1.0 + 0.5)
    assert sol["train"] == naive["train"] == pytest.approx(6 * 9 * predict.TRAIN_FORWARDS * 1.0)
    assert (naive["rollout"] / sol["rollout"] > 1) is faster
    assert (naive["total"] / sol["total"] > 1) is faster


def test_h100_rates_come_from_the_recorded_kernels_json(predict):
    dev, taken = predict.h100_from_kernels(predict.KERNELS_JSON)
    rec = json.loads(predict.KERNELS_JSON.read_text())
    bf16 = sorted(g["bf16_mm"]["tflops"] for g in rec["gemms"] if g["gemm"][0] >= 1024)
    assert bf16[0] * 1e12 <= dev.rates["bf16"] <= bf16[-1] * 1e12
    assert dev.rates["fp8"] > dev.rates["bf16"] and dev.measured
    a100 = predict.assumed_device("A100", dev, taken)
    assert not a100.measured and "ASSUMED" in a100.source and a100.explore_precision == "int8"
    assert a100.rates["bf16"] == pytest.approx(312e12 * taken["efficiency_vs_peak"]["bf16"])


def test_script_writes_the_json_with_its_assumptions(predict, tmp_path, capsys):
    """End to end on tiny configs (the full-size ones take a minute of CPU): table, JSON, the measured
    run compared only where its model is predicted."""
    out = tmp_path / "speed.json"
    arch = {"sd35-large": TINY["sd3"], "sana-1.6b": TINY["sana"]}
    res = {"sd35-large": RES["sd3"], "sana-1.6b": RES["sana"]}
    predict.main(["--families", "sd35-large,sana-1.6b", "--batch", "sd35-large=4", "--batch", "sana-1.6b=4",
                  "--train-batch", "2", "--out", str(out)], arch=arch, resolution=res)  # fmt: skip
    rec = json.loads(out.read_text())
    assert any("ASSUMED" in a for a in rec["assumptions"])
    assert rec["devices"]["B200"]["measured"] is False and rec["devices"]["H100"]["measured"] is True
    assert set(rec["families"]) == {"sd35-large", "sana-1.6b"}
    d = rec["families"]["sd35-large"]["devices"]["B200"]
    assert d["explore_precision"] == "nvfp4" and d["quantized_layers"] > 0
    for mode in ("eager", "fused"):
        r = d[mode]["ratios"]["sol_rl"]
        it = d[mode]["iteration_s"]
        assert r["rollout_vs_naive_scaling"] == pytest.approx(it["naive_scaling"]["rollout"] / it["sol_rl"]["rollout"])
    assert [c["model"] for c in rec["measured_vs_predicted"]] == ["sana-1.6b", "sana-1.6b"]
    assert "sd35-large" in capsys.readouterr().out


def test_context_parallel_splits_the_work_and_prices_the_self_attention_all_to_alls(predict, monkeypatch):
    """Ulysses over cp ranks: each rank's compute is 1/cp of the forward, and only the self-attention calls (queries
    and keys of one sequence) exchange bytes, (cp - 1) / cp of each rank's share of q, k, v and the output, at the
    link bandwidth; a cross-attention (text keys) exchanges nothing."""
    ops = [predict.OpCost("blocks.*.attn1", "attention", flops=4e12, bytes=8e9, self_bytes=8e9),
           predict.OpCost("blocks.*.attn2", "attention", flops=1e12, bytes=2e9),
           predict.OpCost("blocks.*.ffn", "linear", flops=8e12, bytes=1e9)]  # fmt: skip
    dev = predict.Device("H100", {"bf16": 1e12}, 1e12, {}, "fp8", False, "test")
    monkeypatch.setitem(predict.LINK_BANDWIDTH, "H100", 1e10)
    whole = predict.forward_seconds(ops, dev, "bf16", set())
    assert whole == pytest.approx(13.0)
    got = predict.context_parallel(ops, dev, "bf16", set(), 4)
    assert got["compute_s"] == pytest.approx(13.0 / 4)
    assert got["comm_s"] == pytest.approx(8e9 / 4 * 3 / 4 / 1e10)  # attn2's bytes not exchanged
    assert got["efficiency"] == pytest.approx(13.0 / (4 * (13.0 / 4 + 0.15)))
    assert predict.context_parallel(ops, dev, "bf16", set(), 1)["comm_s"] == 0.0


def test_an_edit_forward_is_priced_with_its_source_tokens(predict):
    """A conditioned family's stand-in inputs carry its image: Qwen-Image-Edit's forward runs every image-stream
    linear over the latent's tokens and as many of the source's (twice Qwen-Image's), and its text stream over the
    source's vision tokens and the instruction (its TEXT_TOKENS)."""
    arch = dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                axes_dims_rope=(4, 6, 6))  # fmt: skip
    t2i, edit = ({c.group: c.flops for c in predict.profile_forward(predict.build_meta_model(fam, arch, 64), 2)
                  if c.kind == "linear"} for fam in ("qwenimage", "qwenimage_edit"))  # fmt: skip
    for group in ("img_in", "transformer_blocks.*.attn.to_q", "transformer_blocks.*.img_mlp.net.2", "proj_out"):
        assert edit[group] == 2 * t2i[group], group
    text = load_model("qwenimage_edit", "random", dtype=torch.float32, resolution=64, arch=arch).TEXT_TOKENS
    assert edit["txt_in"] * 128 == t2i["txt_in"] * text
