"""Each format's part in models/: the explore copy's default layer rule in that format, on top of a family's own
(ModelSpec.explore_rule, the paper's NVFP4 choice). One module per format, each declaring `RULE`; a family's
`explore_rule_by_format` starts from these and may override one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from solrl_engine.quant.formats import gather


@dataclass(frozen=True)
class FormatRule:
    """format: its name; changes: QuantRecipe changes on top of the family's rule ({}: keep it); why: the evidence."""

    format: str
    changes: dict[str, Any] = field(default_factory=dict)
    why: str = ""


@functools.cache
def _rules() -> dict[str, FormatRule]:
    return gather("solrl_engine.models.formats", "RULE")


def format_rules() -> dict[str, FormatRule]:
    """Format name -> its default layer rule (models/formats/<fmt>.py's RULE)."""
    return dict(_rules())


def rule_changes_by_format() -> dict[str, dict[str, Any]]:
    """What ModelSpec.explore_rule_by_format starts as: the formats whose default rule changes the family's."""
    return {f: dict(r.changes) for f, r in _rules().items() if r.changes}
