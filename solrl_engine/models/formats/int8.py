"""INT8 quantizes every eligible layer: on the bundled model its previews rank as the BF16 previews do (Spearman
0.948 vs 0.948, bench/results/2026-11-25-cpu-tiny-recipes-8bit.json, docs/nvfp4-recipes-and-fidelity.md)."""

from solrl_engine.models.formats import FormatRule

RULE = FormatRule("int8", {"include": (), "skip_max_dim": 0},
                  "INT8 on every eligible layer ranked as BF16 previews do (0.948 vs 0.948, bundled model)")
