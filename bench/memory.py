"""Weight memory per model family: the trained transformer in BF16, its explore copy under the
family's layer rule (NVFP4 layers at 4.5 bits per weight with scales; of the rest only the LoRA
layers that take merged weights are copied, the others share the policy's frozen base), the LoRA,
and the text encoders that `offload_text_encoders` moves to the CPU between prompt encodes; and what
full fine-tuning (train_mode=full) holds in one process: 22 bytes per transformer weight plus the copy.

Transformer sizes are counted on the meta device from the published configs (no memory, no
download); text-encoder and VAE sizes are the published parameter counts. Activations and the
optimizer's LoRA state come on top (small LoRA; activations depend on batch sizes and resolution).

    python bench/memory.py            # prints a table, writes bench/results/<date>-memory.json
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import torch

from solrl_engine.models import model_spec
from solrl_engine.nn import plan_quantization
from solrl_engine.quant.recipe import get_recipe

# the parts we do not build here (text encoders, VAE) come from each family's ModelSpec (published counts)
# the Wan models (their transformers from models/wan.py's published configs); UMT5-XXL and the VAEs are counted
# on the meta device from their published configs too (vae_b_params)
WAN = ("wan2.1-1.3b", "wan2.1-14b", "wan2.2-5b")
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu")  # fmt: skip
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], in_channels=12, out_channels=12, patch_size=2,
                 is_residual=True, scale_factor_spatial=16, scale_factor_temporal=4)  # fmt: skip


def _count(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e9


def wan_parts(variant: str) -> tuple[dict[str, float], float]:
    """(text encoders, VAE) in billions of parameters for a Wan model, counted on the meta device."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        text = _count(UMT5EncoderModel(UMT5Config(**UMT5_XXL)))
        vae = _count(AutoencoderKLWan(**WAN22_VAE) if variant == "wan2.2-5b" else AutoencoderKLWan())
    return {"UMT5-XXL encoder": text}, vae


def family_memory(name: str, lora_rank: int = 32) -> dict[str, float]:
    """One row: `name` is a family (its FULL_CONFIG) or one of WAN (that published Wan transformer)."""
    import diffusers

    family = "wan" if name in WAN else name
    spec = model_spec(family)
    adapter = spec.adapter_object()
    config = adapter.ALIAS_CONFIGS[name] if name in WAN else adapter.FULL_CONFIG
    text_encoders, vae = wan_parts(name) if name in WAN else (spec.text_encoder_params_b, spec.vae_params_b)
    with torch.device("meta"):
        net = getattr(diffusers, adapter.TRANSFORMER_CLASS)(**config)
    params = sum(p.numel() for p in net.parameters())
    rep = plan_quantization(net, get_recipe("nvfp4").with_(**spec.explore_rule))
    q = sum(d.in_features * d.out_features for d in rep.layers if d.quantized)
    lora = lora_hp = 0
    kept = {d.name for d in rep.layers if not d.quantized}
    for n, m in net.named_modules():
        if any(n.endswith(t) for t in spec.lora_targets) and hasattr(m, "in_features"):
            lora += lora_rank * (m.in_features + m.out_features)
            if n in kept:  # merged LoRA lands in this high-precision layer: the copy keeps its own weight
                lora_hp += m.in_features * m.out_features
    gib = 2**30
    return {
        "transformer_params_b": params / 1e9,
        "policy_bf16_gib": 2 * params / gib,
        "explore_quantized_params_b": q / 1e9,
        "explore_quantized_share": q / params,
        # the copy shares every other high-precision tensor with the policy's frozen base (explore.py)
        "explore_copy_gib": (2 * lora_hp + q * (0.5 + 1 / 16)) / gib,
        "explore_copy_unshared_gib": (2 * (params - q) + q * (0.5 + 1 / 16)) / gib,
        "lora_params_m": lora / 1e6,
        "lora_train_old_ema_fp32_with_adam_gib": 4 * lora * (3 + 2) / gib,
        # train_mode=full (rl/full.py): trained, old and EMA weights in FP32 and AdamW's two moments, beside the
        # BF16 base kept as the reference (policy_bf16_gib); one process, nothing sharded
        "full_train_old_ema_fp32_with_adam_gib": 4 * params * (3 + 2) / gib,
        "text_encoders_bf16_gib": 2e9 * sum(text_encoders.values()) / gib,
        "text_encoder_b_params": text_encoders,
        "vae_b_params": vae,
        "vae_bf16_gib": 2e9 * vae / gib,
        "quantized_layers": len(rep.quantized),
        "linear_layers": len(rep.layers),
    }


def main() -> None:
    rows = {n: family_memory(n) for n in ("sd3", "flux", "sana", "qwenimage", *WAN)}
    for n, r in rows.items():
        parts = ("policy_bf16_gib", "explore_copy_gib", "lora_train_old_ema_fp32_with_adam_gib", "vae_bf16_gib")
        resident = sum(r[p] for p in parts)
        r["resident_weights_gib_text_offloaded"] = resident
        r["resident_weights_gib_text_on_gpu"] = resident + r["text_encoders_bf16_gib"]
        # full fine-tuning: nothing is frozen, so the explore copy holds all its own tensors
        full = ("policy_bf16_gib", "explore_copy_unshared_gib", "full_train_old_ema_fp32_with_adam_gib", "vae_bf16_gib")
        r["resident_weights_gib_full_text_offloaded"] = sum(r[p] for p in full)
        print(f"{n:11s} transformer {r['transformer_params_b']:.2f}B: policy {r['policy_bf16_gib']:.1f} GiB, "
              f"explore copy {r['explore_copy_gib']:.1f} GiB ({100 * r['explore_quantized_share']:.0f}% of weights "
              f"in NVFP4), text encoders {r['text_encoders_bf16_gib']:.1f} GiB (offloaded), resident {resident:.1f}; "
              f"full fine-tuning {r['resident_weights_gib_full_text_offloaded']:.1f}")
    out = Path(__file__).parent / "results" / f"{dt.date.today()}-memory.json"
    what = "weight memory per family (estimates from configs; no GPU)"
    out.write_text(json.dumps({"what": what, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
