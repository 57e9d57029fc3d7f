"""The explore copy: a quantized twin of the policy's transformer that previews rollouts cheaply.

Built once from the base weights (before LoRA is attached to the policy), refreshed after every
update in place: either the "old" LoRA is merged into the weights and `requantize_` rewrites the
quantized buffers (default), or the LoRA stays a BF16 side branch on the quantized base that reads
the live "old" adapter (nothing to refresh).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from solrl_engine.nn import QuantLinear, QuantReport, quantize_model, requantize_
from solrl_engine.quant.recipe import auto_explore_recipe, get_recipe
from solrl_engine.rl.adapters import OLD, LoraAdapters


def resolve_explore_recipe(precision: str, device: torch.device) -> str:
    """'auto' -> the device's explore recipe (DESIGN.md section 2); anything else passes through."""
    if precision != "auto":
        return precision
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return auto_explore_recipe(cap)


def _merge_lora_into_copy(model: nn.Module) -> None:
    """Replace every PEFT LoRA layer of `model` (a private copy) by its base layer holding base +
    the active adapters' delta: the copy then starts from what the policy computes now."""
    from solrl_engine.nn.quantize import _peft_weight

    for name, m in list(model.named_modules()):
        if hasattr(m, "base_layer") and hasattr(m, "lora_A"):
            base = m.base_layer
            base.weight.data.copy_(_peft_weight(name, m))
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, base)


class ExploreCopy:
    """The quantized twin. `changes` are QuantRecipe changes (the model family's layer rule:
    include, extra_skip, skip_max_dim, ...); `extra_skip`/`skip_max_dim` are the older spelling."""

    def __init__(
        self,
        base_transformer: nn.Module,
        recipe: str,
        extra_skip: tuple[str, ...] = (),
        skip_max_dim: int = 0,
        changes: dict[str, Any] | None = None,
    ) -> None:
        self.recipe = recipe
        self.transformer = copy.deepcopy(base_transformer).eval().requires_grad_(False)
        _merge_lora_into_copy(self.transformer)  # a caller's transformer may already carry a LoRA
        self.te = recipe == "te_nvfp4"  # Transformer Engine's NVFP4 layers, a peer to compare with
        full = get_recipe("nvfp4" if self.te else recipe)
        rule = {"extra_skip": tuple(extra_skip), "skip_max_dim": skip_max_dim, **(changes or {})}
        full = full.with_(**rule)
        if self.te:
            from solrl_engine.nn.te import TEAutocast, to_te_

            self.report: QuantReport = to_te_(self.transformer, full)
            self.transformer = TEAutocast(self.transformer)
        else:
            self.report = quantize_model(self.transformer, full)
        self.merge = True
        self.shared_bytes = 0

    def attach(self, adapters: LoraAdapters, merge: bool = True) -> None:
        """Follow the policy's "old" adapter: merged + requantized, or as a live BF16 side branch."""
        self.merge = merge
        if not merge:
            for name in adapters.layers:
                a, b, scale = adapters.side_branch(name, OLD)
                root = self.transformer.module if self.te else self.transformer
                layer = root.get_submodule(name)

                def hook(_m: nn.Module, inp: tuple[torch.Tensor], out: torch.Tensor, a=a, b=b, scale=scale):
                    x = inp[0].to(a.dtype)
                    return out + (scale * nn.functional.linear(nn.functional.linear(x, a), b)).to(out.dtype)

                layer.register_forward_hook(hook)
        if not self.te:
            self.shared_bytes = self._share_frozen(adapters, exclude=set(adapters.layers) if merge else set())
        self.refresh(adapters)

    @torch.no_grad()
    def _share_frozen(self, adapters: LoraAdapters, exclude: set[str]) -> int:
        """Point the copy's high-precision tensors at the policy's frozen base weights instead of
        holding a second copy (on SD3.5-L, where 22% of the weights go to NVFP4, that is most of the
        copy). Layers in `exclude` (LoRA layers whose merged weights the refresh writes) keep their
        own storage. Returns the bytes no longer duplicated."""
        policy = {n.replace(".base_layer.", "."): t for n, t in adapters.transformer.named_parameters()
                  if ".lora_" not in n}  # fmt: skip
        quant = {n for n, m in self.transformer.named_modules() if isinstance(m, QuantLinear)}
        saved = 0
        for name, p in self.transformer.named_parameters():
            owner = name.rpartition(".")[0]
            src = policy.get(name)
            if owner in quant or owner in exclude or src is None or src.shape != p.shape or src.dtype != p.dtype:
                continue
            if src.device == p.device and src.data_ptr() != p.data_ptr():
                saved += p.numel() * p.element_size()
                p.data = src.data
        return saved

    @torch.no_grad()
    def refresh(self, adapters: LoraAdapters) -> int:
        """Write the updated "old" policy into the copy; returns the number of layers rewritten.

        Every LoRA-merged weight must land somewhere: quantized layers are re-quantized, layers kept
        in high precision get the merged weight copied in. A merged weight whose layer the copy
        lacks (e.g. QKV projections fused on the copy) is an error, not a silent skip.
        """
        if not self.merge:
            return 0
        merged = adapters.merged_weights(OLD)
        if self.te:
            from solrl_engine.nn.te import refresh_te_

            return refresh_te_(self.transformer, {f"module.{k}": v for k, v in merged.items()})
        mods = dict(self.transformer.named_modules())
        fused = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")

        def unreachable(key: str) -> bool:  # no such layer, or one that a fused QKV projection bypasses
            name = key.removesuffix(".weight")
            parent, _, leaf = name.rpartition(".")
            return name not in mods or (leaf in fused and getattr(mods.get(parent), "fused_projections", False))

        lost = [k for k in merged if unreachable(k)]
        if lost:
            raise RuntimeError(
                f"the explore copy has no layer for {len(lost)} LoRA-updated weight(s), e.g. {lost[:3]}: its modules "
                "differ from the policy's (were QKV projections fused on the copy?); build the copy from the "
                "unmodified policy transformer so every update reaches it"
            )
        quant = {k: v for k, v in merged.items() if isinstance(mods[k.removesuffix(".weight")], QuantLinear)}
        for k, v in merged.items():
            if k not in quant:
                mods[k.removesuffix(".weight")].weight.copy_(v)
        return requantize_(self.transformer, source=quant, strict=False) + len(merged) - len(quant)
