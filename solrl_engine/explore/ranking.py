"""Which seeds a group keeps, and how faithfully a cheap proxy ranked them: the contrastive selection
(top K/2 and bottom K/2), Spearman and Kendall rank correlations, top/bottom overlap, and the one check of
what N and K may be. Explore-side statistics: the trainer's group advantages stay in rl/ranking.py."""

from __future__ import annotations

import torch


def nk_problem(n: int, k: int) -> str | None:
    """What is wrong with exploring `n` seeds and keeping `k` (None: nothing): k must be even (the top k/2
    and bottom k/2 are kept), at least 2, at most n."""
    if n < 1 or k < 2:
        return "need n >= 1 and k >= 2"
    if k > n:
        return f"cannot train on more seeds than are explored (n = {n}); set k <= n"
    if k % 2:
        return "k must be even: the top k/2 and bottom k/2 seeds are kept"
    return None


def select_contrastive(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [P, K] of the top K/2 and bottom K - K/2 rewards of each row of [P, N] (all when K = N).

    Ties are broken by index (stable sort), so the choice is deterministic.
    """
    p, n = rewards.shape
    if not 1 <= k <= n:
        raise ValueError(f"cannot select {k} of {n} seeds")
    if k == n:
        return torch.arange(n, device=rewards.device).expand(p, n).clone()
    order = torch.sort(rewards, dim=1, descending=True, stable=True).indices
    top = order[:, : k // 2]
    bottom = order[:, n - (k - k // 2) :]
    return torch.cat([top, bottom], dim=1)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank) along the last dim."""
    order = x.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=torch.float64).expand_as(x).clone())
    out = ranks.clone()
    for i in range(x.shape[0]):
        vals, inv, counts = torch.unique(x[i], return_inverse=True, return_counts=True)
        if (counts > 1).any():
            sums = torch.zeros(len(vals), dtype=torch.float64).scatter_add_(0, inv, ranks[i])
            out[i] = (sums / counts)[inv]
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation per row of [P, N] tensors."""
    ra, rb = _ranks(a.detach().cpu().double()), _ranks(b.detach().cpu().double())
    ra = ra - ra.mean(-1, keepdim=True)
    rb = rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / ((ra.pow(2).sum(-1) * rb.pow(2).sum(-1)).sqrt() + 1e-12)


def kendall(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kendall tau-b per row of [P, N] tensors."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    da = torch.sign(a[:, :, None] - a[:, None, :])
    db = torch.sign(b[:, :, None] - b[:, None, :])
    iu = torch.triu_indices(a.shape[1], a.shape[1], 1)
    da, db = da[:, iu[0], iu[1]], db[:, iu[0], iu[1]]
    conc = (da * db).sum(-1)
    return conc / ((da.abs().sum(-1) * db.abs().sum(-1)).sqrt() + 1e-12)


def overlap(proxy: torch.Tensor, oracle: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: fraction of the oracle's top-K/2 (and bottom-K/2) that the proxy also puts there."""
    h = k // 2
    n = proxy.shape[1]

    def sets(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.sort(x, dim=1, descending=True, stable=True).indices
        top = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order[:, :h], True)
        bot = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order[:, n - h :], True)
        return top, bot

    pt, pb = sets(proxy)
    ot, ob = sets(oracle)
    return (pt & ot).sum(1).double() / h, (pb & ob).sum(1).double() / h
