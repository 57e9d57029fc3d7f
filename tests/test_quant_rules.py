"""Per-family layer rules: include patterns, SANA's 1x1 convolutions as linears over channels,
FLUX's skip list, requantize_ from a PEFT-wrapped policy, and the explore refresh refusing LoRA
updates whose layer the copy lacks (fused QKV)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from solrl_engine.nn import QuantConv1x1, QuantLinear, quantize_model, requantize_
from solrl_engine.quant.recipe import get_recipe


def _sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=8,
    ).eval()  # fmt: skip


def test_include_patterns_choose_the_candidates_and_the_report_says_why():
    net = _sd3()
    rep = quantize_model(net, get_recipe("nvfp4").with_(include=("transformer_blocks.*.ff.*",)))
    assert rep.quantized and all(".ff." in n and n.startswith("transformer_blocks.") for n in rep.quantized)
    why = rep.skipped["transformer_blocks.0.attn.to_q"]
    assert "not matched by include patterns" in why
    assert "kept in high precision" in rep.summary() and str(len(rep.quantized)) in rep.summary()
    assert {d["name"] for d in rep.to_dict()["layers"]} == {d.name for d in rep.layers}


def test_sana_1x1_convolutions_quantize_as_linears_over_channels():
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    net = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                 num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                 cross_attention_dim=32, caption_channels=32, sample_size=4).eval()  # fmt: skip
    ref = copy.deepcopy(net)
    rep = quantize_model(net, get_recipe("nvfp4_weight_only").with_(include=("*ff.*",)))
    convs = [d for d in rep.layers if d.kind == "conv1x1"]
    assert {d.name.rsplit(".", 1)[1] for d in convs if d.quantized} == {"conv_inverted", "conv_point"}
    assert isinstance(net.transformer_blocks[0].ff.conv_inverted, QuantConv1x1)
    assert type(net.transformer_blocks[0].ff.conv_depth) is nn.Conv2d  # depthwise 3x3 stays a conv
    # the quantized conv equals a linear over channels with the dequantized weight
    conv = net.transformer_blocks[0].ff.conv_inverted
    x = torch.randn(2, conv.in_features, 3, 5)
    w = conv.weight.view(conv.out_features, conv.in_features, 1, 1)
    torch.testing.assert_close(conv(x), nn.functional.conv2d(x, w, conv.bias.float()), rtol=1e-5, atol=1e-5)
    # requantize_ takes the conv's 4-D weight from the source module
    with torch.no_grad():
        ref.transformer_blocks[0].ff.conv_point.weight.mul_(2)
    requantize_(net, source=ref)
    fresh = copy.deepcopy(ref)
    quantize_model(fresh, get_recipe("nvfp4_weight_only").with_(include=("*ff.*",)))
    a, b = net.transformer_blocks[0].ff.conv_point, fresh.transformer_blocks[0].ff.conv_point
    assert torch.equal(a.w_qdata, b.w_qdata) and torch.equal(a.w_scale.view(torch.uint8), b.w_scale.view(torch.uint8))


def test_flux_rule_quantizes_single_block_proj_out_and_keeps_adaln():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    net = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip
    rep = quantize_model(net, "nvfp4")
    assert "single_transformer_blocks.0.proj_out" in rep.quantized
    for kept in ("single_transformer_blocks.0.norm.linear", "transformer_blocks.0.norm1.linear",
                 "transformer_blocks.0.norm1_context.linear", "proj_out", "norm_out.linear"):  # fmt: skip
        assert kept in rep.skipped, kept


def test_requantize_from_a_peft_policy_merges_its_active_lora():
    from peft import LoraConfig

    policy = _sd3()
    explore = copy.deepcopy(policy)
    quantize_model(explore, "nvfp4")
    policy.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["ff.net.0.proj", "attn.to_q"]))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    requantize_(explore, source=policy)
    merged = copy.deepcopy(policy)
    from peft.tuners.lora import LoraLayer

    for m in merged.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    want = copy.deepcopy(_sd3())
    want.load_state_dict({k.replace(".base_layer", ""): v for k, v in merged.state_dict().items() if "lora_" not in k})
    quantize_model(want, "nvfp4")
    for (n, a), (_, b) in zip(explore.named_modules(), want.named_modules(), strict=True):
        if isinstance(a, QuantLinear):
            assert torch.equal(a.w_qdata, b.w_qdata), n
    # the high-precision attention projection took base + LoRA delta too
    got = explore.transformer_blocks[0].attn.to_q.weight
    torch.testing.assert_close(got, want.transformer_blocks[0].attn.to_q.weight)
    assert not torch.allclose(got, _sd3().transformer_blocks[0].attn.to_q.weight)


def test_explore_refresh_refuses_lora_updates_the_copy_cannot_take():
    from solrl_engine.rl.adapters import LoraAdapters
    from solrl_engine.rl.explore import ExploreCopy

    policy = _sd3()
    ex = ExploreCopy(policy, "nvfp4")
    ex.transformer.fuse_qkv_projections()  # the copy's to_q/to_k/to_v become one to_qkv
    ad = LoraAdapters(policy, 4, 8, ("attn.to_q", "ff.net.0.proj"))
    with pytest.raises(RuntimeError, match="fused"):
        ex.attach(ad)
    ok = ExploreCopy(_sd3(), "nvfp4")
    ad2 = LoraAdapters(_sd3(), 4, 8, ("attn.to_q", "ff.net.0.proj"))
    ok.attach(ad2)
    assert ok.refresh(ad2) == len(ad2.layers)  # every LoRA layer reached: quantized or high precision
