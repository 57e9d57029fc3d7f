"""The explore copy: a quantized twin of the policy's transformer that previews rollouts cheaply.

Built once from the base weights (before LoRA is attached to the policy), refreshed after every
update in place: either the "old" LoRA is merged into the weights and `requantize_` rewrites the
quantized buffers (default), or the LoRA stays a BF16 side branch on the quantized base that reads
the live "old" adapter (nothing to refresh).

With the recipe POLICY ("policy") the copy is not quantized at all: the policy's own precision with
the "old" LoRA merged in. The trainer samples every full-precision rollout of the "old" policy
through it when merge_lora is on, so that every family's rollouts run the adapter in the same form
as the quantized copy does (merged): a speed comparison then measures the precision, not the cost of
unmerged LoRA branches (like-for-like baselines). Only the LoRA layers hold their own storage; every
other tensor is the policy's own.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from solrl_engine.explore.choice import POLICY
from solrl_engine.kernels import TENSOR_CORES, forget_run, format_kernels, runs
from solrl_engine.nn import QuantLinear, QuantReport, quantize_model, requantize_
from solrl_engine.nn.flops import amdahl_bound
from solrl_engine.nn.producers import fuse_producers, keep_outputs
from solrl_engine.nn.quantize import BORROWED, _peft_weight, borrow, is_lora_layer, own_
from solrl_engine.quant.formats import attention_formats, numerics
from solrl_engine.quant.recipe import QuantRecipe, get_recipe

log = logging.getLogger("solrl_engine.explore")

if TYPE_CHECKING:
    from solrl_engine.explore.plan import ExploreSpec


class FollowedAdapters(Protocol):
    """What the copy needs of the policy's LoRA adapters (the trainer's rl.adapters.LoraAdapters): the
    transformer they sit on, their layers by name, and the adapter the copy follows (the "old" policy,
    the adapters' default): merged into full weights, or as one layer's (A, B, scale) side branch."""

    transformer: nn.Module
    layers: Mapping[str, nn.Module]

    def merged_weights(self) -> dict[str, torch.Tensor]: ...

    def side_branch(self, name: str) -> tuple[torch.Tensor, torch.Tensor, float]: ...


def _borrowing_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters are new, frozen Parameter objects on the same storage (marked
    borrowed: requantize_ gives one its own storage before writing into it), so building a copy never holds a
    second copy of the weights; layers the copy quantizes then drop theirs. Buffers are copied (small)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            q = nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=False)
            borrow(q, p.data)
            memo[id(p)] = q
    return copy.deepcopy(model, memo)


def _merge_lora_into_copy(model: nn.Module) -> None:
    """Replace every PEFT LoRA layer of `model` (a private copy) by its base layer holding base +
    the active adapters' delta: the copy then starts from what the policy computes now."""
    for name, m in list(model.named_modules()):
        if is_lora_layer(m):
            base = m.base_layer
            merged = _peft_weight(name, m)
            own_(base.weight)  # a borrowing copy: the policy's storage is never written
            base.weight.data.copy_(merged)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, base)


# Projections that diffusers' fuse_projections() concatenates into to_qkv / to_kv / to_added_qkv: once an
# attention module has `fused_projections`, its forward reads the fused layer and never these.
_FUSABLE = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


def _has_weight(m: nn.Module) -> bool:
    """A layer with its own weight (nn.Linear, nn.Conv2d, te.Linear, QuantLinear), found without
    decoding a QuantLinear's weight."""
    return isinstance(m, QuantLinear) or any(n == "weight" for n, _ in m.named_parameters(recurse=False))


def unreachable_lora_layers(copy_root: nn.Module, policy: nn.Module, lora_layers: Iterable[str]) -> list[str]:
    """Why some of the policy's LoRA layers would never reach `copy_root`: each entry names a layer and
    what is wrong. Empty when every LoRA layer has a counterpart the copy computes with."""
    mods = dict(copy_root.named_modules())
    names = list(lora_layers)
    policy_names = {n.replace(".base_layer", "") for n, _ in policy.named_modules() if ".lora_" not in n}
    problems = []
    parents = {n.rpartition(".")[0] for n in names}
    for name, m in mods.items():  # layers of the copy that no policy layer feeds, beside a LoRA layer
        if name and name not in policy_names and name.rpartition(".")[0] in parents and _has_weight(m):
            fused = getattr(mods.get(name.rpartition(".")[0]), "fused_projections", False)
            problems.append(f"{'fused ' if fused else ''}layer {name} has no source in the policy")
    for name in names:
        parent, _, leaf = name.rpartition(".")
        if name not in mods:
            problems.append(f"LoRA layer {name} has no counterpart in the copy")
        elif leaf in _FUSABLE and getattr(mods.get(parent), "fused_projections", False):
            problems.append(f"LoRA layer {name} is bypassed by its module's fused projections")
    return problems


class ExploreCopy:
    """The quantized twin of the policy's transformer.

    `recipe` is a recipe name ("nvfp4", "fp8", ..., or "te_nvfp4" for Transformer Engine's layers) or
    a full QuantRecipe; `changes` are QuantRecipe changes applied on top (the model family's layer
    rule: include, extra_skip, skip_max_dim, ...). `extra_skip` / `skip_max_dim` are the older
    spelling of two of those changes (None leaves the recipe's own skip_max_dim). `self.recipe` is
    the recipe's name (for logs), `self.quant_recipe` the full recipe used. `producers` (the family's
    ModelSpec.producers) names the norms that emit their output's 8-bit codes for the linears they feed
    (nn.producers), `producer_blocks` (ModelSpec.producer_blocks) the family's forwards for blocks that modulate
    inline; `self.producers` says what was fused and why the others were not.
    """

    def __init__(
        self,
        base_transformer: nn.Module,
        recipe: str | QuantRecipe,
        extra_skip: tuple[str, ...] = (),
        skip_max_dim: int | None = None,
        changes: Mapping[str, Any] | None = None,
        borrow: bool = False,
        producers: Mapping[str, tuple[str, ...]] | None = None,
        device: torch.device | str | None = None,
        producer_blocks: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.te = isinstance(recipe, str) and recipe == "te_nvfp4"  # Transformer Engine's NVFP4, a peer
        self.full_precision = isinstance(recipe, str) and recipe == POLICY  # the policy's precision, LoRA merged
        base = get_recipe("nvfp4" if self.te else "bf16" if self.full_precision else recipe)
        rule = dict(changes or {})
        if extra_skip:
            rule["extra_skip"] = tuple(extra_skip) + tuple(rule.get("extra_skip", ()))
        if skip_max_dim is not None:
            rule.setdefault("skip_max_dim", skip_max_dim)
        self.quant_recipe: QuantRecipe = base.with_(**rule)
        self.recipe: str = "te_nvfp4" if self.te else POLICY if self.full_precision else self.quant_recipe.name
        # `borrow`: the copy starts on the base's own storage (the trainer's copies: no second whole copy at start);
        # not under TE, whose layers take the weights over
        lend = borrow and not self.te
        self.transformer = (_borrowing_copy(base_transformer) if lend
                            else copy.deepcopy(base_transformer)).eval().requires_grad_(False)  # fmt: skip
        _merge_lora_into_copy(self.transformer)  # a caller's transformer may already carry a LoRA
        # `device`: where the copy lives when the base is elsewhere (a sharded start-up's base, on the CPU until
        # sharding moves it: rl/sharding.py): each layer is quantized there, one whole at a time, then the rest moved
        if self.te:
            from solrl_engine.nn.te import TEAutocast, to_te_

            if device is not None:  # (Transformer Engine's layers are built on the GPU they run on)
                self.transformer.to(device)
            self.report: QuantReport = to_te_(self.transformer, self.quant_recipe)
            self.transformer = TEAutocast(self.transformer)
        elif self.full_precision:
            self.report = QuantReport(self.quant_recipe)  # nothing quantized
        else:
            self.report = quantize_model(self.transformer, self.quant_recipe, device=device)
        if device is not None:
            self.transformer.to(device)
        # the producers (ModelSpec.producers) that emit their output's row-wise codes for the linears they feed
        self.producers = fuse_producers(self.transformer, producers or {}, producer_blocks) if not self.te else None
        self.merge = True
        self.shared_bytes = 0
        self.attention = "bf16"
        # a copy split over the ranks (rl/sharding.ShardedCopy.whole): the blocks holding some names gathered whole
        # while the refresh writes them
        self.whole_blocks: Callable[[list[str]], contextlib.AbstractContextManager[None]] | None = None

    @classmethod
    def from_spec(cls, transformer: nn.Module, spec: ExploreSpec | None, borrow: bool = False,
                  device: torch.device | str | None = None) -> ExploreCopy | None:  # fmt: skip
        """The copy an ExploreSpec asks for (its precision, full layer rule and attention), None where the policy
        itself explores (POLICY) or there is no spec; `borrow` and `device` as ExploreCopy's."""
        if spec is None or not spec.quantized:
            return None
        copy = cls(transformer, spec.precision, changes=dict(spec.rule), borrow=borrow, producers=spec.producers,
                   device=device, producer_blocks=spec.producer_blocks)  # fmt: skip
        if spec.attention != "bf16":
            copy.set_attention(spec.attention)
        return copy

    def set_attention(self, precision: str) -> None:
        """The copy's attention with q, k and v in a low-precision format (one with an attention rounding: "fp8",
        "int8"; "bf16": as the policy's): an explore-only option that cuts attention's share of a video forward
        (38-46% at 480p and 81 frames). Each attention call without a mask, or with a key-padding one, runs the
        format's attention op (INT8: SageAttention's recipe, its Triton kernel on sm_80+; FP8: Q K^T and P V on the
        FP8 tensor cores, its Triton kernel on sm_89+), its PyTorch reference elsewhere (the fast-path record's
        ATTENTION_TAG entry says which); a call with any other mask has q, k and v go through the format's attention
        rounding (quant/<fmt>.py's Numerics.attention) before the usual attention kernel (emulated). So rank fidelity
        can be measured on any device."""
        if precision not in attention_formats():
            raise ValueError(f"explore attention {precision!r}: choose one of {attention_formats()}")
        root = self._root
        root.__dict__.pop("forward", None)  # back to the class's forward
        self.attention = precision
        forget_run(ATTENTION_TAG)  # what an earlier copy's attention ran is not this one's
        if precision != "bf16":  # the module's own forward inside the mode (an exception leaves it too)
            plain, rounding = root.forward, numerics(precision).attention
            op = format_kernels()[precision].attention_op
            kernel = getattr(torch.ops.solrl, op) if op else None  # the format's attention op (a custom op)

            def forward(*args: Any, **kwargs: Any) -> Any:
                with _RoundedAttention(rounding, kernel):
                    return plain(*args, **kwargs)

            root.forward = forward

    def attention_ran(self) -> str | None:
        """What the copy's low-precision attention ran, as its op recorded it (its kernel, or its reference), since
        `set_attention`; "emulated" when no call took the op (each had a mask other than a key-padding one); None
        with the policy's attention."""
        if self.attention == "bf16":
            return None
        last = runs().get(ATTENTION_TAG)
        return last.impl if last is not None else "emulated (q, k, v rounded; no call took the attention op)"

    @property
    def _root(self) -> nn.Module:
        return self.transformer.module if self.te else self.transformer

    def check_follows(self, adapters: FollowedAdapters) -> None:
        """Raise unless every LoRA layer of the policy is a layer the copy computes with, and no layer
        of the copy beside one (a fused QKV projection) lacks a source: otherwise updates would
        silently never reach the explore copy."""
        problems = unreachable_lora_layers(self._root, adapters.transformer, adapters.layers)
        if problems:
            more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
            raise RuntimeError(
                f"the explore copy cannot follow the policy's LoRA: {'; '.join(problems[:6])}{more}. Do not fuse QKV "
                "projections (fuse_qkv_projections) on the explore copy only: build it from the policy transformer "
                "as it is, so that every LoRA layer has a counterpart of the same name in the copy and every layer "
                "beside one has a source in the policy (or fuse both before the LoRA is attached and target to_qkv)."
            )

    def attach(self, adapters: FollowedAdapters, merge: bool = True) -> None:
        """Follow the policy's "old" adapter: merged + requantized, or as a live BF16 side branch."""
        if self.full_precision and not merge:
            raise ValueError("a full-precision copy exists to hold the LoRA merged; with merge_lora off the policy "
                             "itself samples (its LoRA unmerged)")  # fmt: skip
        self.check_follows(adapters)
        self.merge = merge
        if not merge:
            if self.producers is not None:  # the side branches read the layers' input: their producers write it again
                n = keep_outputs(self.transformer, self.producers, adapters.layers)
                if n:
                    log.info("%d producer(s) write their output beside the codes again: the unmerged LoRA's side "
                             "branches read it (merge_lora=false)", n)  # fmt: skip
            for name in adapters.layers:
                a, b, scale = adapters.side_branch(name)
                layer = self._root.get_submodule(name)

                def hook(_m: nn.Module, inp: tuple[torch.Tensor], out: torch.Tensor, a=a, b=b, scale=scale):
                    x = inp[0].to(a.dtype)
                    return out + (scale * nn.functional.linear(nn.functional.linear(x, a), b)).to(out.dtype)

                layer.register_forward_hook(hook)
        if not self.te:
            self.shared_bytes = self._share_frozen(adapters, exclude=set(adapters.layers) if merge else set())
        self.refresh(adapters)

    @torch.no_grad()
    def _share_frozen(self, adapters: FollowedAdapters, exclude: set[str]) -> int:
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
            if type(src).__name__ == "DTensor":  # a sharded policy's (a staged start-up attaches after sharding): its
                continue  # shards are no whole weight to compute with, so the copy keeps its own
            if src.device == p.device:  # (a copy built borrowing already points there)
                saved += p.numel() * p.element_size()
                if src.data_ptr() != p.data_ptr():
                    borrow(p, src.data)  # marked: a later requantize_ from a source gives it its own storage first
        return saved

    @property
    def borrowed_bytes(self) -> int:
        """Bytes of the copy's high-precision tensors that are the policy's own storage (borrowed, not copied)."""
        return sum(p.numel() * p.element_size() for p in self.transformer.parameters() if getattr(p, BORROWED, False))

    @torch.no_grad()
    def refresh(self, adapters: FollowedAdapters) -> int:
        """Write the updated "old" policy into the copy; returns the number of layers rewritten.

        Every LoRA-merged weight must land somewhere: quantized layers are re-quantized, layers kept
        in high precision get the merged weight copied in. A
        LoRA layer the copy lacks or bypasses, or a layer of the copy with no source beside one (QKV
        projections fused on the copy), is an error, not a silent skip. The weights come a block at a time (each
        block checked before it is written), so the refresh never holds a second copy of the whole policy.
        """
        if not self.merge:
            return 0
        self.check_follows(adapters)
        merged = adapters.merged_weights()  # a mapping whose tensors are made as they are read (LazyWeights)
        if self.te:
            from solrl_engine.nn.te import refresh_te_

            return refresh_te_(self.transformer, {f"module.{k}": v for k, v in merged.items()})
        mods = dict(self.transformer.named_modules())
        quant = sum(k.endswith(".weight") and isinstance(mods.get(k.removesuffix(".weight")), QuantLinear)
                    for k in merged)  # fmt: skip
        done = 0  # a block at a time ("transformer_blocks.3..."): one block's merged weights live at once
        for _, group in itertools.groupby(merged, key=_block_of):
            names = list(group)
            with self.whole_blocks(names) if self.whole_blocks is not None else contextlib.nullcontext():
                part = {k: merged[k] for k in names}  # high-precision layers copied too
                done += requantize_(self.transformer, source=part, strict=False)
        if done != quant:  # cannot happen once check_follows passed; a guard against silent partial refreshes
            raise RuntimeError(f"refreshed {done} of the {quant} quantized LoRA layers of the explore copy")
        return len(merged)


def _block_of(name: str) -> str:
    """The block a weight's name belongs to: its name up to the block's index ("transformer_blocks.3",
    "transformer_2.blocks.17" of a two-expert model), else its first two parts (the root's own layers): what a
    refresh merges, and a split copy gathers, at a time."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def speed_bound(ro: Any, copy: ExploreCopy, spec: ExploreSpec) -> dict[str, Any] | None:
    """The copy's quantized share of the denoiser's GEMM FLOPs (one eager step of `ro`, a
    sampling.Rollouts, at batch 1) and the Amdahl bound it puts on the explore forward's speedup at the
    GEMM rate ratio: measured at start where auto timed it, else the tensor cores' nominal ratio on a
    GPU (none on a CPU)."""
    if copy.te or not copy.report.quantized:
        return None
    share = ro.linear_flops(copy.transformer).quantized_share()
    fmt = copy.quant_recipe.format
    t = spec.timings_ms
    if t.get("policy") and t.get(spec.precision):
        rate, how = t["policy"] / t[spec.precision], "measured at start"
    elif ro.device.type == "cuda" and fmt in TENSOR_CORES:
        rate, how = TENSOR_CORES[fmt].nominal_speedup, "the tensor cores' nominal ratio"
    else:
        line = f"{share:.0%} of the denoiser's GEMM FLOPs in {copy.recipe} (no GEMM timing to bound the speedup)"
        return {"quantized_flop_share": share, "gemm_speedup": None, "bound": None, "line": line}
    bound = amdahl_bound(share, rate)
    line = (f"{share:.0%} of the denoiser's GEMM FLOPs in {copy.recipe}: at most {bound:.2f}x per forward at "
            f"{rate:.2f}x per GEMM ({how})")  # fmt: skip
    return {"quantized_flop_share": share, "gemm_speedup": rate, "bound": bound, "line": line}


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
ATTENTION_TAG = "explore attention"  # the fast-path record's key of the explore copy's attention calls


def key_padding_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """An attention mask that masks keys only (its query dimension 1, broadcast over q's batch and heads: the padding
    of a text or joint sequence, as SANA's cross-attention and Qwen-Image's joint attention pass) as an additive FP32
    bias [*q's leading dims, keys] (a boolean mask: 0 where True, -inf where False); None for any other mask."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] != 1 or mask.shape[-1] != k.shape[-2]:
        return None
    lead = q.shape[:-2]
    try:
        if torch.broadcast_shapes(mask.shape[:-2], lead) != lead:
            return None
    except RuntimeError:
        return None
    bias = mask.float() if mask.dtype != torch.bool else torch.zeros(mask.shape, device=mask.device).masked_fill(
        ~mask, float("-inf"))  # fmt: skip
    return bias.squeeze(-2).expand(*lead, k.shape[-2])


class _RoundedAttention(TorchFunctionMode):
    """Within a forward, every F.scaled_dot_product_attention runs in a low-precision format: through the format's
    attention op (`kernel`: its kernel where it runs, its reference elsewhere; it records which) where the call is
    one it takes (no mask but a key-padding one, no dropout, causal mask or grouped heads), else with q, k and v
    through `rounding` (the format's attention numerics, emulated) before it runs as it would."""

    def __init__(self, rounding: Any, kernel: Any = None) -> None:
        super().__init__()
        self.rounding, self.kernel = rounding, kernel

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        if self.kernel is not None and not call.get("dropout_p") and not call.get("is_causal") \
                and not call.get("enable_gqa") and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] \
                and q.shape[-1] == k.shape[-1] == v.shape[-1]:  # fmt: skip
            mask = call.get("attn_mask")
            bias = key_padding_bias(mask, q, k)
            if mask is None or bias is not None:
                return self.kernel(q, k, v, call.get("scale"), ATTENTION_TAG, bias)
        q, k, v = self.rounding(q, k, v)
        return func(q, k, v, **call)
