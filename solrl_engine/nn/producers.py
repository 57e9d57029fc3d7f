"""The quantize where its input is made: an explore copy's adaLN-Zero producers emit their output's 8-bit codes.

Why: in an adaLN-Zero block the norm's output y = layer_norm(x) * (1 + scale) + shift feeds three or four linears
(to_q, to_k, to_v, and a FLUX single block's proj_mlp), and each quantizes y per row again: one producer pass and
three or four quantize passes over the same rows. A fused producer computes y and its row-wise codes in one pass
(kernels.producers: one Triton kernel on a GPU) and hands them on as `Prequantized`, a tensor that is y to every
op and carries the codes; a QuantLinear of that format takes the codes instead of quantizing. Which modules
produce for which linears is model knowledge (ModelSpec.producers); how each producer class is fused is here.

Two kinds of producer. An adaLN module (diffusers' AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous):
its fused forward is the module's own, with the norm and modulation handed to the op. A plain LayerNorm whose block
modulates its output inline (SANA's, Wan's, Qwen-Image's, FLUX.2's blocks and FLUX.1's and SD3.5's FFN norms write
`norm(x) * (1 + scale) + shift` in their forward): the block gets its family's fused forward (models/<family>.py,
through `modulate`), which hands the norm, the modulation and the cast that follows to the op. Activations are
producers the same two ways: diffusers' GELU module (an FFN's first linear and its tanh GELU), or an activation its
block applies inline (FLUX.1's single block's GELU: `activate_after`; SANA's FFN gate `a * silu(g)` and FLUX.2's
SwiGLUs: `gate`, through their modules' fused forwards). Z-Image's weighted RMS norms times their modulation go
through `scaled_rms`, and its SwiGLU FFN (two linears gated) has a fused forward of its own. Either way names and
state dicts are unchanged (the class is swapped for a subclass), and on the reference backend (a CPU) y and its codes
equal the stock expression's and the linear's own quantize bit for bit. Both keep the stock path where autograd
records or the modulation is not one row per sample.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from solrl_engine import kernels  # registers the producers' ops (solrl::adaln_quantize, ...)
from solrl_engine.nn.quant_linear import Prequantized, QuantLinear
from solrl_engine.quant.formats import rowwise_formats

# where autocast runs layer_norm in FP32 (CUDA's autocast lists it; CPU's keeps the input's dtype: a BF16 norm, then
# the modulation's BF16 ops), so the fused op computes what the stock module computes there
FP32_NORM_UNDER_AUTOCAST = ("cuda",)


def _matches(name: str, pattern: str) -> bool:
    """fnmatch per dotted segment: `blocks.*.norm` names a block's norm, not the LayerNorm inside it."""
    a, b = name.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b, strict=True))


def _emit(owner: nn.Module, norm: nn.Module, x: torch.Tensor, one_plus: torch.Tensor, shift: torch.Tensor,
          out_dtype: torch.dtype | None, fp32_norm: bool = False) -> Prequantized | None:  # fmt: skip
    """The fused y and its codes for a modulation [B, K] where `owner` is fused and the op takes the call, else None
    (the caller computes its stock expression). `fp32_norm`: the norm of x in FP32 whatever autocast does."""
    fmt = owner.__dict__.get("_solrl_fmt")
    grad = torch.is_grad_enabled() and (x.requires_grad or one_plus.requires_grad or shift.requires_grad)
    if fmt is None or grad or x.dim() != 3 or one_plus.dim() != 2 or one_plus.shape[0] != x.shape[0]:
        return None
    dev = x.device.type
    fp32 = fp32_norm or (dev in FP32_NORM_UNDER_AUTOCAST and torch.is_autocast_enabled(dev))
    keep = _keeps(owner)
    y, codes, s = torch.ops.solrl.adaln_quantize(x, one_plus, shift, norm.eps, fmt, fp32, _tag(owner),
                                                 out_dtype, keep)  # fmt: skip
    return Prequantized(y, codes, s, fmt, keep)


def _tag(owner: nn.Module) -> str:
    """The producer's record tag (dispatch.runs), "" while torch.compile traces: a graph keeps no per-call record
    (sampling.compile's census does), and reading a per-instance string there would guard on it, compiling every
    block again (FLUX.1-dev's 57) instead of once per block class."""
    return "" if torch.compiler.is_compiling() else owner.__dict__["_solrl_tag"]


def _keeps(owner: nn.Module) -> bool:
    """Whether a fused producer writes y beside its codes: False where every op that reads its output is a linear
    taking the codes (FusedProducers.codes_only), so the kernel writes the codes alone."""
    return owner.__dict__.get("_solrl_keep_y", True)


def produce(module: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """module.norm(x) * (1 + scale[:, None]) + shift[:, None], with its row-wise codes when the module is fused
    (`fuse_producers`) and the call is one the op takes; else exactly the stock expression."""
    one_plus = 1 + scale
    got = _emit(module, module.norm, x, one_plus, shift, None) if scale.dim() == 2 else None
    return got if got is not None else module.norm(x) * one_plus[:, None] + shift[:, None]


def modulate(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
             out_dtype: torch.dtype | None = None, fp32_norm: bool = False) -> torch.Tensor:  # fmt: skip
    """(norm(x) * (1 + scale) + shift).to(out_dtype) for a modulation [B, 1, K], as a block that modulates inline
    writes it (models/<family>.py's fused block forwards call this), with its row-wise codes
    when `fuse_producers` fused `norm` and the call is one the op takes; else exactly that expression (a per-token
    modulation [B, T, K] included). `fp32_norm`: norm(x.float()), as Wan writes it (the op widens x as it reads it,
    so the fused path makes no FP32 copy of x)."""
    one_plus = 1 + scale
    got = None
    if one_plus.dim() == 3 and one_plus.shape[1] == 1 and shift.shape == one_plus.shape:
        got = _emit(norm, norm, x, one_plus.squeeze(1), shift.squeeze(1), out_dtype, fp32_norm)
    if got is not None:
        return got
    y = norm(x.float() if fp32_norm else x) * one_plus + shift
    return y if out_dtype is None else y.to(out_dtype)


def activate_after(act: nn.Module, prefix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch.cat([prefix, act(x)], dim=-1), as FLUX.1's single block joins its attention's output and its MLP's
    activation for its output projection, with the row-wise codes of the whole row when `fuse_producers` fused `act`
    (an nn.GELU of the tanh form) and the call is one the op takes; else exactly that expression."""
    fmt = act.__dict__.get("_solrl_fmt")
    grad = torch.is_grad_enabled() and (x.requires_grad or prefix.requires_grad)
    if fmt is None or grad or x.dim() < 2 or prefix.shape[:-1] != x.shape[:-1]:
        return torch.cat([prefix, act(x)], dim=-1)
    keep = _keeps(act)
    return Prequantized(*torch.ops.solrl.gelu_quantize(x, fmt, _tag(act), prefix, keep), fmt, keep)


def gate(owner: nn.Module, x: torch.Tensor, dim: int = 1, gate_first: bool = False,
         prefix: torch.Tensor | None = None, second: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """a * silu(g) for x's two halves [a, g] along `dim` ([g, a] with `gate_first`: FLUX.2's SwiGLU, `silu(first) *
    second`, the same product; with `second`, the halves are x and `second`: Z-Image's SwiGLU of two linears),
    after `prefix` along the last dimension where given; as SANA's GLUMBConv gates its depthwise convolution's
    output (channels: dim 1) and FLUX.2's and Z-Image's FFNs their first linears' outputs. With the row-wise codes
    of the result over `dim` (SANA: one row per pixel, handed over in x's layout) when `fuse_producers` fused
    `owner` (the module that applies the SiLU: SANA's nn.SiLU, FLUX.2's SwiGLU, Z-Image's FFN) and the call is one
    the op takes; else exactly that expression."""
    fmt = owner.__dict__.get("_solrl_fmt")
    grad = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in (x, prefix, second))
    last = dim in (-1, x.dim() - 1)
    joins = prefix is None or (last and prefix.shape[:-1] == x.shape[:-1])
    pairs = x.shape[dim] % 2 == 0 if second is None else (last and second.shape == x.shape)
    if fmt is None or grad or not pairs or not joins:
        first, other = torch.chunk(x, 2, dim=dim) if second is None else (x, second)
        y = F.silu(first) * other if gate_first else first * F.silu(other)
        return y if prefix is None else torch.cat([prefix, y], dim=-1)
    keep = _keeps(owner)
    y, codes, s = torch.ops.solrl.glu_quantize(x.movedim(dim, -1), fmt, _tag(owner), gate_first,
                                               prefix, second, keep)  # fmt: skip
    return relayout(Prequantized(y, codes, s, fmt, keep), lambda t: t.movedim(-1, dim))


def scaled_rms(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """norm(x) * scale for diffusers' RMSNorm `norm` and a modulation scale [B, 1, K] (Z-Image's `1 + scale`; none:
    norm(x) alone), as a block that modulates its RMS norms inline writes it, with the row-wise codes when
    `fuse_producers` fused `norm` and the call is one the op takes (one modulation row per sample, no autograd);
    else exactly that expression."""
    fmt = norm.__dict__.get("_solrl_fmt")
    grad = torch.is_grad_enabled() and (x.requires_grad or (scale is not None and scale.requires_grad))
    rows = scale is None or (scale.dim() == 3 and scale.shape[1] == 1 and scale.shape[0] == x.shape[0])
    if fmt is None or grad or x.dim() != 3 or not rows:
        return norm(x) if scale is None else norm(x) * scale
    sc = None if scale is None else scale.squeeze(1)
    keep = _keeps(norm)
    return Prequantized(*torch.ops.solrl.rms_quantize(x, norm.weight, norm.eps, sc, fmt, _tag(norm),
                                                      keep), fmt, keep)  # fmt: skip


def relayout(y: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`change` (a view: unflatten, permute) applied to y, and to its codes and scales where y carries them, so a
    consumer that takes another layout (a 1x1 convolution's NCHW) still finds them."""
    if type(y) is not Prequantized:
        return change(y)
    return Prequantized(change(y.value), change(y.codes), change(y.scale), y.fmt, y.written)


def _ada_zero_forward(self: nn.Module, x: torch.Tensor, timestep: Any = None, class_labels: Any = None,
                      hidden_dtype: Any = None, emb: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """diffusers' AdaLayerNormZero.forward with its norm and modulation through `produce`."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    return produce(self, x, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_zero_single_forward(self: nn.Module, x: torch.Tensor, emb: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """diffusers' AdaLayerNormZeroSingle.forward with its norm and modulation through `produce`."""
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return produce(self, x, scale_msa, shift_msa), gate_msa


def _ada_continuous_forward(self: nn.Module, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
    """diffusers' AdaLayerNormContinuous.forward with its norm and modulation through `produce`."""
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return produce(self, x, scale, shift)


def _gelu_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers' GELU.forward (an FFN's first linear and its activation) with the tanh GELU and the row-wise codes of
    its output in one op, for the FFN's second linear (nn.Dropout in eval passes the codes on); the stock path where
    autograd records."""
    h = self.proj(hidden_states)
    fmt = self.__dict__.get("_solrl_fmt")
    if fmt is None or (torch.is_grad_enabled() and h.requires_grad) or h.dim() < 2:
        return self.gelu(h)
    keep = _keeps(self)
    return Prequantized(*torch.ops.solrl.gelu_quantize(h, fmt, _tag(self), None, keep), fmt, keep)


@functools.cache
def _fusable() -> dict[type, type]:
    """Producer class -> its fused subclass (diffusers is imported on first use: nn/ itself does not need it)."""
    from diffusers.models.activations import GELU
    from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle

    forwards = {AdaLayerNormZero: _ada_zero_forward, AdaLayerNormZeroSingle: _ada_zero_single_forward,
                AdaLayerNormContinuous: _ada_continuous_forward, GELU: _gelu_forward}  # fmt: skip
    return {cls: type(f"Fused{cls.__name__}", (cls,), {"forward": fwd, "__module__": __name__})
            for cls, fwd in forwards.items()}  # fmt: skip


def _why_not(module: nn.Module, block: nn.Module | None, blocks: Mapping[str, Callable]) -> str | None:
    """None when `module` can be fused (an adaLN module or GELU this file fuses; a module `blocks` gives a fused
    forward of its own; a plain LayerNorm, an RMS norm or an activation that its block, `block`, applies inline
    through a fused forward of `blocks`), else why not."""
    from diffusers.models.activations import GELU

    if type(module) is GELU:  # an FFN's first linear and activation
        return None if module.approximate == "tanh" else "an exact (erf) GELU: the fused kernel computes the tanh form"
    if type(module) in _fusable():
        norm = getattr(module, "norm", None)
        if type(norm) is not nn.LayerNorm or norm.elementwise_affine:
            return f"its norm is {type(norm).__name__} (an affine one, or another class), not a plain LayerNorm"
        return None
    if type(module).__name__ in blocks:  # a module the family gives a fused forward of its own (an FFN)
        return None
    if type(module) is _rms_norm() and block is not None and type(block).__name__ in blocks:
        return "an RMS norm with a bias: the fused kernel applies none" if getattr(module, "bias", None) is not None \
            else None
    if isinstance(module, nn.LayerNorm) and block is not None and type(block).__name__ in blocks:
        return "an affine LayerNorm: the fused kernel applies no weight" if module.elementwise_affine else None
    if type(module) is nn.GELU and block is not None and type(block).__name__ in blocks:
        return None if module.approximate == "tanh" else "an exact (erf) GELU: the fused kernel computes the tanh form"
    if block is not None and type(block).__name__ in blocks and not isinstance(module, nn.LayerNorm):
        # an activation its block applies inline (a gate's SiLU, FLUX.2's SwiGLU): its fused forward calls the op
        return None if next(module.parameters(), None) is None else "a module with weights: the kernels apply none"
    names = ", ".join(c.__name__ for c in _fusable())
    where = type(block).__name__ if block is not None else "none"
    return (f"{type(module).__name__} is not a producer class this engine fuses ({names}), nor a LayerNorm or "
            f"activation whose block ({where}) has a fused forward in the family")


@functools.cache
def _rms_norm() -> type:
    """diffusers' RMSNorm (Z-Image's norms), imported on first use."""
    from diffusers.models.normalization import RMSNorm

    return RMSNorm


@functools.cache
def _fused_block(cls: type, forward: Callable) -> type:
    """`cls` with the family's fused forward (same name: regional compilation and sharding find blocks by it)."""
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": forward.__module__, "_solrl_fused": True})


@dataclass
class FusedProducers:
    """What `fuse_producers` did: producer name -> its consumers that take its codes; producer name -> why it was
    left as it is; the producers that write their codes alone (`codes_only`: every linear the family says reads
    their output takes the codes, so no op reads y and its write, 29-44% of the kernel's bytes, is saved)."""

    fmt: str
    fused: dict[str, list[str]] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    codes_only: set[str] = field(default_factory=set)

    def summary(self) -> str:
        if not self.fused and not self.left:
            return ""
        consumers = sum(len(v) for v in self.fused.values())
        line = (f"{len(self.fused)} producer(s) emit {self.fmt} codes for {consumers} linear(s) (a norm and its "
                f"modulation, or an activation, and the quantize in one pass; {len(self.codes_only)} write the codes "
                "alone: only those linears read them)")  # fmt: skip
        reasons: dict[str, int] = {}
        for why in self.left.values():
            reasons[why] = reasons.get(why, 0) + 1
        return "\n".join([line, *(f"  {n} producer(s) not fused: {why}" for why, n in reasons.items())])


def plan_producers(model: nn.Module, producers: Mapping[str, tuple[str, ...]], fmt: str,
                   takes_codes: Callable[[str], bool], blocks: Mapping[str, Callable] | None = None
                   ) -> FusedProducers:  # fmt: skip
    """Which modules of `model` would produce `fmt` codes, without changing it: each module whose name matches a
    pattern of `producers` (fnmatch pattern -> the linears it feeds, named from the producer's parent module) and
    that can be fused (`_why_not`), where at least one of its linears `takes_codes` (by full name); where all of them
    do, it writes its codes alone (`codes_only`: the family's list names every op that reads a producer's output, a
    claim the CPU tests check, the reference's unwritten y being NaN). `fmt` "" (no row-wise format) plans nothing.
    The speed model asks this of a meta model; `fuse_producers` applies it."""
    out = FusedProducers(fmt)
    if not fmt:
        return out
    for name, module in model.named_modules():
        pattern = next((p for p in producers if _matches(name, p)), None)
        if pattern is None:
            continue
        parent = name.rpartition(".")[0]
        block = model.get_submodule(parent) if parent else None
        takers = [c for c in producers[pattern] if takes_codes(f"{parent}.{c}" if parent else c)]
        wide = max((_row_width(model, f"{parent}.{c}" if parent else c) for c in takers), default=0)
        why = _why_not(module, block, blocks or {}) or (None if takers else
                                                        "none of the linears it feeds is quantized with row-wise codes")
        if why is None and wide > kernels.producers.MAX_K:  # the reference would run: slower than the consumers' own
            why = (f"rows of {wide} values: the fused kernels hold at most {kernels.producers.MAX_K}, so its "
                   "linears quantize for themselves")  # fmt: skip
        if why:
            out.left[name] = why
            continue
        out.fused[name] = takers
        if len(takers) == len(producers[pattern]):
            out.codes_only.add(name)
    return out


def _row_width(model: nn.Module, name: str) -> int:
    """The width of the rows the linear (or 1x1 convolution) `name` reads: what its producer's kernel would hold."""
    m = model.get_submodule(name)
    return int(getattr(m, "in_features", None) or getattr(m, "in_channels", 0))


def fuse_producers(model: nn.Module, producers: Mapping[str, tuple[str, ...]],
                   blocks: Mapping[str, Callable] | None = None) -> FusedProducers:  # fmt: skip
    """Fuse each module whose name matches a pattern of `producers` (fnmatch pattern -> the linears it feeds, named
    from the producer's parent module) where at least one of those linears is a QuantLinear that quantizes its input
    in a row-wise format: its output then carries that format's codes. A producer is an adaLN module or an FFN's
    GELU (its class is swapped for a fused subclass) or a plain LayerNorm that its block modulates inline: `blocks`
    (ModelSpec.producer_blocks: block class name -> a forward that modulates through `modulate`) gives the block its
    family's fused forward. In place; module names and state dicts are unchanged. Returns what was fused and what
    was left, with why."""
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.recipe.quantize_activations}
    formats = {m.recipe.format for m in quant.values()} & set(rowwise_formats())
    fmt = next(iter(formats)) if len(formats) == 1 else ""  # none (or a copy mixing formats): nothing takes codes
    out = plan_producers(model, producers, fmt, lambda n: n in quant and quant[n].recipe.format == fmt, blocks)
    for name in out.fused:
        module = model.get_submodule(name)
        if type(module) in _fusable():
            module.__class__ = _fusable()[type(module)]
        elif type(module).__name__ in (blocks or {}):  # a module with its family's fused forward (Z-Image's FFN)
            if not getattr(type(module), "_solrl_fused", False):
                module.__class__ = _fused_block(type(module), blocks[type(module).__name__])
        else:  # an inline producer (a norm its block modulates, an activation): the block takes its fused forward
            block = model.get_submodule(name.rpartition(".")[0])
            if not getattr(type(block), "_solrl_fused", False):
                block.__class__ = _fused_block(type(block), blocks[type(block).__name__])
        module.__dict__["_solrl_fmt"] = fmt
        module.__dict__["_solrl_tag"] = f"{name} (producer)"
        module.__dict__["_solrl_keep_y"] = name not in out.codes_only
        _no_dropout(model.get_submodule(name.rpartition(".")[0]) if "." in name else model)
    return out


def _no_dropout(parent: nn.Module) -> None:
    """The nn.Dropout children of a producer's parent (an FFN's `net`: GELU, Dropout, Linear) become nn.Identity, as
    they are in an explore copy's eval mode: under torch.compile an nn.Dropout's F.dropout runs on y and hands the
    next linear a plain tensor, losing the codes (and reading a y a codes-alone producer never wrote). No state
    changes (a dropout has none)."""
    for child_name, child in parent.named_children():
        if isinstance(child, nn.Dropout):
            setattr(parent, child_name, nn.Identity())


def keep_outputs(model: nn.Module, fused: FusedProducers, readers: Iterable[str]) -> int:
    """Make the codes-only producers that feed any of the linears `readers` (full names) write y again: those linears
    read their input beside the codes (an unmerged LoRA's side branch, explore/copy.py). Returns how many changed."""
    names = set(readers)
    changed = 0
    for name in sorted(fused.codes_only):
        parent = name.rpartition(".")[0]
        if any((f"{parent}.{c}" if parent else c) in names for c in fused.fused[name]):
            fused.codes_only.discard(name)
            model.get_submodule(name).__dict__["_solrl_keep_y"] = True
            changed += 1
    return changed


@contextlib.contextmanager
def paused(model: nn.Module, fused: FusedProducers) -> Iterator[None]:
    """Inside, `model`'s fused producers compute their stock expressions and their consumers quantize for themselves,
    as in an unfused copy (the fused forwards stay: they take the stock path): what the producers are worth, timed on
    the same copy (the GPU session's forwards stage), with no second copy in memory."""
    held = {n: model.get_submodule(n).__dict__.pop("_solrl_fmt", None) for n in fused.fused}
    try:
        yield
    finally:
        for name, fmt in held.items():
            if fmt is not None:
                model.get_submodule(name).__dict__["_solrl_fmt"] = fmt
