"""BF16 as a format: the policy's own precision (the regeneration's), stored as it is.

It is a format so that a full-precision copy (explore_precision=bf16) goes through the same handlers as the
quantized ones; nothing is rounded beyond BF16 itself.
"""

from __future__ import annotations

from solrl_engine.quant.formats import Numerics

NUMERICS = Numerics("bf16", "BF16", 16, lambda k, n: 2 * k * n, quantized=False, weight_only=False)
