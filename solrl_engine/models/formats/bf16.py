"""BF16 (a full-precision copy) has no rule of its own: nothing is quantized."""

from solrl_engine.models.formats import FormatRule

RULE = FormatRule("bf16", {}, "a full-precision copy quantizes nothing")
