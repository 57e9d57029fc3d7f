"""The GPU session's training phase for one model: the LoRA adapters as the trainer attaches them, each explore
copy's in-place refresh, and one DiffusionNFT update batch at the family's train batch (docs/gpu-session.md).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from session_common import (  # noqa: I001 - bench/ is on sys.path (session_common puts it there)
    TINY_BATCH,
    _autocast,
    _error,
    _release,
    _sync,
    explore_rule,
    median_ms,
    predict,
)
from torch import nn

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import ARCH_ALIASES, model_spec
from solrl_engine.nn import requantize_
from solrl_engine.rl import presets
from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters
from solrl_engine.rl.distributed import Dist
from solrl_engine.rl.objectives.nft import NFTSettings, nft_update
from solrl_engine.rl.update import UpdateBatch

# the training phase (LoRA attached, each copy's refresh, one nft_update warm-up + 2 timed): seconds it needs
# left of the stage to start (an estimate: a few update batches of SD3.5-L / FLUX take a few seconds each)
TRAIN_ALLOWANCE = {"gpu": 40.0, "smoke": 1.0}


# families whose update runs with gradient checkpointing here although their preset does not: SD3.5-L's update at
# 1024 px without it is estimated at 60 GB beside its weights and the explore copies (an 80 GB GPU)
CHECKPOINT_FOR_MEMORY = ("sd35-large",)


def paper_preset(alias: str) -> str:
    """The paper preset of a benchmark model: a Wan model has its own (presets.PAPER["wan2.1-14b"]), an image
    model its family's."""
    return alias if alias in presets.PAPER else ARCH_ALIASES.get(alias, alias)


def train_settings(alias: str, smoke: bool, batch: dict[str, int]) -> dict[str, Any]:
    """The family's update as its paper preset runs it (solrl_engine/rl/presets.py) at predict.UPDATE_80GB's
    sizes: train batch, gradient checkpointing (also on for CHECKPOINT_FOR_MEMORY, to fit 80 GB), timestep
    fraction, LoRA rank / alpha / targets. `batch` overrides the train batch."""
    fam = ARCH_ALIASES.get(alias, alias)
    p = presets.PAPER[paper_preset(alias)]
    train_batch, checkpointing = predict.UPDATE_80GB[paper_preset(alias)]
    return {
        "batch": TINY_BATCH if smoke else batch.get(alias, train_batch),
        "checkpointing": checkpointing or alias in CHECKPOINT_FOR_MEMORY,
        "timestep_fraction": p["timestep_fraction"],
        "lora_rank": presets.COMMON["lora_rank"], "lora_alpha": presets.COMMON["lora_alpha"],
        "lora_targets": list(p.get("lora_targets") or model_spec(fam).lora_targets),
    }  # fmt: skip


def attach_lora(net: nn.Module, ts: dict[str, Any]) -> LoraAdapters:
    """The trained and "old" LoRA adapters on the policy, as the trainer attaches them (FP32 adapters on
    BF16 base weights, gradient checkpointing where the family's preset uses it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        adapters = LoraAdapters(net, ts["lora_rank"], ts["lora_alpha"], tuple(ts["lora_targets"]))
    for p in adapters.params(TRAIN) + adapters.params(OLD):
        p.data = p.data.float()
    adapters.ema = [e.float() for e in adapters.ema]
    if ts["checkpointing"]:
        net.enable_gradient_checkpointing()
    return adapters


def refresh_time(model: Any, adapters: LoraAdapters, alias: str, fmt: str, device: torch.device,
                 reps: int) -> dict[str, Any]:  # fmt: skip
    """One refresh of the `fmt` explore copy from the policy, in place, as the trainer's step 5 does it
    (ExploreCopy.refresh: the "old" LoRA merged and the LoRA layers re-quantized); beside it, requantize_ of
    every quantized layer from the policy module (what bench/predict.py's refresh estimate prices)."""
    copy = ExploreCopy(model.transformer, fmt, changes=explore_rule(alias, fmt))
    copy.attach(adapters)  # the trainer's attach: checks, frozen tensors shared, and a first refresh (the warm-up)
    _sync(device)
    ms = median_ms(lambda: copy.refresh(adapters), device, warmup=0, reps=reps)
    all_ms = median_ms(lambda: requantize_(copy.transformer, source=model.transformer), device, warmup=1, reps=reps)
    return {"refresh_ms": ms, "refresh": {
        "what": "ExploreCopy.refresh, the trainer's: the LoRA layers merged and re-quantized in place",
        "layers": len(adapters.layers), "requantize_all_ms": all_ms,
        "requantize_all_layers": len(copy.report.quantized)}}  # fmt: skip


def time_nft_update(model: Any, adapters: LoraAdapters, alias: str, device: torch.device, ts: dict[str, Any],
                    reps: int) -> dict[str, Any]:  # fmt: skip
    """One DiffusionNFT update batch: nft_update on `batch` samples at one timestep (the "old" and reference
    no-grad forwards, the policy's forward and backward, then the LoRA optimizer step and the EMA / "old"
    moves), after one warm-up. A paper iteration runs iteration_table's update_batches of these."""
    b = ts["batch"]
    # one step budget and every timestep of it: n_t = 1, so one call is one update batch
    c = presets.paper_config(paper_preset(alias), "sol_rl", "pickscore", train_batch_size=b, full_steps=1,
                             timestep_fraction=1.0)  # fmt: skip
    opt = torch.optim.AdamW(adapters.params(TRAIN), lr=c.lr, weight_decay=c.weight_decay)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(b, *model.latent_shape, device=device, dtype=torch.bfloat16)
    _, _, cond = predict.forward_inputs(model, b, device=device, dtype=torch.bfloat16)
    adv = torch.linspace(-1.0, 1.0, b, device=device)
    sigmas = torch.tensor([0.75])
    done = [0]

    def update() -> None:
        batch = UpdateBatch(x0, cond, adv, sigmas, gen, b_global=b, row0=0, iteration=done[0])
        nft_update(model, adapters, opt, batch, NFTSettings.from_config(c), Dist(), lambda: _autocast(device))
        done[0] += 1

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(update, device, warmup=1, reps=reps)
    out: dict[str, Any] = {"ms": ms, "batch": b, "checkpointing": ts["checkpointing"], "calls": done[0],
                           "kl": c.kl_beta > 0}  # fmt: skip
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def training_phase(model: Any, alias: str, device: torch.device, out: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Between the eager and the compiled forwards: LoRA on the policy as the trainer attaches it, each
    explore copy's refresh (entry["refresh_ms"]), then one nft_update at the family's train batch
    (out["nft_update"]). The LoRA is removed after, so the compiled forwards time the plain BF16 weights."""
    ts, net = out["train_settings"], model.transformer
    if not cfg["train"]:
        out["nft_update"] = {"skipped": "--no-train"}
        return
    if time.monotonic() + cfg["train_allowance"] > cfg["deadline"]:
        out["nft_update"] = {"skipped": f"under {cfg['train_allowance']:.0f} s left of the stage"}
        return
    adapters = None
    try:
        adapters = attach_lora(net, ts)
        for fmt, entry in out["precisions"].items():
            if fmt == "bf16" or "+" in fmt or "eager_ms" not in entry:  # "fp8+int8-attention" refreshes as fp8
                continue
            out["step"] = f"refresh {fmt}"  # where a stage that fails was (recorded before each step)
            cfg["progress"](out)
            try:
                entry.update(refresh_time(model, adapters, alias, fmt, device, cfg["reps"]))
            except Exception as e:  # one copy failing must not lose the update's time
                entry["refresh"] = _error(e)
            finally:
                _release(device)
            cfg["progress"](out)
        out["step"] = "nft_update"
        cfg["progress"](out)
        out["nft_update"] = time_nft_update(model, adapters, alias, device, ts, 2)
    except Exception as e:
        out["nft_update"] = _error(e)
    finally:
        adapters = None
        if ts["checkpointing"]:
            net.disable_gradient_checkpointing()
        if getattr(net, "peft_config", None):
            net.unload_lora()
        net.requires_grad_(False)
        _release(device)
    cfg["progress"](out)

