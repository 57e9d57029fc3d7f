"""BF16's part in kernels/: no tensor-core row of its own (the policy's precision is the baseline every row's
speedup is measured against) and no op of ours: a BF16 layer runs torch's own linear."""

from __future__ import annotations

from solrl_engine.kernels.capability import FormatKernels

KERNELS = FormatKernels("bf16", None, None)
