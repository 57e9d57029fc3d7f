"""Schedules, seeded latents and the ODE samplers (Euler, DPM-Solver++ 2M)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from solrl_engine.models.base import Conditioning, FlowModel

SOLVERS = ("euler", "dpm2")


def sigma_schedule(steps: int, shift: float = 1.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """steps + 1 flow times from 1 (noise) to 0 (image), with SD3's shift t' = s t / (1 + (s - 1) t)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0; got {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    t = shift * t / (1 + (shift - 1) * t)
    return t.to(device=device, dtype=torch.float32)


def seeded_noise(
    seeds: Sequence[int], shape: tuple[int, ...], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[len(seeds), *shape] standard normal noise; row i depends only on seeds[i] (drawn on the CPU
    in fp32, then moved), so it is identical across batch sizes, devices and precisions."""
    rows = []
    for s in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(s))
        rows.append(torch.randn(shape, generator=g, dtype=torch.float32))
    return torch.stack(rows).to(device=device, dtype=dtype)


def schedule_pair(steps: int, shift: float, device: torch.device | str) -> tuple[torch.Tensor, list[float]]:
    """The schedule twice: on `device` for the model, as host floats for the solver's control flow."""
    host = sigma_schedule(steps, shift)
    return host.to(device), host.tolist()


def _lambda(t: float) -> float:
    """log(alpha / sigma) of flow time t (alpha = 1 - t, sigma = t)."""
    return math.log((1 - t) / t)


def _solve(
    model: FlowModel,
    x: torch.Tensor,
    cond: Conditioning,
    sig: torch.Tensor,
    host: list[float],
    solver: str,
    guidance_scale: float,
    uncond: Conditioning | None,
    transformer: nn.Module | None,
) -> torch.Tensor:
    """The solver loop. Control flow and coefficients use host floats and the model gets device
    views of `sig`, so the loop never syncs with the GPU and can be captured in a CUDA graph."""
    prev_x0: torch.Tensor | None = None
    u = None
    if guidance_scale != 1.0:
        u = Conditioning(uncond.hidden.expand(len(cond), -1, -1), uncond.pooled.expand(len(cond), -1))
    for k in range(len(host) - 1):
        t, t_next = host[k], host[k + 1]
        v = model.velocity(x, sig[k], cond, transformer=transformer)
        if u is not None:
            vu = model.velocity(x, sig[k], u, transformer=transformer)
            v = vu + guidance_scale * (v - vu)
        if solver == "euler" or t_next == 0:
            x = x + (t_next - t) * v
            continue
        # DPM-Solver++ (2M) in data prediction; first order where the previous step has no finite
        # log-SNR (it started from pure noise), exact Euler/DDIM form for the step itself.
        x0 = x - t * v
        d = x0
        if prev_x0 is not None and k >= 2:
            h = _lambda(t_next) - _lambda(t)
            h_prev = _lambda(t) - _lambda(host[k - 1])
            r = h_prev / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * prev_x0
        x = (t_next / t) * x + ((1 - t_next) - (1 - t) * t_next / t) * d
        prev_x0 = x0
    return x


@torch.no_grad()
def sample(
    model: FlowModel,
    cond: Conditioning,
    seeds: Sequence[int],
    steps: int,
    shift: float = 1.0,
    solver: str = "euler",
    guidance_scale: float = 1.0,
    uncond: Conditioning | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    transformer: nn.Module | None = None,
) -> torch.Tensor:
    """ODE from noise to x0 for each (cond[i], seeds[i]); returns the final latents [B, ...].

    `solver` is "euler" or "dpm2" (DPM-Solver++ 2M, second order: fewer steps at equal quality).
    guidance_scale > 1 applies classifier-free guidance against `uncond` (one row, broadcast).
    `transformer` runs another copy of the denoiser (e.g. the quantized explore copy) with the
    model's own conditioning and I/O. Batches are processed in chunks of `batch_size`.
    """
    if len(cond) != len(seeds):
        raise ValueError(f"{len(cond)} conditionings for {len(seeds)} seeds")
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
    if guidance_scale != 1.0 and uncond is None:
        raise ValueError("classifier-free guidance needs `uncond` (the encoded empty prompt)")
    device = cond.hidden.device
    sig, host = schedule_pair(steps, shift, device)
    bs = batch_size or len(seeds)
    outs = []
    for i in range(0, len(seeds), bs):
        x = seeded_noise(seeds[i : i + bs], tuple(model.latent_shape), device, dtype)
        outs.append(_solve(model, x, cond[i : i + bs], sig, host, solver, guidance_scale, uncond, transformer))
    return torch.cat(outs)
