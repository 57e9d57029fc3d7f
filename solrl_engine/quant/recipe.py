"""Quantization recipes: which layers are quantized, to which format, and whether activations are.

A recipe is data, not code, so configs can name one by string ("nvfp4") and tests can build one.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields, replace
from typing import Literal

Format = Literal["nvfp4", "fp8", "int8", "bf16"]
FORMATS: tuple[str, ...] = ("nvfp4", "fp8", "int8", "bf16")
RHT_SIZES: tuple[int, ...] = (16, 32, 64, 128)
# the recipe options that apply to NVFP4 only (QuantRecipe fields; an explore config's explore_<option>)
NVFP4_OPTIONS: tuple[str, ...] = ("rht", "four_over_six", "lowrank")

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

    format: Format = "nvfp4"
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
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantization format {self.format!r}; choose one of {FORMATS}.")
        if self.rht not in (0, *RHT_SIZES):
            raise ValueError(f"rht must be 0 (off) or one of {RHT_SIZES}; got {self.rht}.")
        if self.lowrank < 0:
            raise ValueError(f"lowrank must be >= 0 (0: no low-rank branch); got {self.lowrank}.")
        extras = [f for f in NVFP4_OPTIONS if getattr(self, f)]
        if extras and self.format != "nvfp4":
            raise ValueError(
                f"{', '.join(extras)} apply to NVFP4 recipes only; this recipe is {self.format}. "
                f"Use format 'nvfp4' or set {extras[0]} to its default."
            )
        if self.format == "int8" and not self.quantize_activations:
            raise ValueError("int8 is a W8A8 recipe (activations quantized per token); for weight-only 8 bits use "
                             "fp8_weight_only.")  # fmt: skip
        if self.min_dim < 1:
            raise ValueError(f"min_dim must be >= 1; got {self.min_dim}.")
        if isinstance(self.skip, str) or isinstance(self.include, str):
            raise TypeError("skip and include must be tuples of patterns, not one string; write skip=('*proj*',).")

    @property
    def name(self) -> str:
        if self.format == "bf16":
            return "bf16"
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


RECIPES: dict[str, QuantRecipe] = {
    "nvfp4": QuantRecipe("nvfp4", quantize_activations=True),
    "nvfp4_weight_only": QuantRecipe("nvfp4", quantize_activations=False),
    "fp8": QuantRecipe("fp8", quantize_activations=True),
    "fp8_weight_only": QuantRecipe("fp8", quantize_activations=False),
    # W8A8 symmetric INT8 (per-token activations, per-channel weights): Ampere's fast explore format
    "int8": QuantRecipe("int8", quantize_activations=True),
    "bf16": QuantRecipe("bf16", quantize_activations=False),
    # NVFP4 beyond the TE recipe (same format and GEMMs): a Hadamard rotation, 4-over-6 block scales
    "nvfp4_rht16": QuantRecipe("nvfp4", rht=16),
    "nvfp4_4o6": QuantRecipe("nvfp4", four_over_six=True),
    "nvfp4_rht16_4o6": QuantRecipe("nvfp4", rht=16, four_over_six=True),
}


def get_recipe(recipe: str | QuantRecipe) -> QuantRecipe:
    """Resolve a recipe name (see RECIPES) or pass a QuantRecipe through."""
    if isinstance(recipe, QuantRecipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)} or pass a QuantRecipe.")
