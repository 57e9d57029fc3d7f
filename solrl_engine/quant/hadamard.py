"""Random Hadamard rotation along K (reference numerics): spreads outliers across each 4-bit block.

R = D H_n / sqrt(n), block-diagonal over groups of n consecutive elements of the last dimension:
D a fixed random +-1 diagonal (seeded), H_n the Sylvester Hadamard matrix. R is orthogonal, so
rotating both GEMM operands along K leaves the product unchanged, (x R)(W R)^T = x W^T, while an
outlier channel is spread over the n elements of its group and no longer sets a block's scale alone.
The weights are rotated once when quantized; the activations inside the activation quantize.

Every step is one FP32 operation in a fixed order, so the Triton kernel can match it bit for bit:
the sign flip (exact), log2(n) butterfly stages (a + b, a - b) pairing elements h apart with
h = 1, 2, 4, ..., then one multiply by the FP32 constant 1/sqrt(n) (exact for n = 16 and 64).
"""

from __future__ import annotations

import math

import torch

SIZES: tuple[int, ...] = (16, 32, 64, 128)


def check_size(n: int, k: int | None = None) -> None:
    """Raise unless n is a supported rotation size (and divides the last dimension k)."""
    if n not in SIZES:
        raise ValueError(f"Hadamard rotation size must be one of {SIZES}; got {n}.")
    if k is not None and k % n:
        raise ValueError(
            f"a {n}-point Hadamard rotation needs the last dimension (in_features) to be a multiple of {n}; "
            f"got {k}. Use a smaller rotation (rht=16 fits every NVFP4 layer) or leave this layer unrotated."
        )


def signs(n: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """The +-1 diagonal D (FP32 [n]): the same for every group, a function of (n, seed) only."""
    check_size(n)
    g = torch.Generator().manual_seed(int(seed))
    d = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).float().mul_(2).sub_(1)
    return d.to(device)


def inv_sqrt(n: int) -> float:
    """1/sqrt(n) as the FP32 value both implementations multiply by."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def _butterfly(y: torch.Tensor, n: int) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard transform of the last dimension (size n), stage by stage."""
    lead = y.shape[:-1]
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, n)


def rotate(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x R along the last dimension, in FP32 (R = D H / sqrt(n), n = len(d)); same shape as x."""
    n = d.numel()
    check_size(n, x.shape[-1])
    y = x.float().reshape(*x.shape[:-1], x.shape[-1] // n, n) * d.to(x.device, torch.float32)
    y = _butterfly(y, n) * torch.tensor(inv_sqrt(n), dtype=torch.float32, device=x.device)
    return y.reshape(x.shape)


def unrotate(y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """y R^T (the inverse rotation), in FP32: back to the original basis, for inspection."""
    n = d.numel()
    check_size(n, y.shape[-1])
    z = _butterfly(y.float().reshape(*y.shape[:-1], y.shape[-1] // n, n), n)
    z = z * torch.tensor(inv_sqrt(n), dtype=torch.float32, device=y.device) * d.to(y.device, torch.float32)
    return z.reshape(y.shape)


def matrix(n: int, seed: int = 0) -> torch.Tensor:
    """R itself in FP64 ([n, n], for tests and analysis): rotate(x) equals x @ R up to FP32 rounding."""
    h = _butterfly(torch.eye(n, dtype=torch.float64), n)  # rows of H (symmetric)
    return torch.diag(signs(n, seed).double()) @ h / math.sqrt(n)
