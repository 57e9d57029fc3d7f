"""Per-family layer rules: include patterns, SANA's 1x1 convolutions as linears over channels,
FLUX's skip list, requantize_ from a PEFT-wrapped policy, and the explore refresh refusing LoRA
updates whose layer the copy lacks (fused QKV). Each on tiny hand-built modules and on tiny
diffusers transformers with random weights."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

from solrl_engine.nn import QuantConv1x1, QuantLinear, plan_quantization, quantize_model, requantize_
from solrl_engine.quant.recipe import QuantRecipe, get_recipe

# --- helpers -----------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    """Bit-exact equality of every buffer and parameter (FP8 scales compared as bytes)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k


def _random_lora_b(model: nn.Module, std: float = 0.5) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)


def _quantized(model: nn.Module, recipe: str | QuantRecipe = "nvfp4") -> nn.Module:
    quantize_model(model, recipe)
    return model


def _merged_state(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own merge of the active adapters, under the plain model's names (the reference)."""
    from peft.tuners.lora import LoraLayer

    merged = copy.deepcopy(peft_model)
    for m in merged.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    return {k.replace(".base_layer", ""): v for k, v in merged.state_dict().items() if "lora_" not in k}


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.attn = nn.Linear(64, 64)
        self.ff = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.proj_out = nn.Linear(64, 64)  # an inner proj_out: quantized (only the top-level one is kept)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.proj_out(self.ff(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.time_embed = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([Blk(), Blk()])
        self.proj_out = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.time_embed(x)
        for b in self.blocks:
            x = b(x)
        return self.proj_out(x)


class Convs(nn.Module):
    """Every kind of Conv2d a transformer holds; only the 1x1, stride 1, unpadded, ungrouped ones are
    linears over channels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch_embed = nn.Conv2d(32, 64, 1)  # a 1x1 conv skipped by the *embed* rule
        self.pw = nn.Conv2d(64, 128, 1)
        self.dw = nn.Conv2d(128, 128, 3, padding=1, groups=128)  # depthwise: not a linear
        self.pw_nobias = nn.Conv2d(128, 64, (1, 1), bias=False, padding="same")
        self.strided = nn.Conv2d(64, 64, 1, stride=2)
        self.padded = nn.Conv2d(64, 64, 1, padding=1)
        self.grouped = nn.Conv2d(64, 64, 1, groups=2)
        self.k3 = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pw_nobias(self.dw(self.pw(self.patch_embed(x))))
        return self.k3(self.grouped(self.padded(self.strided(h))))


def _sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=8,
    ).eval()  # fmt: skip


def _sd3_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g),
        timestep=torch.tensor([500.0, 20.0]),
    )


def _sana():
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    return SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                  num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                  cross_attention_dim=32, caption_channels=32, sample_size=4).eval()  # fmt: skip


def _sana_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(2, 4, 4, 4, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        timestep=torch.tensor([500.0, 20.0]),
    )


def _flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip


# --- 1. include patterns ---------------------------------------------------------------------------


def test_include_patterns_on_a_tiny_module():
    rep = quantize_model(Tiny(), QuantRecipe("nvfp4", include=("blocks.*.ff.*",)))
    assert sorted(rep.quantized) == ["blocks.0.ff.0", "blocks.0.ff.2", "blocks.1.ff.0", "blocks.1.ff.2"]
    assert rep.skipped["blocks.0.attn"] == "not matched by include patterns ('blocks.*.ff.*',)"
    # skip patterns win over include: the reason names the skip pattern
    rep = quantize_model(Tiny(), QuantRecipe("nvfp4", include=("*",), skip=("*.ff.2",)))
    assert rep.skipped == {
        "blocks.0.ff.2": "matches skip pattern '*.ff.2'",
        "blocks.1.ff.2": "matches skip pattern '*.ff.2'",
    }
    # empty include: every layer is a candidate
    assert len(quantize_model(Tiny(), QuantRecipe("nvfp4", skip=())).quantized) == 10
    # a family rule is a dict of changes; lists are taken as tuples, typos are errors
    rule = get_recipe("nvfp4").with_(include=["blocks.*.ff.*"], extra_skip=["*.ff.2"], skip_max_dim=0)
    assert rule.include == ("blocks.*.ff.*",) and rule.skip[-1] == "*.ff.2"
    with pytest.raises(TypeError, match="unknown QuantRecipe field"):
        get_recipe("nvfp4").with_(includes=("x",))
    with pytest.raises(TypeError, match="tuples of patterns"):
        QuantRecipe("nvfp4", include="blocks.*")  # type: ignore[arg-type]


def test_include_patterns_on_sd3_and_the_report_summary():
    net = _sd3()
    rep = quantize_model(net, get_recipe("nvfp4").with_(include=("transformer_blocks.*.ff.*",)))
    assert rep.quantized and all(".ff." in n and n.startswith("transformer_blocks.") for n in rep.quantized)
    assert isinstance(net.transformer_blocks[0].ff.net[0].proj, QuantLinear)
    why = rep.skipped["transformer_blocks.0.attn.to_q"]
    assert why == "not matched by include patterns ('transformer_blocks.*.ff.*',)"
    # summary: today's first line, then one count per rule (not per layer), then one per GEMM choice
    lines = rep.summary().splitlines()
    assert lines[0] == str(rep).splitlines()[0] and f"{len(rep.quantized)} of {len(rep.layers)}" in lines[0]
    counts = rep.counts()
    kernels = {d.kernel for d in rep.layers if d.quantized}  # plus one line per GEMM choice
    assert sum(counts.values()) == len(rep.skipped) and len(lines) == 1 + len(counts) + len(kernels)
    n_inc = sum(1 for w in rep.skipped.values() if w.startswith("not matched"))
    assert f"kept in high precision, {n_inc} layer(s): not matched by include patterns" in rep.summary()
    assert len(str(rep).splitlines()) == 1 + len(rep.layers)  # the full listing stays in __str__
    # to_dict: JSON-ready, every decision with its rule and kind
    d = json.loads(json.dumps(rep.to_dict()))
    assert {x["name"] for x in d["layers"]} == {x.name for x in rep.layers}
    assert d["recipe"]["include"] == ["transformer_blocks.*.ff.*"] and d["quantized"] == len(rep.quantized)
    assert d["kept"] == counts and all(x["kind"] == "linear" for x in d["layers"])
    assert all(bool(x["rule"]) != x["quantized"] for x in d["layers"])


# --- 2. 1x1 convolutions ---------------------------------------------------------------------------


def test_conv1x1_eligibility_kinds_and_reasons_on_a_tiny_module():
    m = Convs()
    rep = quantize_model(m, "nvfp4")
    by = {d.name: d for d in rep.layers}
    assert set(by) == {"patch_embed", "pw", "pw_nobias"}  # other convs are not layers of the report
    assert all(d.kind == "conv1x1" for d in rep.layers)
    assert sorted(rep.quantized) == ["pw", "pw_nobias"]
    assert rep.skipped["patch_embed"] == "matches skip pattern '*embed*'" and by["patch_embed"].rule
    assert isinstance(m.pw, QuantConv1x1) and isinstance(m.pw_nobias, QuantConv1x1) and m.pw_nobias.bias is None
    for name in ("patch_embed", "dw", "strided", "padded", "grouped", "k3"):
        assert type(getattr(m, name)) is nn.Conv2d, name
    assert "2 of 3 Linear layers quantized, 2 of them 1x1 convolutions" in rep.summary()
    # the flag turns it off
    m2 = Convs()
    assert not quantize_model(m2, get_recipe("nvfp4").with_(convs_1x1=False)).layers
    assert type(m2.pw) is nn.Conv2d
    # plan_quantization says the same without touching the model
    assert plan_quantization(Convs(), "nvfp4").quantized == rep.quantized


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_weight_only", "fp8", "bf16"])
def test_quant_conv1x1_is_the_quantized_gemm_over_channels(recipe):
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 48, 1)
    qc = QuantConv1x1.from_linear(conv, recipe)
    ql = QuantLinear.from_linear(nn.Linear(64, 48), recipe)
    ql.set_weight_(conv.weight.reshape(48, 64), conv.bias)  # the same buffers from the 2-D view
    for a, b in zip(qc.buffers(), ql.buffers(), strict=True):
        assert torch.equal(_bits(a), _bits(b))
    x = torch.randn(2, 64, 3, 5)
    y = qc(x)
    assert y.shape == (2, 48, 3, 5)
    assert torch.equal(y, ql(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))  # bit for bit the linear over channels
    assert torch.equal(qc(x[0]), y[0])  # unbatched [C, H, W] as nn.Conv2d takes it
    if recipe in ("nvfp4_weight_only", "bf16"):  # weight-only: equals a conv with the decoded weight
        w = qc.weight.view(48, 64, 1, 1)
        ref = nn.functional.conv2d(x, w, qc.bias.float())
        torch.testing.assert_close(
            y, ref, rtol=1e-2 if recipe == "bf16" else 1e-5, atol=1e-2 if recipe == "bf16" else 1e-5
        )
    with pytest.raises(ValueError, match="expects"):
        qc(torch.randn(2, 32, 3, 3))


def test_requantize_conv1x1_from_a_conv_source_and_a_state_dict():
    policy = Convs()
    explore = copy.deepcopy(policy)
    quantize_model(explore, "nvfp4")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert requantize_(explore, source=policy) == 2
    fresh = copy.deepcopy(policy)
    quantize_model(fresh, "nvfp4")
    _assert_same_buffers(explore, fresh)
    x = torch.randn(1, 32, 6, 6)
    assert torch.equal(explore(x), fresh(x))
    # a state dict with the conv's own [out, in, 1, 1] weights
    sd = {"pw.weight": torch.ones(128, 64, 1, 1), "pw_nobias.weight": torch.ones(64, 128, 1, 1)}
    requantize_(explore, source=sd, strict=False)
    assert torch.equal(explore.pw.weight, torch.ones(128, 64)) and torch.equal(
        explore.pw_nobias.weight, torch.ones(64, 128)
    )
    # set_weight_ takes the 4-D weight too; a 3x3 weight is refused before anything is written
    explore.pw.set_weight_(torch.zeros(128, 64, 1, 1))
    assert not explore.pw.weight.any()
    snapshot = {k: v.clone() for k, v in explore.state_dict().items()}
    with pytest.raises(ValueError, match="pw_nobias"):
        requantize_(
            explore, source={"pw.weight": torch.randn(128, 64, 1, 1), "pw_nobias.weight": torch.randn(64, 128, 3, 3)}
        )
    with pytest.raises(ValueError, match="bias"):  # a source layer without the bias the copy has
        bad = copy.deepcopy(policy)
        bad.pw = nn.Conv2d(64, 128, 1, bias=False)
        requantize_(explore, source=bad)
    for k, v in explore.state_dict().items():
        assert torch.equal(_bits(v), _bits(snapshot[k])), k


def test_sana_1x1_convolutions_quantize_as_linears_over_channels():
    net = _sana()
    ref = copy.deepcopy(net)
    recipe = get_recipe("nvfp4_weight_only").with_(include=("*ff.*",))
    rep = quantize_model(net, recipe)
    convs = [d for d in rep.layers if d.kind == "conv1x1"]
    assert {d.name.rsplit(".", 1)[1] for d in convs if d.quantized} == {"conv_inverted", "conv_point"}
    assert isinstance(net.transformer_blocks[0].ff.conv_inverted, QuantConv1x1)
    assert type(net.transformer_blocks[0].ff.conv_depth) is nn.Conv2d  # depthwise 3x3 stays a conv
    # the quantized conv equals a linear over channels with the dequantized weight
    conv = net.transformer_blocks[0].ff.conv_inverted
    x = torch.randn(2, conv.in_features, 3, 5)
    w = conv.weight.view(conv.out_features, conv.in_features, 1, 1)
    torch.testing.assert_close(conv(x), nn.functional.conv2d(x, w, conv.bias.float()), rtol=1e-5, atol=1e-5)
    # the whole model still runs and stays near the original
    with torch.no_grad():
        got, want = net(**_sana_inputs()).sample, ref(**_sana_inputs()).sample
    assert torch.isfinite(got).all() and 0 < (got - want).norm() / want.norm() < 0.3
    # requantize_ takes the conv's 4-D weight from the source module
    with torch.no_grad():
        ref.transformer_blocks[0].ff.conv_point.weight.mul_(2)
    requantize_(net, source=ref)
    fresh = copy.deepcopy(ref)
    quantize_model(fresh, recipe)
    _assert_same_buffers(net, fresh)


# --- 3. PEFT-wrapped sources -----------------------------------------------------------------------


def test_requantize_from_peft_sources_on_a_tiny_module():
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    base = Tiny()
    explore = copy.deepcopy(base)
    quantize_model(explore, "nvfp4")
    policy = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=["attn", "ff.0"]), copy.deepcopy(base)
    )
    _random_lora_b(policy)

    def reference(state: dict[str, torch.Tensor]) -> nn.Module:
        want = copy.deepcopy(base)
        want.load_state_dict(state)
        return _quantized(want)

    # the active adapter's delta reaches quantized (ff.0) and high-precision kept layers alike
    requantize_(explore, source=policy)
    want = reference(_merged_state(policy))
    _assert_same_buffers(explore, want)
    x = torch.randn(3, 64)
    assert torch.equal(explore(x), want(x))
    plain = _quantized(copy.deepcopy(base))
    assert not torch.equal(explore.blocks[0].ff[0].w_qdata, plain.blocks[0].ff[0].w_qdata)  # the LoRA did arrive
    # disabled adapters: the base weights
    for m in policy.modules():
        if hasattr(m, "lora_A"):
            m.enable_adapters(False)
    requantize_(explore, source=policy)
    _assert_same_buffers(explore, reference(base.state_dict()))
    # two active adapters: both deltas; a second adapter only on `attn`
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["attn"]), policy, adapter_name="b")
    _random_lora_b(policy)
    for m in policy.modules():
        if hasattr(m, "lora_A"):
            m.enable_adapters(True)
            m.set_adapter(["default", "b"])
    requantize_(explore, source=policy)
    _assert_same_buffers(explore, reference(_merged_state(policy)))
    # adapters merged into the base already: the base as it is
    merged = copy.deepcopy(policy)
    for m in merged.modules():
        if hasattr(m, "lora_A"):
            m.merge()
    requantize_(explore, source=merged)
    _assert_same_buffers(explore, reference(_merged_state(policy)))
    # merged, then disabled: PEFT unmerges before its next forward, so the unmerged base is what counts
    unmerged = copy.deepcopy(merged)
    for m in merged.modules():
        if hasattr(m, "lora_A"):
            m.enable_adapters(False)
    for m in unmerged.modules():
        if hasattr(m, "lora_A"):
            m.unmerge()
    requantize_(explore, source=merged)
    _assert_same_buffers(explore, reference({k.replace(".base_layer", ""): v for k, v in unmerged.state_dict().items()
                                             if "lora_" not in k}))  # fmt: skip
    # a peft.PeftModel nests the model under base_model.model: unwrapped
    wrapped = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["attn", "ff.0"]))
    _random_lora_b(wrapped)
    requantize_(explore, source=wrapped)
    _assert_same_buffers(explore, reference(_merged_state(wrapped.get_base_model())))


def test_peft_sources_that_cannot_be_followed_are_refused():
    from peft import LoraConfig, inject_adapter_in_model

    base = Tiny()
    explore = copy.deepcopy(base)
    quantize_model(explore, "nvfp4")
    snapshot = {k: v.clone() for k, v in explore.state_dict().items()}
    dora = inject_adapter_in_model(LoraConfig(r=4, target_modules=["ff.0"], use_dora=True), copy.deepcopy(base))
    with pytest.raises(TypeError, match="merge_and_unload"):
        requantize_(explore, source=dora)
    # a PEFT state dict with unmerged LoRA matrices: its weights are not what the model computes
    lora = inject_adapter_in_model(LoraConfig(r=4, target_modules=["ff.0"]), copy.deepcopy(base))
    with pytest.raises(ValueError, match="unmerged LoRA"):
        requantize_(explore, source=lora.state_dict())
    for k, v in explore.state_dict().items():
        assert torch.equal(_bits(v), _bits(snapshot[k])), k
    # its base weights alone (".base_layer" names, no LoRA tensors) are a valid state dict
    plain = {k: v for k, v in lora.state_dict().items() if "lora_" not in k}
    assert any(".base_layer." in k for k in plain)
    assert requantize_(explore, source=plain) == len([m for m in explore.modules() if isinstance(m, QuantLinear)])
    _assert_same_buffers(explore, _quantized(copy.deepcopy(base)))


@pytest.mark.parametrize("family", ["sd3", "sana"])
def test_requantize_from_a_diffusers_peft_policy_merges_its_active_lora(family):
    from peft import LoraConfig

    make, inputs, targets = {
        "sd3": (_sd3, _sd3_inputs, ["ff.net.0.proj", "attn.to_q"]),
        "sana": (_sana, _sana_inputs, ["ff.conv_inverted", "ff.conv_point", "attn1.to_q"]),  # LoRA on 1x1 convs
    }[family]
    recipe = "nvfp4" if family == "sd3" else get_recipe("nvfp4").with_(include=("*ff.*",))
    policy = make()
    explore = copy.deepcopy(policy)
    quantize_model(explore, recipe)
    policy.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    _random_lora_b(policy)
    requantize_(explore, source=policy)
    want = make()
    want.load_state_dict(_merged_state(policy))
    quantize_model(want, recipe)
    _assert_same_buffers(explore, want)  # quantized buffers and high-precision weights, bit for bit
    with torch.no_grad():
        got = explore(**inputs()).sample
        assert torch.equal(got, want(**inputs()).sample)
        assert not torch.equal(got, _quantized(make(), recipe)(**inputs()).sample)
    # the high-precision attention projection took base + LoRA delta too
    attn = "attn" if family == "sd3" else "attn1"
    got_q = getattr(explore.transformer_blocks[0], attn).to_q.weight
    assert not torch.equal(got_q, getattr(make().transformer_blocks[0], attn).to_q.weight)


# --- 4. the explore copy follows every LoRA layer, or says why not ---------------------------------


def _adapters(policy: nn.Module, targets: tuple[str, ...] = ("attn.to_q", "ff.net.0.proj")):
    from solrl_engine.rl.adapters import OLD, LoraAdapters

    ad = LoraAdapters(policy, 4, 8, targets)
    with torch.no_grad():
        for p in ad.params(OLD)[1::2]:  # random nonzero "old" B: the merged weights differ from the base
            p.normal_(0, 0.5)
    return ad


def test_explore_refresh_refuses_lora_updates_the_copy_cannot_take():
    from solrl_engine.explore.copy import ExploreCopy

    policy = _sd3()
    ex = ExploreCopy(policy, "nvfp4")
    ex.transformer.fuse_qkv_projections()  # the copy's to_q/to_k/to_v become one to_qkv
    snapshot = {k: v.clone() for k, v in ex.transformer.state_dict().items()}
    ad = _adapters(policy)
    with pytest.raises(RuntimeError, match=r"fused layer transformer_blocks\.0\.attn\.to_qkv has no source") as e:
        ex.attach(ad)
    assert "bypassed" in str(e.value) and "fuse_qkv_projections" in str(e.value)
    with pytest.raises(RuntimeError, match="to_qkv"):  # the live side branch would be bypassed as well
        ex.attach(ad, merge=False)
    for k, v in ex.transformer.state_dict().items():
        assert torch.equal(_bits(v), _bits(snapshot[k])), k
    # fused after attach: the next refresh refuses, and writes nothing
    ok = ExploreCopy(_sd3(), "nvfp4")
    ad2 = _adapters(_sd3())
    ok.attach(ad2)
    assert ok.refresh(ad2) == len(ad2.layers)  # every LoRA layer reached: quantized or high precision
    ok.transformer.fuse_qkv_projections()
    snapshot = {k: v.clone() for k, v in ok.transformer.state_dict().items()}
    with torch.no_grad():
        ad2.params("old")[1].add_(1.0)
    with pytest.raises(RuntimeError, match="to_qkv"):
        ok.refresh(ad2)
    for k, v in ok.transformer.state_dict().items():
        assert torch.equal(_bits(v), _bits(snapshot[k])), k


def test_explore_refresh_reaches_quantized_and_high_precision_lora_layers():
    from solrl_engine.explore.copy import ExploreCopy
    from solrl_engine.rl.adapters import OLD

    rule = {"include": ("transformer_blocks.*.ff.*",)}  # to_q stays in high precision, ff.net.0.proj is NVFP4
    policy = _sd3()
    base_q = policy.transformer_blocks[0].attn.to_q.weight.detach().clone()
    ex = ExploreCopy(policy, "nvfp4", changes=rule)
    ad = _adapters(policy)
    ex.attach(ad)
    for _ in range(2):  # the first attach, then an update of the "old" adapter
        merged = ad.merged_weights(OLD)
        want_model = _sd3()
        want_model.load_state_dict(merged, strict=False)
        want = ExploreCopy(want_model, "nvfp4", changes=rule)
        _assert_same_buffers(ex.transformer, want.transformer)
        with torch.no_grad():
            assert torch.equal(ex.transformer(**_sd3_inputs()).sample, want.transformer(**_sd3_inputs()).sample)
        hp = ex.transformer.transformer_blocks[0].attn.to_q
        assert type(hp) is nn.Linear and torch.equal(hp.weight, merged["transformer_blocks.0.attn.to_q.weight"])
        with torch.no_grad():
            for p in ad.params(OLD)[1::2]:
                p.add_(torch.randn_like(p) * 0.1)
        assert ex.refresh(ad) == len(ad.layers)
    assert torch.equal(policy.transformer_blocks[0].attn.to_q.base_layer.weight, base_q)  # the policy's base untouched


def test_explore_copy_takes_a_full_recipe_and_the_family_rule():
    from solrl_engine.explore.copy import ExploreCopy

    sol = get_recipe("nvfp4").with_(skip_max_dim=64)  # attention projections (64 wide) stay BF16, MLPs go NVFP4
    ex = ExploreCopy(_sd3(), sol)
    assert ex.recipe == "nvfp4" and ex.quant_recipe.skip_max_dim == 64  # not reset by the older skip_max_dim arg
    assert ex.report.quantized and all(".ff" in n for n in ex.report.quantized)
    ex = ExploreCopy(_sd3(), "fp8", ("*ff.net.2*",), 0, changes={"include": ("transformer_blocks.*",)})
    assert ex.recipe == "fp8" and ex.quant_recipe.include == ("transformer_blocks.*",)
    assert not any("ff.net.2" in n for n in ex.report.quantized) and "ff.net.2" in str(ex.report)
    ex = ExploreCopy(_sd3(), "nvfp4", extra_skip=("*to_q*",), changes={"extra_skip": ("*to_k*",)})
    assert ex.quant_recipe.skip[-2:] == ("*to_q*", "*to_k*")  # both spellings add up


# --- 5. layer-rule parity: only the final proj_out, every adaLN modulation linear ------------------


def test_default_skip_keeps_only_the_final_proj_out_on_a_tiny_module():
    rep = quantize_model(Tiny(), "nvfp4")
    assert "blocks.0.proj_out" in rep.quantized and "blocks.1.proj_out" in rep.quantized
    assert rep.skipped["proj_out"] == "matches skip pattern 'proj_out'"
    assert rep.skipped["time_embed"] == "matches skip pattern '*embed*'"


def test_flux_rule_quantizes_single_block_proj_out_and_keeps_adaln():
    rep = quantize_model(_flux(), "nvfp4")
    assert "single_transformer_blocks.0.proj_out" in rep.quantized
    assert "single_transformer_blocks.0.proj_mlp" in rep.quantized
    for kept in ("single_transformer_blocks.0.norm.linear", "transformer_blocks.0.norm1.linear",
                 "transformer_blocks.0.norm1_context.linear", "proj_out", "norm_out.linear"):  # fmt: skip
        assert kept in rep.skipped, kept
    assert rep.skipped["single_transformer_blocks.0.norm.linear"] == "matches skip pattern '*.norm.linear'"
    assert rep.skipped["proj_out"] == "matches skip pattern 'proj_out'"


def test_sd3_rule_keeps_the_final_projection_and_adaln():
    rep = quantize_model(_sd3(), "nvfp4")
    assert rep.skipped["proj_out"] == "matches skip pattern 'proj_out'"
    assert rep.skipped["norm_out.linear"] == "matches skip pattern '*norm_out*'"
    for n in ("transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear"):
        assert "skip pattern" in rep.skipped[n], n
    assert "transformer_blocks.0.attn.to_out.0" in rep.quantized and "transformer_blocks.0.ff.net.2" in rep.quantized
