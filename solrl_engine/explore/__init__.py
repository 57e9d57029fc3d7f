"""Sol-RL's explore layer: the cheap pass over N seeds per prompt, the contrastive K kept, and how faithfully
the cheap ranking matched the full-precision one. Below rl/: it never imports rl/ or reads RLConfig.

- plan: what was asked (ExploreSettings) and the model family -> one resolved ExploreSpec (precision, layer
  rule, reasons); from then on every layer reads the spec.
- choice: explore_precision=auto, one way (the tensor-core table of kernels, then a timed probe).
- copy: the quantized twin of the policy's transformer and its in-place refresh.
- ranking: contrastive selection and rank statistics.
- explorer: the public Explorer / Selection other trainers use, and the trainer too.

Submodules import each other by full path (solrl_engine.explore.<module>), never this package, so that
importing one never runs another's imports in a circle.
"""

from solrl_engine.explore.choice import POLICY, ExploreChoice
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.explore.explorer import Explorer, Regenerated, Selection
from solrl_engine.explore.plan import ExploreSettings, ExploreSpec

# `plan` itself is solrl_engine.explore.plan.plan: re-exported here it would hide its module of the same name
__all__ = ["POLICY", "ExploreChoice", "ExploreCopy", "ExploreSettings", "ExploreSpec", "Explorer", "Regenerated",
           "Selection"]
