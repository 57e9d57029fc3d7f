"""NVFP4 keeps the family's own rule: it is the paper's layer choice for 4-bit previews."""

from solrl_engine.models.formats import FormatRule

RULE = FormatRule("nvfp4", {}, "the family's explore_rule is the paper's NVFP4 layer choice")
