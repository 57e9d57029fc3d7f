"""Flow-GRPO's SDE sampler (Liu et al. 2025): each step a Gaussian whose mean follows the flow and whose noise
keeps the marginals, so every step has a log-probability a policy gradient can use.

The step from flow time sigma to sigma_next (dt = sigma_next - sigma < 0), with the policy's velocity v:

    std   = noise_level * sqrt(sigma / (1 - sigma'))      sigma' = sigma, or the schedule's second value where
                                                           sigma == 1 (the first step, where 1 - sigma is 0)
    mean  = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt
    x'    = mean + std sqrt(-dt) eps
    log p = Gaussian(x'; mean, std sqrt(-dt)), averaged over every dimension but the batch

With noise_level 0 the step is Euler's. The SDE runs on a window of steps [k0, k1) and Euler elsewhere (Flow-GRPO:
every step but the last; Flow-GRPO-Fast: a window of one to three steps placed at random in the first half), and the
window's states are what the update trains on.

Seeded: a seed fixes the initial noise (the ODE samplers' own, `seeded_noise`) and every step's noise after it, drawn
from the same generator on the CPU, so a sample depends on its seed alone, not on the batch, device or window.
Everything is computed in FP32 from FP32 velocities (BF16 overflows the mean, as flow_grpo notes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from solrl_engine.models.base import Conditioning
from solrl_engine.models.experts import guidance_at

# the solver names `sample` takes for this sampler (sampler.SOLVERS holds them beside the ODE ones)
SDE_SOLVERS = ("flow_sde",)

@dataclass(frozen=True)
class Coupling:
    """The SDE a preview's shares its Brownian path with (`coupled_noise`): the regeneration's step count (on the
    same schedule family) and its SDE window, so a seed's preview and final follow one noise path."""

    steps: int
    window: tuple[int, int]


# (x, t [B], cond) -> velocity: the model, a copy of it, or the compiled prediction path
Velocity = Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]


def sde_std(sigma: torch.Tensor, sigma_max: float, noise_level: float) -> torch.Tensor:
    """The SDE's std_dev_t at flow times `sigma` (any shape): noise_level sqrt(sigma / (1 - sigma')), sigma' the
    schedule's second value `sigma_max` where sigma is 1."""
    one = sigma == 1
    return torch.sqrt(sigma / (1 - torch.where(one, torch.full_like(sigma, sigma_max), sigma))) * noise_level


def sde_mean(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             std: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The step's mean; sigma, sigma_next and std broadcast against x (a [B, 1, ...] view per row)."""
    dt = sigma_next - sigma
    return x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt


def sde_log_prob(x_next: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B] log-density of x_next under N(mean, scale^2), averaged over every dimension but the batch."""
    lp = -((x_next.detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    return lp.mean(dim=tuple(range(1, lp.dim())))


def _rows(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.dim() - 1)))


def sde_transition(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                   sigma_max: float, noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(mean, scale) of the step's Gaussian from rows x at flow times sigma [B] to sigma_next [B], in FP32."""
    s, sn = _rows(sigma, x), _rows(sigma_next, x)
    std = sde_std(s, sigma_max, noise_level)
    return sde_mean(x.float(), v.float(), s, sn, std), std * torch.sqrt(s - sn)


def step_noise(seeds: Sequence[int], steps: int, shape: tuple[int, ...], device: torch.device | str = "cpu"
               ) -> torch.Tensor:  # fmt: skip
    """[len(seeds), steps, *shape] standard normal noise for each SDE step: row i drawn on the CPU from seeds[i]'s
    generator after its initial noise (`seeded_noise`'s draw), so it depends on the seed alone."""
    rows = []
    for s in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(s))
        torch.randn(shape, generator=g, dtype=torch.float32)  # the initial noise: seeded_noise's draw
        rows.append(torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for _ in range(steps)]))
    return torch.stack(rows).to(device)


def coupled_noise(seeds: Sequence[int], coarse: Sequence[float], fine: Sequence[float], window: tuple[int, int],
                  shape: tuple[int, ...], device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, tuple[int, int], list[float]]:  # fmt: skip
    """The noise of an SDE on the `coarse` schedule (a preview's) that shares its Brownian path with the SDE on the
    `fine` schedule and its `window` (the regeneration's, whose step k injects std sqrt(sigma_k - sigma_k+1)
    eps_k with eps_k = step_noise's k-th draw): the path W accrues sqrt(dt) eps_k over each fine window step (none
    outside the window); at a coarse time between two fine ones it is the Brownian bridge between them (its extra
    normal drawn from the seed's generator after the fine noise). Coarse step j's noise is the path's increment over
    it divided by sqrt of its span inside the window, so it is standard normal and independent across steps, as an
    SDE's noise must be, while a coarse and a fine sample of one seed follow one path.

    Returns (noise [B, len(coarse) - 1, *shape], the coarse steps (j0, j1) that overlap the window, and each step's
    noise-level factor sqrt(share of its span inside the window): a step half inside injects half the variance)."""
    k0, k1 = window
    fine_steps, steps = len(fine) - 1, len(coarse) - 1
    hi, lo = fine[k0], fine[k1]  # the window's span in flow time (sigma decreases along the schedule)
    clipped = [min(max(c, lo), hi) for c in coarse]
    share = [(clipped[j] - clipped[j + 1]) / (coarse[j] - coarse[j + 1]) for j in range(steps)]
    inside = [j for j in range(steps) if share[j] > 0]
    if not inside:
        raise ValueError(f"the coarse schedule {list(coarse)} has no step inside the fine window's span "
                         f"[{lo}, {hi}]")  # fmt: skip
    rows = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        torch.randn(shape, generator=g, dtype=torch.float32)  # the initial noise: seeded_noise's draw
        eps = [torch.randn(shape, generator=g, dtype=torch.float32) for _ in range(fine_steps)]
        w = [torch.zeros(shape)]  # W at each fine time
        for k in range(fine_steps):
            dw = math.sqrt(fine[k] - fine[k + 1]) * eps[k] if k0 <= k < k1 else torch.zeros(shape)
            w.append(w[-1] + dw)
        at: list[torch.Tensor] = []  # W at each clipped coarse time, bridged in time order within a fine step
        k, a, wa = 0, fine[0], w[0]
        for c in clipped:
            while k < fine_steps and c < fine[k + 1]:
                k += 1
                a, wa = fine[k], w[k]
            b, wb = fine[min(k + 1, fine_steps)], w[min(k + 1, fine_steps)]
            if a - b <= 0 or c >= a:
                val = wa if c >= a else wb
            elif c <= b:
                val = wb
            else:
                z = torch.randn(shape, generator=g, dtype=torch.float32)
                val = wa + (a - c) / (a - b) * (wb - wa) + math.sqrt((a - c) * (c - b) / (a - b)) * z
            at.append(val)
            a, wa = c, val
        steps_noise = []
        for j in range(steps):
            span = clipped[j] - clipped[j + 1]
            steps_noise.append((at[j + 1] - at[j]) / math.sqrt(span) if span > 0 else torch.zeros(shape))
        rows.append(torch.stack(steps_noise))
    return torch.stack(rows).to(device), (inside[0], inside[-1] + 1), [math.sqrt(x) for x in share]


def sde_window(steps: int, size: int, high: int | None, gen: torch.Generator | None) -> tuple[int, int]:
    """The steps [k0, k1) the SDE runs on: size 0, every step but the last (Flow-GRPO; the last step's Gaussian is
    too sharp to train on); else `size` steps starting at random in [0, high - size] (Flow-GRPO-Fast; high None:
    half the steps), drawn from `gen`."""
    if size <= 0:
        return (0, max(1, steps - 1))
    top = steps // 2 if high is None else high
    k0 = int(torch.randint(0, max(0, top - size) + 1, (1,), generator=gen).item())
    return (k0, k0 + size)


def solve_sde(velocity: Velocity, x: torch.Tensor, cond: Conditioning, host: list[float], noise: torch.Tensor,
              window: tuple[int, int], noise_level: float, guidance_scale: float = 1.0,
              uncond: Conditioning | None = None, trace: list[torch.Tensor] | None = None,
              scales: Sequence[float] | None = None) -> torch.Tensor:  # fmt: skip
    """The SDE from x (the initial noise) over the schedule `host` (steps + 1 host floats), the SDE on `window` and
    Euler elsewhere, `noise` [B, steps, ...] each step's noise, `scales` each step's factor on noise_level (None:
    1; a coupled preview's: coupled_noise). `trace` (a list) receives [B, W + 1, ...] FP32: the window's states,
    from step k0's input to step k1's output. Returns the final latents in x's dtype."""
    dtype, (k0, k1) = x.dtype, window
    u = uncond.against(cond) if guidance_scale != 1.0 and uncond is not None else None
    sigma_max = host[1]
    states = []
    xf = x.float()
    for k in range(len(host) - 1):
        t = torch.full((len(x),), host[k], device=x.device)
        xin = xf.to(dtype)
        v = velocity(xin, t, cond).float()
        if u is not None:
            vu = velocity(xin, t, u).float()
            v = vu + guidance_at(guidance_scale, host[k]) * (v - vu)  # (a two-expert model: the running expert's)
        if k == k0:
            states.append(xf)
        if k0 <= k < k1:
            level = noise_level * (scales[k] if scales is not None else 1.0)
            mean, scale = sde_transition(xf, v, t, torch.full_like(t, host[k + 1]), sigma_max, level)
            xf = mean + scale * noise[:, k].to(device=x.device, dtype=torch.float32)
        else:
            xf = xf + (host[k + 1] - host[k]) * v
        if k0 <= k < k1:
            states.append(xf)
    if trace is not None:
        trace.append(torch.stack(states, dim=1))
    return xf.to(dtype)
