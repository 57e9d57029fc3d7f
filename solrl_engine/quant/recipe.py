"""Quantization recipes: which layers are quantized, to which format, and whether activations are.

A recipe is data, not code, so configs can name one by string ("nvfp4") and tests can build one.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields, replace

from solrl_engine.quant.formats import all_numerics, format_names, numerics

# the formats (quant/<fmt>.py's NUMERICS), fewest bits first: ("nvfp4", "fp8", "int8", "bf16")
FORMATS: tuple[str, ...] = format_names()
RHT_SIZES: tuple[int, ...] = (16, 32, 64, 128)
# the recipe options that apply to one format only (QuantRecipe fields; an explore config's explore_<option>): NVFP4's
FORMAT_OPTIONS: tuple[str, ...] = tuple(dict.fromkeys(o for f in all_numerics().values() for o in f.options))

# Layers kept in high precision by default: embedders (timestep, caption, patch), the adaLN
# modulation and final projection. They are small, run once per step, and errors there shift every
# token at once; the FP4 literature and the Sol-RL code keep them out of the quantized set.
# `proj_out` is the final projection only: FLUX's single-stream blocks have their own `proj_out`
# (about 15% of its parameters), an ordinary MLP/attention output that is quantized. Every adaLN
# modulation linear (norm1, norm1_context, FLUX's single-block `norm`, norm_out) is kept.
DEFAULT_SKIP: tuple[str, ...] = (
    "*embed*",
    "*caption_projection*",
    "*norm_out*",
    "proj_out",
    "*adaLN*",
    "*adaln*",
    "*.norm.linear",
    "*.norm1.linear",
    "*.norm1_context.linear",
    "*lm_head*",
)


@dataclass(frozen=True)
class QuantRecipe:
    """How `quantize_model` treats a model.

    format: weight format; "bf16" keeps weights in BF16 (the regeneration precision).
    quantize_activations: W4A4 / W8A8 when True (activations quantized per call), W4A16 / W8A16
        when False.
    skip: fnmatch patterns on qualified module names left unquantized.
    min_dim: layers with in_features or out_features below this stay in high precision.
    skip_max_dim: layers whose larger dimension is <= this stay in high precision (0: off). This is
        Sol-RL's own rule (2432 on SD3.5-L and SANA: their attention projections stay BF16 and only
        the wider MLP layers go to 4 bits); on a model of width w, skip_max_dim = w does the same.
    include: fnmatch patterns; when given, only matching layers are candidates (the per-family
        rules of solrl_engine.models: e.g. SD3.5-L's image-stream MLPs "transformer_blocks.*.ff.*").
    convs_1x1: also quantize 1x1 Conv2d layers (stride 1, no padding, groups 1) as linears over
        channels: SANA's FFN is made of them.
    rht: NVFP4 only: rotate both GEMM operands along K by a seeded n-point random Hadamard transform
        (0: off; 16, 32, 64 or 128), weights once, activations inside their quantize
        (solrl_engine.quant.hadamard). Layers whose in_features it does not divide stay unquantized.
    rht_seed: the seed of the rotation's random signs.
    four_over_six: NVFP4 only: each 16-block takes the scale mapping its max to 4 instead of 6 where
        that decodes closer (weights and activations); same format, same GEMMs.
    lowrank: NVFP4 only: W = up @ down + R with a rank-`lowrank` BF16 branch from W's SVD (taken
        once, when the layer is first quantized) and only the residual R in NVFP4 (SVDQuant's
        split); updates re-quantize the residual against the fixed branch. 0: off.
    """

    format: str = "nvfp4"
    quantize_activations: bool = True
    skip: tuple[str, ...] = field(default=DEFAULT_SKIP)
    min_dim: int = 32
    skip_max_dim: int = 0
    include: tuple[str, ...] = ()
    convs_1x1: bool = True
    rht: int = 0
    rht_seed: int = 0
    four_over_six: bool = False
    lowrank: int = 0

    def __post_init__(self) -> None:
        fmt = numerics(self.format)  # a clear error naming the formats for an unknown one
        if self.rht not in (0, *RHT_SIZES):
            raise ValueError(f"rht must be 0 (off) or one of {RHT_SIZES}; got {self.rht}.")
        if self.lowrank < 0:
            raise ValueError(f"lowrank must be >= 0 (0: no low-rank branch); got {self.lowrank}.")
        extras = [f for f in FORMAT_OPTIONS if getattr(self, f) and f not in fmt.options]
        if extras:
            owners = [n for n, f in all_numerics().items() if extras[0] in f.options]
            raise ValueError(
                f"{', '.join(extras)} apply to {'/'.join(o.upper() for o in owners)} recipes only; this recipe is "
                f"{self.format}. Use format {owners[0]!r} or set {extras[0]} to its default."
            )
        if fmt.quantized and not fmt.weight_only and not self.quantize_activations:
            others = [f"{n}_weight_only" for n, f in all_numerics().items() if f.weight_only]
            raise ValueError(f"{self.format} has no weight-only recipe (its activations are quantized per token); "
                             f"for weight-only low precision use one of {others}.")  # fmt: skip
        if self.min_dim < 1:
            raise ValueError(f"min_dim must be >= 1; got {self.min_dim}.")
        if isinstance(self.skip, str) or isinstance(self.include, str):
            raise TypeError("skip and include must be tuples of patterns, not one string; write skip=('*proj*',).")

    @property
    def name(self) -> str:
        if not numerics(self.format).quantized:
            return self.format
        base = self.format if self.quantize_activations else f"{self.format}_weight_only"
        extras = (f"+rht{self.rht}" if self.rht else "") + ("+4o6" if self.four_over_six else "")
        return base + extras + (f"+lr{self.lowrank}" if self.lowrank else "")

    def skip_reason(self, name: str) -> str | None:
        """The name rule (a skip pattern, or the include patterns) that keeps `name` out, or None."""
        for pat in self.skip:
            if fnmatch.fnmatchcase(name, pat):
                return f"matches skip pattern {pat!r}"
        if self.include and not any(fnmatch.fnmatchcase(name, pat) for pat in self.include):
            return f"not matched by include patterns {self.include}"
        return None

    def with_(self, **changes: object) -> QuantRecipe:
        """A copy with some fields changed (a model family's rule is such a dict of changes);
        `extra_skip` patterns are added to `skip`; lists of patterns are taken as tuples."""
        unknown = set(changes) - {f.name for f in fields(self)} - {"extra_skip"}
        if unknown:
            raise TypeError(f"unknown QuantRecipe field(s) {sorted(unknown)}; fields: {[f.name for f in fields(self)]}")
        for key in ("skip", "include", "extra_skip"):
            if isinstance(changes.get(key), list):
                changes[key] = tuple(changes[key])  # type: ignore[arg-type]
        extra = tuple(changes.pop("extra_skip", ()))  # type: ignore[arg-type]
        if extra:
            changes["skip"] = tuple(changes.get("skip", self.skip)) + extra  # type: ignore[arg-type]
        return replace(self, **changes)  # type: ignore[arg-type]


def _named_recipes() -> dict[str, QuantRecipe]:
    """Every format's named recipes (Numerics.recipe_names): `<fmt>` (activations quantized too),
    `<fmt>_weight_only`, and the format's extra ones."""
    out: dict[str, QuantRecipe] = {}
    for name, fmt in all_numerics().items():
        out[name] = QuantRecipe(name, quantize_activations=fmt.quantized)
        if fmt.quantized and fmt.weight_only:
            out[f"{name}_weight_only"] = QuantRecipe(name, quantize_activations=False)
        for extra, changes in fmt.recipes.items():
            out[extra] = out[name].with_(**changes)
    return out


RECIPES: dict[str, QuantRecipe] = _named_recipes()


def get_recipe(recipe: str | QuantRecipe) -> QuantRecipe:
    """Resolve a recipe name (see RECIPES) or pass a QuantRecipe through."""
    if isinstance(recipe, QuantRecipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)} or pass a QuantRecipe.")
