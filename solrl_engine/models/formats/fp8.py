"""FP8 keeps the family's (NVFP4) rule until a fidelity search on real weights widens it: FP8 on every layer of the
bundled model ranked its previews at Spearman 0.915 against BF16 previews' 0.948
(bench/results/2026-11-25-cpu-tiny-recipes-8bit.json)."""

from solrl_engine.models.formats import FormatRule

RULE = FormatRule("fp8", {}, "every layer in FP8 fell to 0.915 Spearman against 0.948 (bundled model): the "
                             "family's rule is kept")  # fmt: skip
