"""Selection of contrastive seeds, group advantages, and the rank statistics that say how faithful
a cheap proxy ranking was (Spearman, Kendall, top/bottom overlap)."""

from __future__ import annotations

import torch


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


def group_advantages(
    rewards: torch.Tensor,
    clip: float = 5.0,
    global_rewards: torch.Tensor | None = None,
    prompts: list[str] | None = None,
) -> torch.Tensor:
    """(r - per-prompt mean) / global std over the iteration, clipped to +-clip.

    rewards: [P, K] for this process's prompts. Groups are prompt texts: with `prompts` (one per
    row), rows of the same prompt drawn twice in one iteration share one mean, as the official
    code groups by prompt. With prompts sharded over ranks, pass every rank's rewards as
    `global_rewards` so the std is the global one.
    """
    std = (rewards if global_rewards is None else global_rewards).float().std(unbiased=False) + 1e-4
    means = rewards.mean(dim=1, keepdim=True)
    if prompts is not None:
        if len(prompts) != rewards.shape[0]:
            raise ValueError(f"{len(prompts)} prompts for {rewards.shape[0]} reward rows")
        ids = torch.tensor([list(dict.fromkeys(prompts)).index(p) for p in prompts], device=rewards.device)
        sums = torch.zeros(int(ids.max()) + 1, dtype=rewards.dtype, device=rewards.device)
        sums.index_add_(0, ids, rewards.sum(dim=1))
        counts = torch.bincount(ids).to(rewards.dtype) * rewards.shape[1]
        means = (sums / counts)[ids].unsqueeze(1)
    adv = (rewards - means) / std
    return adv.clamp(-clip, clip)


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
