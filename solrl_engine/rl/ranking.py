"""Group advantages: each rollout's reward against its prompt's group. The selection and rank statistics
they build on live in solrl_engine.explore.ranking (re-exported here for the trainer and older imports)."""

from __future__ import annotations

import torch

from solrl_engine.explore.ranking import kendall, nk_problem, overlap, select_contrastive, spearman

__all__ = ["group_advantages", "kendall", "nk_problem", "overlap", "select_contrastive", "spearman"]


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


