"""quantize_model() and requantize_(): the one-line drop-in API.

report = quantize_model(explore_copy, "nvfp4")   # nn.Linear -> QuantLinear, in place
...                                              # RL update of the BF16 policy
requantize_(explore_copy, source=policy)         # same buffers, new weights
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from solrl_engine.nn.quant_linear import QuantConv1x1, QuantLinear
from solrl_engine.quant.formats import numerics
from solrl_engine.quant.recipe import QuantRecipe, get_recipe


@dataclass
class LayerDecision:
    """One layer's fate. `reason` is the full sentence (with this layer's sizes); `rule` is the rule
    alone, the same for every layer it kept, so that summaries can count per rule."""

    name: str
    in_features: int
    out_features: int
    quantized: bool
    reason: str
    kind: str = "linear"  # "linear" or "conv1x1" (a 1x1 convolution quantized as a linear over channels)
    rule: str = ""  # the rule that kept it, e.g. "matches skip pattern '*embed*'"; "" when quantized
    kernel: str = ""  # a quantized layer's GEMM implementation and why (QuantLinear.choose_kernel)


@dataclass
class QuantReport:
    """What quantize_model did to each nn.Linear, and why."""

    recipe: QuantRecipe
    layers: list[LayerDecision] = field(default_factory=list)

    @property
    def quantized(self) -> list[str]:
        return [d.name for d in self.layers if d.quantized]

    @property
    def skipped(self) -> dict[str, str]:
        """Skipped layer name -> reason."""
        return {d.name: d.reason for d in self.layers if not d.quantized}

    def weight_bytes(self) -> tuple[int, int]:
        """(BF16 bytes, stored bytes) of the quantized layers' weights, scales included."""
        before = after = 0
        stored = numerics(self.recipe.format).stored_bytes
        for d in self.layers:
            if d.quantized:
                before += 2 * d.in_features * d.out_features
                after += stored(d.in_features, d.out_features)  # the format's own count, scales included
                after += 2 * self.recipe.lowrank * (d.in_features + d.out_features)  # the BF16 branch
        return before, after

    def _head(self) -> str:
        before, after = self.weight_bytes()
        convs = sum(d.quantized and d.kind == "conv1x1" for d in self.layers)
        conv_note = f", {convs} of them 1x1 convolutions" if convs else ""
        return (
            f"quantize_model[{self.recipe.name}]: {len(self.quantized)} of {len(self.layers)} Linear "
            f"layers quantized{conv_note} ({before / 2**20:.2f} MiB bf16 -> {after / 2**20:.2f} MiB)"
        )

    def counts(self) -> dict[str, int]:
        """How many layers each rule kept in high precision (the reason stands in where a decision
        carries no rule), most frequent first."""
        counts: dict[str, int] = {}
        for d in self.layers:
            if not d.quantized:
                key = d.rule or d.reason
                counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def summary(self) -> str:
        """The first line plus one line per rule with its count: what a start-up log shows."""
        kinds: dict[str, int] = {}
        for d in self.layers:
            if d.quantized:
                kinds[d.kind] = kinds.get(d.kind, 0) + 1
        lines = [self._head()]
        if len(kinds) > 1:
            lines.append("  quantized: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
        lines += [f"  kept in high precision, {n} layer(s): {why}" for why, n in self.counts().items()]
        kernels: dict[str, int] = {}
        for d in self.layers:
            if d.quantized and d.kernel:
                kernels[d.kernel] = kernels.get(d.kernel, 0) + 1
        lines += [f"  GEMM of {n} layer(s): {k}" for k, n in kernels.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """Every decision plus the totals, JSON-ready (tuples become lists under json.dump)."""
        before, after = self.weight_bytes()
        return {
            "recipe": {"name": self.recipe.name, **asdict(self.recipe)},
            "quantized": len(self.quantized),
            "layers_seen": len(self.layers),
            "weight_bytes": {"bf16": before, "stored": after},
            "kept": self.counts(),
            "layers": [asdict(d) for d in self.layers],
        }

    def __str__(self) -> str:
        lines = [self._head()]
        for d in self.layers:
            kernel = f" [GEMM: {d.kernel}]" if d.kernel else ""
            lines.append(f"  {'quantized' if d.quantized else 'skipped'} {d.name}: {d.reason}{kernel}")
        return "\n".join(lines)


def _decide_rule(name: str, in_f: int, out_f: int, recipe: QuantRecipe) -> tuple[str, str] | None:
    """(rule, reason) for a layer of in_f -> out_f that stays unquantized, or None to quantize it.
    The rule is the same text for every layer it keeps; the reason adds this layer's sizes."""
    by_name = recipe.skip_reason(name)
    if by_name:
        return by_name, by_name
    small = min(in_f, out_f)
    if small < recipe.min_dim:
        return f"smallest dim < min_dim {recipe.min_dim}", f"smallest dim {small} < min_dim {recipe.min_dim}"
    large = max(in_f, out_f)
    if large <= recipe.skip_max_dim:
        rule = f"largest dim <= skip_max_dim {recipe.skip_max_dim}"
        return rule, f"largest dim {large} <= skip_max_dim {recipe.skip_max_dim}"
    k = numerics(recipe.format).k_multiple
    if in_f % k:
        label = numerics(recipe.format).label
        return f"in_features not a multiple of {k} ({label})", f"in_features {in_f} is not a multiple of {k}"
    if recipe.rht and in_f % recipe.rht:
        rule = f"in_features not a multiple of the rotation size {recipe.rht}"
        return rule, f"in_features {in_f} is not a multiple of the rotation size {recipe.rht}"
    if recipe.lowrank and recipe.lowrank >= small:
        rule = f"smallest dim <= lowrank {recipe.lowrank} (the branch would hold the whole layer)"
        return rule, f"smallest dim {small} <= lowrank {recipe.lowrank}"
    return None


def _decide(name: str, in_f: int, out_f: int, recipe: QuantRecipe) -> str | None:
    """Why a layer of in_f -> out_f stays unquantized, or None to quantize it."""
    got = _decide_rule(name, in_f, out_f, recipe)
    return None if got is None else got[1]


def is_conv1x1(m: nn.Module) -> bool:
    """A Conv2d that is a linear over channels: 1x1 kernel, stride 1, no padding, no groups."""
    return (
        type(m) is nn.Conv2d
        and m.kernel_size == (1, 1)
        and m.stride == (1, 1)
        and m.dilation == (1, 1)
        and m.groups == 1
        and m.padding in ((0, 0), "valid", "same")  # "same" pads nothing with a 1x1 kernel
    )


def _dims(m: nn.Module) -> tuple[int, int]:
    return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.in_channels, m.out_channels)


def _plan(model: nn.Module, recipe: QuantRecipe) -> tuple[QuantReport, list[tuple[nn.Module, str, nn.Module]]]:
    report = QuantReport(recipe)
    targets: list[tuple[nn.Module, str, nn.Module]] = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            conv = recipe.convs_1x1 and is_conv1x1(child)
            if type(child) is not nn.Linear and not conv:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            in_f, out_f = _dims(child)
            kept = _decide_rule(name, in_f, out_f, recipe)
            kind = "conv1x1" if conv else "linear"
            rule, why = kept if kept else ("", recipe.name)
            report.layers.append(LayerDecision(name, in_f, out_f, kept is None, why, kind, rule))
            if kept is None:
                targets.append((parent, child_name, child))
    return report, targets


def plan_quantization(model: nn.Module, recipe: str | QuantRecipe = "nvfp4") -> QuantReport:
    """What quantize_model would do, without touching the model (works on the meta device: sizes
    of a 12B model's explore copy cost no memory)."""
    return _plan(model, get_recipe(recipe))[0]


@torch.no_grad()
def quantize_model(model: nn.Module, recipe: str | QuantRecipe = "nvfp4", keep_master: bool = False,
                   device: torch.device | str | None = None) -> QuantReport:  # fmt: skip
    """Replace eligible nn.Linear layers (and, with `recipe.convs_1x1`, 1x1 nn.Conv2d layers) of
    `model` by QuantLinear / QuantConv1x1, in place; report every decision.

    `recipe` is a QuantRecipe or a name from solrl_engine.quant.RECIPES ("nvfp4", "fp8", ...).
    With `keep_master=True` each QuantLinear remembers the nn.Linear weight it came from, so that
    `requantize_(model)` can refresh it after that weight is updated. `device`: each layer is moved there
    just before it is quantized (a copy built from a base still on the CPU, at a sharded start-up: the
    device holds one layer whole at a time); the layers it does not quantize stay where they are.
    """
    recipe = get_recipe(recipe)
    if isinstance(model, nn.Linear):
        raise TypeError("quantize_model replaces Linear layers inside a model; wrap a lone Linear in nn.Sequential.")
    report, targets = _plan(model, recipe)
    decisions = [d for d in report.layers if d.quantized]
    for (parent, child_name, child), d in zip(targets, decisions, strict=True):
        cls = QuantConv1x1 if isinstance(child, nn.Conv2d) else QuantLinear
        if device is not None:
            child.to(device)
        q = cls.from_linear(child, recipe, keep_master=keep_master)
        q.kernel_tag = f"{d.name}#{q.kernel_tag.partition('#')[2]}"  # the fast-path record names the layer
        setattr(parent, child_name, q)
        d.kernel = q.choose_kernel()[1]
    return report


# --- sources: a plain model, a PEFT-wrapped one, a state dict, or the master weights ---------------


def is_lora_layer(m: nn.Module) -> bool:
    """A PEFT LoRA layer (lora.Linear, lora.Conv2d, ...): its own .weight is not what it computes with."""
    return hasattr(m, "base_layer") and hasattr(m, "lora_A")


def _unwrap_source(source: nn.Module) -> nn.Module:
    """A peft.PeftModel nests the model under base_model.model; its names match the copy only inside."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft is imported already
    if peft is not None and isinstance(source, getattr(peft, "PeftModel", ())):
        return source.get_base_model()
    return source


def _peft_weight(name: str, mod: nn.Module) -> torch.Tensor:
    """What a PEFT LoRA layer computes with, as PEFT's own forward does: its base weight plus the
    delta of each active adapter; the bare base when adapters are disabled; the base as is when
    adapters are merged into it. Raises where that is not base + get_delta_weight (DoRA and other
    variants, LoRA biases), rather than return a weight the policy does not use."""
    base = mod.base_layer.weight
    merged = list(getattr(mod, "merged_adapters", []))
    if getattr(mod, "disable_adapters", False):  # PEFT unmerges, then runs the base layer alone
        use, sign = list(reversed(merged)), -1.0
    elif merged:  # PEFT runs the merged base layer alone
        return base
    else:
        use, sign = [a for a in getattr(mod, "active_adapters", []) if a in mod.lora_A], 1.0
    if not use:
        return base
    for a in use:
        variant = getattr(mod, "lora_variant", {}).get(a) or getattr(mod, "use_dora", {}).get(a)
        if not hasattr(mod, "get_delta_weight") or variant or getattr(mod, "lora_bias", {}).get(a):
            what = "a DoRA/variant" if variant else ("a lora_bias" if hasattr(mod, "get_delta_weight") else "an")
            raise TypeError(
                f"source layer {name} ({type(mod).__name__}) has {what} adapter {a!r} whose effect is not its base "
                "weight + get_delta_weight(); merge the adapters first (model.merge_and_unload()) or pass a state "
                "dict of merged weights as the source."
            )
    w = base
    for a in use:
        delta = mod.get_delta_weight(a)
        if delta.shape != base.shape:
            raise ValueError(
                f"source layer {name}: adapter {a!r} gives a delta of shape {tuple(delta.shape)} for a base weight of "
                f"{tuple(base.shape)}; merge the adapters first (merge_and_unload) or pass a state dict."
            )
        w = (w.float() + sign * delta.float()).to(base.dtype)  # one rounding per adapter, as PEFT's merge
    return w


def _plain_name(key: str) -> str:
    """A PEFT-wrapped model's tensor name as in the model it wraps (its `.base_layer` hop removed)."""
    return key.replace(".base_layer.", ".")


def _lora_key(key: str) -> bool:
    return ".lora_" in key or key.startswith("lora_")


def _normalize_mapping(source: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Accept a PEFT model's state dict only when it holds no unmerged LoRA matrices (their scale is
    not in it, so the weights it implies cannot be rebuilt); strip `.base_layer` from the names."""
    lora = [k for k in source if _lora_key(k)]
    if lora:
        raise ValueError(
            f"the source state dict holds {len(lora)} unmerged LoRA tensor(s), e.g. {lora[:2]}; its weights are "
            "not what the model computes with. Pass the PEFT-wrapped module itself, or a state dict of merged "
            "weights (merge_and_unload() first)."
        )
    if not any(".base_layer." in k for k in source):
        return source
    return {_plain_name(k): v for k, v in source.items()}


def _source_weights(
    layers: dict[str, QuantLinear], source: nn.Module | Mapping[str, torch.Tensor] | None, strict: bool = True
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    missing: list[str] = []
    for name, ql in layers.items():
        if source is None:
            if ql.master_weight is None:
                raise ValueError(
                    f"{name} has no master weight to requantize from: pass source= (the BF16 model "
                    "or a state dict), or quantize with keep_master=True."
                )
            out[name] = (ql.master_weight, None)
        elif isinstance(source, Mapping):
            if f"{name}.weight" not in source:
                if strict:
                    missing.append(f"{name}.weight")
                continue
            out[name] = (source[f"{name}.weight"], source.get(f"{name}.bias"))
        else:
            try:
                mod = source.get_submodule(name)
            except AttributeError:
                missing.append(name)
                continue
            if is_lora_layer(mod):  # a PEFT LoRA layer: base + active deltas
                out[name] = (_peft_weight(name, mod), getattr(mod.base_layer, "bias", None))
                continue
            if isinstance(mod, QuantLinear) or not isinstance(getattr(mod, "weight", None), torch.Tensor):
                raise TypeError(f"source module {name} is {type(mod).__name__}; it must hold a BF16 .weight.")
            out[name] = (mod.weight, getattr(mod, "bias", None))
    if missing:
        raise KeyError(
            f"source lacks {len(missing)} quantized layer(s), e.g. {missing[:3]}; pass the model the "
            "quantized copy was made from (same module names), or a state dict with those keys."
        )
    return out


def _source_tensors(source: nn.Module, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The `wanted` tensors of a module source, under the names of the model it was copied from:
    PEFT's `.base_layer` hop removed, its LoRA matrices left out, and a LoRA layer's weight the one
    it computes with (built only for the layers asked for)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in [*source.named_parameters(), *source.named_buffers()]:
        name = _plain_name(key)
        if name in wanted and not _lora_key(key):
            out[name] = t
    for name, mod in source.named_modules():
        if is_lora_layer(mod) and f"{name}.weight" in wanted:
            out[f"{name}.weight"] = _peft_weight(name, mod)
    return out


# a parameter of a copy whose storage is the source model's (explore.copy: built borrowing, or a frozen layer shared):
# requantize_ gives it storage of its own before writing, so a refresh never writes into the model it came from
BORROWED = "_solrl_borrowed"


def borrow(p: torch.Tensor, storage: torch.Tensor) -> None:
    """Point parameter `p` at another model's `storage` (no copy), marked so requantize_ never writes into it."""
    p.data = storage
    setattr(p, BORROWED, True)


def own_(p: torch.Tensor) -> None:
    """Before writing into parameter `p`: if it is borrowed, give it storage of its own (copy on write)."""
    if getattr(p, BORROWED, False):
        p.data = torch.empty_like(p)
        delattr(p, BORROWED)


def _plain_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers outside the QuantLinear layers (the parts kept in high precision)."""
    inside = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    out: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        owner = name.rpartition(".")[0]
        if owner not in inside:
            out[name] = t
    return out


@torch.no_grad()
def requantize_(
    model: nn.Module, source: nn.Module | Mapping[str, torch.Tensor] | None = None, strict: bool = True
) -> int:
    """Refresh `model` in place from new high-precision weights, so it mirrors the updated policy.

    Every QuantLinear is re-quantized into its existing buffers; with a `source`, the layers kept in
    high precision are copied too (all of a module source's tensors, those present in a state dict).
    `source` is the BF16 model (matched by name), a state dict, or None for the master weights kept
    by quantize_model(keep_master=True). A module source may carry PEFT LoRA adapters (also inside a
    peft.PeftModel): each layer then contributes what it computes with, base weight plus its active
    adapters' deltas. A 1x1 nn.Conv2d source layer (or a [out, in, 1, 1] tensor) feeds a
    QuantConv1x1. With `strict=False` a state dict may hold only the layers that changed (e.g. the
    LoRA-merged ones); the others are left as they are. Everything is checked before anything is
    written, so a bad source leaves the model unchanged. Returns the number of quantized layers
    refreshed.
    """
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if isinstance(source, Mapping):
        source = _normalize_mapping(source)
    elif source is not None:
        source = _unwrap_source(source)
    module_source = source is not None and not isinstance(source, Mapping)
    weights = _source_weights(layers, source, strict)
    for name, (w, b) in list(weights.items()):
        ql = layers[name]
        if w.dim() == 4 and tuple(w.shape[2:]) == (1, 1):  # a 1x1 convolution's weight
            w = w.reshape(w.shape[0], w.shape[1])
            weights[name] = (w, b)
        if tuple(w.shape) != (ql.out_features, ql.in_features):
            raise ValueError(
                f"source weight for {name} has shape {tuple(w.shape)}, the layer is "
                f"{ql.out_features}x{ql.in_features}; the source is not the model this copy was made from."
            )
        if module_source and (b is None) != (ql.bias is None):
            which = ("the source layer", "the quantized layer") if b is None else ("the quantized layer", "the source")
            raise ValueError(
                f"{which[0]} {name} has no bias but {which[1]} has one; not the model this copy was made from."
            )
        if b is not None and ql.bias is not None and tuple(b.shape) != tuple(ql.bias.shape):
            raise ValueError(f"source bias for {name} has shape {tuple(b.shape)}, expected {tuple(ql.bias.shape)}.")
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    if source is not None:
        own = _plain_tensors(model)
        src = source if isinstance(source, Mapping) else _source_tensors(source, set(own))
        for name, t in own.items():
            if name not in src:
                if module_source:
                    raise KeyError(f"source module has no {name}; pass the model this copy was made from.")
                continue
            if src[name].shape != t.shape:
                raise ValueError(f"source {name} has shape {tuple(src[name].shape)}, expected {tuple(t.shape)}.")
            plain.append((t, src[name]))
    for name, (w, b) in weights.items():
        layers[name].set_weight_(w, b)
    for dst, val in plain:
        if dst.data_ptr() != val.data_ptr():
            own_(dst)  # copy on write: a borrowed storage belongs to the model it came from
            dst.copy_(val.detach())
    return len(weights)
