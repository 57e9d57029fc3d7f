"""Input families every numerics test runs on: fresh random data of several shapes and kinds."""

from __future__ import annotations

from collections.abc import Iterator

import torch

SHAPES = [(1, 16), (7, 48), (64, 256), (3, 5, 128), (33, 1040)]


def families(shape: tuple[int, ...], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) pairs: Gaussian, outlier channels, values spread over 8 decades,
    zero blocks, exact E2M1 rounding ties, tiny magnitudes (fp32 subnormal scales), NaN/Inf."""
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g)

    yield "gaussian", randn()
    x = randn()
    cols = torch.randint(0, k, (max(1, k // 64),), generator=g)
    x[..., cols] *= 300.0
    yield "outlier_channels", x
    spread = torch.logspace(-8, 0, k)[torch.randperm(k, generator=g)]
    yield "decades", randn() * spread
    x = randn()
    x[..., :16] = 0.0
    x.view(-1, k)[0] = 0.0
    yield "zero_blocks", x
    # Every value a multiple of 0.25 with amax 6: scaled values land on E2M1 ties.
    x = torch.randint(-24, 25, shape, generator=g).float() * 0.25
    x.view(-1)[0] = 6.0
    yield "ties", x
    yield "tiny", randn() * 1e-38
    x = randn()
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randint(0, n, (3,), generator=g)
    flat[idx[0]] = float("nan")
    flat[idx[1]] = float("inf")
    flat[idx[2]] = float("-inf")
    yield "nonfinite", x
