"""The DiffusionNFT policy loss (Zheng et al. 2025), as Sol-RL trains with it.

The current policy v_theta and the frozen sampling policy v_old define an implicit positive policy
v+ = b v_theta + (1 - b) v_old and negative policy v- = (1 + b) v_old - b v_theta. Both predict the
clean sample x0 from the re-noised x_t; each squared error is divided by its own detached mean
absolute error (per sample); the reward, as r = clamp(A / (2 c) + 1/2, 0, 1) with c the advantage
clip, weights the two: loss = c * mean((r L+ + (1 - r) L-) / b) + kl_beta * mean((v_theta - v_ref)^2).
"""

from __future__ import annotations

import torch


def _per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.dim())))


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor | None,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    beta: float = 1.0,
    kl_beta: float = 1e-4,
    adv_clip: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (scalar, differentiable through v_theta) and its parts (detached 0-dim tensors on the loss's device:
    reading them is the caller's host sync, once per optimizer step in the update). t is [B] flow time in (0, 1]."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    v_old = v_old.detach()
    r = ((advantages.clamp(-adv_clip, adv_clip) / adv_clip) / 2 + 0.5).clamp(0, 1)

    def branch(v: torch.Tensor) -> torch.Tensor:
        x0_pred = xt - tb * v
        with torch.no_grad():
            w = _per_sample((x0_pred.double() - x0.double()).abs()).clamp(min=1e-5)
        return _per_sample((x0_pred - x0) ** 2) / w.to(x0.dtype)

    pos = branch(beta * v_theta + (1 - beta) * v_old)
    neg = branch((1 + beta) * v_old - beta * v_theta)
    policy = (adv_clip * (r * pos / beta + (1 - r) * neg / beta)).mean()
    kl = _per_sample((v_theta - v_ref.detach()) ** 2).mean() if v_ref is not None else torch.zeros((), device=x0.device)
    loss = policy + kl_beta * kl
    return loss, {"policy_loss": policy.detach(), "kl": kl.detach(), "loss": loss.detach()}
