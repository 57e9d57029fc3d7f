"""The plan step: what a caller asked of the explore pass (ExploreSettings: the precision or `auto`, the layer
rule's overrides, the NVFP4 options) and the model family turned into ONE resolved ExploreSpec (the precision
used, the full layer rule, why, what was timed, the preview step budget). From then on every part reads the
spec, never a config: the trainer (from RLConfig's explore_* keys), `solrl fidelity`, the CLI and other
trainers' Explorer all come through `plan`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from solrl_engine.explore.choice import EXPLORE_CANDIDATES, POLICY, ExploreChoice, resolve_explore_precision
from solrl_engine.kernels import TENSOR_CORES, format_kernels, formats_with_tensor_cores
from solrl_engine.models import ModelSpec
from solrl_engine.quant.formats import all_numerics, attention_formats, numerics
from solrl_engine.quant.recipe import FORMAT_OPTIONS, RECIPES, RHT_SIZES, get_recipe

log = logging.getLogger("solrl_engine.explore")

# what explore_precision may say: auto (explore.choice), each quantized format's recipe and weight-only recipe,
# the policy's BF16 at the preview steps (bf16), Transformer Engine's NVFP4 (te_nvfp4)
EXPLORE_PRECISIONS = ("auto", *(r for n, f in all_numerics().items() if f.quantized
                                for r in f.recipe_names if r not in f.recipes), "bf16", "te_nvfp4")  # fmt: skip


def option_applies(option: str, precision: str) -> bool:
    """Whether a format option (FORMAT_OPTIONS: explore_rht, ...) applies to explore_precision `precision`: auto
    (it may choose the format the option belongs to) and the recipes of a format that has the option."""
    if precision == "auto":
        return True
    return precision in RECIPES and option in numerics(get_recipe(precision).format).options



@dataclass(frozen=True)
class ExploreSettings:
    """What was asked of the explore pass: RLConfig's explore_* keys (`key` names them), or the Explorer's
    arguments. `layers` / `skip` / `skip_max_dim` override the family's layer rule (None: keep it)."""

    precision: str = "auto"
    layers: tuple[str, ...] | None = None
    skip: tuple[str, ...] | None = None
    skip_max_dim: int | None = None
    rht: int = 0
    four_over_six: bool = False
    lowrank: int = 0
    attention: str = "bf16"  # a format (attention_formats()): the copy's q, k, v in it (ExploreCopy.set_attention)

    @property
    def timed_at_start(self) -> bool:
        """Whether the precision is resolved by timing the model's layers at start (auto: its probe's memory)."""
        return self.precision == "auto"

    @staticmethod
    def key(name: str) -> str:
        """The RLConfig key of a field: explore_<name>."""
        return f"explore_{name}"

    @classmethod
    def from_quantize(cls, precision: str, quantize: Mapping[str, Any] | None) -> ExploreSettings:
        """The Explorer's spelling: `quantize` holds QuantRecipe changes (include, extra_skip, skip_max_dim
        and the NVFP4 options)."""
        q = dict(quantize or {})
        return cls(precision, q.get("include"), q.get("extra_skip"), q.get("skip_max_dim"), q.get("rht", 0),
                   q.get("four_over_six", False), q.get("lowrank", 0), q.get("attention", "bf16"))  # fmt: skip

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong and how to fix it) for every value that cannot run, in the order a config is
        checked; empty when all can."""
        out: list[tuple[str, str]] = []
        if self.precision not in EXPLORE_PRECISIONS:
            out.append(("precision", f"choose one of {EXPLORE_PRECISIONS}"))
        if self.skip_max_dim is not None and self.skip_max_dim < 0:
            out.append(("skip_max_dim", "must be >= 0 (0 quantizes layers of every width)"))
        if self.rht not in (0, *RHT_SIZES):
            sizes = ", ".join(map(str, RHT_SIZES[:-1])) + f" or {RHT_SIZES[-1]}"
            out.append(("rht", f"choose 0 (off), {sizes} (the rotation size along K)"))
        if self.lowrank < 0:
            out.append(("lowrank", "must be >= 0 (0: no low-rank branch)"))
        if self.attention not in attention_formats():
            others = " or ".join(attention_formats()[1:])
            out.append(("attention", f"choose bf16 (as the policy) or {others} (q, k, v in that format in the explore "
                                     "pass only)"))  # fmt: skip
        for name in FORMAT_OPTIONS:
            if getattr(self, name) and not option_applies(name, self.precision):
                owner = next(n for n, f in all_numerics().items() if name in f.options)
                out.append((name, f"applies to {owner.upper()} explore recipes; explore_precision is "
                                  f"{self.precision!r}: set explore_precision={owner} (or auto) or leave it at its "
                                  "default"))  # fmt: skip
        return out


def explore_rule(settings: ExploreSettings, model: ModelSpec, precision: str | None = None) -> dict[str, Any]:
    """The explore copy's layer rule (QuantRecipe changes): the model family's (the paper's choice), widened for
    a format that allows it (`model.explore_rule_by_format`, e.g. INT8 on every eligible layer), each part
    overridable (layers, skip, skip_max_dim), then the NVFP4 options that are set."""
    rule = dict(model.explore_rule)
    if precision is not None and precision in RECIPES:
        rule.update(model.explore_rule_by_format.get(get_recipe(precision).format, {}))
    if settings.layers is not None:
        rule["include"] = tuple(settings.layers)
    if settings.skip is not None:
        rule["extra_skip"] = tuple(settings.skip)
    if settings.skip_max_dim is not None:
        rule["skip_max_dim"] = settings.skip_max_dim
    for name in FORMAT_OPTIONS:
        if getattr(settings, name):
            rule[name] = getattr(settings, name)
    return rule


def device_problems(settings: ExploreSettings, capability: tuple[int, int]) -> list[tuple[str, str]]:
    """(field, why and what this GPU runs) for an explore format or attention mode that a GPU of `capability`
    cannot run fast (the format's kernels part: where its linear has a GPU implementation, where its attention
    kernel's tensor cores start): a run would crawl through the reference, so it is refused at plan time. auto
    and bf16 always run."""
    out: list[tuple[str, str]] = []
    sm = f"sm_{capability[0]}{capability[1]}"
    kinds = format_kernels()
    runs = [f for f, k in kinds.items() if k.fast_from is not None and capability >= k.fast_from]
    if settings.precision in RECIPES:
        fmt = get_recipe(settings.precision).format
        need = kinds[fmt].fast_from
        if need is not None and capability < need:
            out.append(("precision", f"{sm} runs no {numerics(fmt).label} GEMM fast (needs sm_{need[0]}{need[1]}+); "
                                     f"this GPU runs {', '.join(runs) or 'no quantized format'}, auto (which times "
                                     "them) or bf16"))  # fmt: skip
    att = kinds.get(settings.attention)
    if att is not None and att.attention_op and att.tensor_cores and capability < att.tensor_cores.needs:
        need = att.tensor_cores.needs
        ok = [f for f, k in kinds.items() if k.attention_op and k.tensor_cores and capability >= k.tensor_cores.needs]
        out.append(("attention", f"{sm} has no {att.tensor_cores.label} tensor cores for the {settings.attention} "
                                 f"attention kernel (needs sm_{need[0]}{need[1]}+); choose "
                                 f"{' or '.join(['bf16', *ok])}"))  # fmt: skip
    return out


@dataclass(frozen=True)
class ExploreSpec:
    """The explore pass as resolved: the precision used (a recipe name, "te_nvfp4", "bf16", or POLICY: the
    policy itself explores), the full layer rule (the copy's QuantRecipe changes), why, what `auto` timed (ms;
    empty where nothing was), and the NVFP4 options dropped because `auto` chose another format."""

    precision: str
    rule: Mapping[str, Any]
    reason: str
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    attention: str = "bf16"  # the copy's attention (ExploreSettings.attention)
    timed_at_start: bool = False  # foreseen (`foresee`): one of auto's answers, which its probe at start picks
    producers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # ModelSpec.producers: fused in the copy
    producer_blocks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)  # ModelSpec.producer_blocks

    @property
    def quantized(self) -> bool:
        """Whether a quantized copy explores (else the policy itself does)."""
        return self.precision != POLICY

    @property
    def storage(self) -> str:
        """The recipe whose tensors the copy stores (Transformer Engine's NVFP4 layers store NVFP4)."""
        return "nvfp4" if self.precision == "te_nvfp4" else self.precision

    @property
    def built_from_whole_copy(self) -> bool:
        """Whether building the copy first copies the whole transformer (Transformer Engine's layers take a deep
        copy over; ours are built on the base's own storage)."""
        return self.precision == "te_nvfp4"


def plan(
    settings: ExploreSettings,
    model: ModelSpec,
    device: torch.device | str,
    dtype: torch.dtype,
    transformer: nn.Module | None = None,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    agree: Callable[[ExploreChoice], ExploreChoice] | None = None,
    choice: ExploreChoice | None = None,
    measure: bool = True,
    rows: int | None = None,
) -> ExploreSpec:
    """Resolve `settings` for `model` on `device`: a set precision passes through; `auto` times this model's
    layers (explore.choice) unless `choice` is given (a checkpoint's); `agree` makes every rank take one
    answer (rank 0's timing, under torchrun); `measure` False resolves `auto` by the hardware plan, untimed;
    `rows`: the token rows `auto` times each layer at (Rollouts.forward_rows).
    The NVFP4 options are dropped, with a warning, when the
    precision used is not NVFP4."""
    if choice is None:
        choice = resolve_explore_precision(settings.precision, device, dtype, transformer,
                                           explore_rule(settings, model), autocast=autocast,
                                           measure=measure, rows=rows)  # fmt: skip
        if agree is not None:  # timings differ between ranks; the explore copy must not
            choice = agree(choice)
    return _spec(settings, model, choice)


def _spec(settings: ExploreSettings, model: ModelSpec, choice: ExploreChoice, quiet: bool = False,
          timed_at_start: bool = False) -> ExploreSpec:  # fmt: skip
    """The spec of a resolved choice: the family's rule for its format, the format options (NVFP4's) dropped
    (warned unless `quiet`) where the precision used is a format they do not apply to."""
    rule = explore_rule(settings, model, choice.precision)
    if not quiet:
        log.info("explore precision %s: %s", choice.precision, choice.reason)
    dropped = tuple(k for k in FORMAT_OPTIONS if k in rule and not option_applies(k, choice.precision))
    if choice.precision != POLICY and dropped:
        if not quiet:
            owners = "/".join(dict.fromkeys(n.upper() for n, f in all_numerics().items() for k in dropped
                                            if k in f.options))  # fmt: skip
            log.warning("explore_precision=auto chose %s on this device: %s apply to %s only and are not used",
                        choice.precision, ", ".join(ExploreSettings.key(k) for k in dropped), owners)  # fmt: skip
        for k in dropped:
            rule.pop(k)
    else:
        dropped = ()
    if choice.precision == POLICY and settings.attention != "bf16" and not quiet:
        log.warning("explore_precision=auto chose the policy on this device (%s): explore_attention=%s needs an "
                    "explore copy and is not used", choice.reason, settings.attention)  # fmt: skip
    return ExploreSpec(choice.precision, rule, choice.reason, dict(choice.timings_ms), dropped, settings.attention,
                       timed_at_start, dict(model.producers), dict(model.producer_blocks))


def foresee(settings: ExploreSettings, model: ModelSpec, capability: tuple[int, int] | None,
            gpu: bool = True) -> tuple[ExploreSpec, ...]:  # fmt: skip
    """Every spec the explore pass can resolve to at start, known before any model loads (a run's plan, `solrl
    plan`, the memory plan): a set precision, as `plan` passes it through; auto, each format its timing may
    choose on a device of `capability` (those its tensor cores run; on a GPU whose capability is not known, every
    GPU format; on a CPU every candidate), and the policy itself (auto's answer when none is faster). A memory
    plan takes the largest; the start's timing picks one of them."""
    if not settings.timed_at_start:
        return (_spec(settings, model, resolve_explore_precision(settings.precision, "cpu", torch.float32), True),)
    if capability is not None:
        cands = formats_with_tensor_cores(capability)
    else:
        cands = tuple(TENSOR_CORES) if gpu else EXPLORE_CANDIDATES
    where = f"sm_{capability[0]}{capability[1]}" if capability else "a GPU of any architecture" if gpu else "a CPU"
    why = f"auto on {where}: timed at start among {', '.join(cands) or 'no quantized format'} and the policy"
    return tuple(_spec(settings, model, ExploreChoice(p, why), True, True) for p in (*cands, POLICY))
