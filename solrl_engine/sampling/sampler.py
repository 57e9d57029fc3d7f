"""Schedules, seeded latents, the ODE samplers (Euler, DPM-Solver++ 2M, UniPC) and Flow-GRPO's SDE (sampling/sde.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from solrl_engine.models.base import Conditioning, FlowModel, sigma_schedule
from solrl_engine.models.experts import guidance_at
from solrl_engine.sampling.sde import SDE_SOLVERS, Coupling, coupled_noise, sde_window, solve_sde, step_noise

# euler; dpm2: DPM-Solver++ 2M (the stock SANA sampler); unipc: UniPC-bh2 order 2, which is DPM-Solver++ 2M plus
# a corrector of each step's starting point (the stock Wan sampler), both in data prediction; flow_sde: Flow-GRPO's
# SDE (seeded per step; every step but the last stochastic, at sde_noise_level)
ODE_SOLVERS = ("euler", "dpm2", "unipc")
SOLVERS = ODE_SOLVERS + SDE_SOLVERS


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


def model_sigmas(model: FlowModel, steps: int, shift: float | None = None) -> torch.Tensor:
    """The model's own schedule (its scheduler's, for diffusers pipelines); `shift` overrides its
    shift. Models without a `sigmas` method get the linear schedule with SD3's shift."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    fn = getattr(model, "sigmas", None)
    sig = fn(steps, shift) if fn is not None else sigma_schedule(steps, 1.0 if shift is None else shift)
    sig = torch.as_tensor(sig, dtype=torch.float32).cpu()
    if sig.shape != (steps + 1,) or sig[0] > 1 or sig[-1] != 0 or not bool((sig[1:] < sig[:-1]).all()):
        raise ValueError(f"{type(model).__name__}.sigmas({steps}) must fall from <= 1 to 0 in {steps + 1} values")
    return sig


def schedule_pair(
    model: FlowModel, steps: int, shift: float | None, device: torch.device | str
) -> tuple[torch.Tensor, list[float]]:
    """The schedule twice: on `device` for the model, as host floats for the solver's control flow."""
    host = model_sigmas(model, steps, shift)
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
    views of `sig`, so the loop never syncs with the GPU and can be captured in a CUDA graph.

    The latents between steps stay in x's dtype (BF16 in a BF16 rollout) but every update is
    computed in FP32 from FP32 velocities, as diffusers' schedulers do: rounding the update itself
    to BF16 costs about 1.4x the error at 10 steps.
    """
    dtype = x.dtype
    prev_x0: torch.Tensor | None = None
    u = uncond.against(cond) if guidance_scale != 1.0 else None
    unipc = _UniPC(host) if solver == "unipc" else None
    for k in range(len(host) - 1):
        t, t_next = host[k], host[k + 1]
        v = model.velocity(x, sig[k], cond, transformer=transformer).float()
        if u is not None:
            vu = model.velocity(x, sig[k], u, transformer=transformer).float()
            v = vu + guidance_at(guidance_scale, t) * (v - vu)  # (a two-expert model: the running expert's)
        xf = x.float()
        if unipc is not None:
            x = unipc.step(k, xf, xf - t * v).to(dtype)
            continue
        if solver == "euler" or t_next == 0:
            x = (xf + (t_next - t) * v).to(dtype)
            continue
        # DPM-Solver++ (2M) in data prediction; first order where the previous step has no finite
        # log-SNR (it started from pure noise), exact Euler/DDIM form for the step itself.
        x0 = xf - t * v
        d = x0
        if prev_x0 is not None and host[k - 1] < 1:
            h = _lambda(t_next) - _lambda(t)
            h_prev = _lambda(t) - _lambda(host[k - 1])
            r = h_prev / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * prev_x0
        x = ((t_next / t) * xf + ((1 - t_next) - (1 - t) * t_next / t) * d).to(dtype)
        prev_x0 = x0
    return x


class _UniPC:
    """UniPC-bh2 of order 2 in data prediction, as diffusers' UniPCMultistepScheduler runs it for flow models
    (the stock Wan sampler): each step's predictor is DPM-Solver++ 2M, started from the previous step's
    output corrected with the new model evaluation (UniC: no extra evaluation). Coefficients are host floats
    of the schedule, the tensors stay on the device: the loop stays capturable in a CUDA graph. The first
    step and the last are first order (lower_order_final); a step whose neighbour is at t = 1 (infinite
    log-SNR) is first order too."""

    def __init__(self, host: list[float]) -> None:
        self.host, self.n = host, len(host) - 1
        self.d: list[torch.Tensor] = []  # the data predictions so far (the last two are used)
        self.start: torch.Tensor | None = None  # the corrected sample the previous predictor started from

    def _lam(self, k: int) -> float:
        return _lambda(self.host[k])

    def step(self, k: int, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """The sample after step k from the (uncorrected) sample x at host[k] and its data prediction d."""
        s, s_next = self.host[k], self.host[k + 1]
        start = x
        if k >= 1 and self.host[k - 1] < 1:  # UniC: correct x with d before it starts the next predictor
            sp, d1 = self.host[k - 1], self.d[-1]
            c = (1 - s) - (1 - sp) * s / sp
            h = self._lam(k) - self._lam(k - 1)
            if k >= 2 and self.host[k - 2] < 1:  # second order: the previous predictor was second order
                r = (self._lam(k - 2) - self._lam(k - 1)) / h
                b = math.expm1(-h)
                b1 = (b / -h - 1) / b
                b2 = 2 * ((b / -h - 1) / -h - 0.5) / b
                rho0 = (b2 - b1) / (r - 1)
                corr = rho0 * (self.d[-2] - d1) / r + (b1 - rho0) * (d - d1)
            else:
                corr = 0.5 * (d - d1)
            start = (s / sp) * self.start + c * d1 + c * corr  # type: ignore[operator]
        self.d = (self.d + [d])[-2:]
        self.start = start
        if s_next == 0:  # the final step: the data prediction at the uncorrected sample
            return d
        c_next = (1 - s_next) - (1 - s) * s_next / s
        second = k >= 1 and self.host[k - 1] < 1 and self.n - k >= 2
        if second:
            r = (self._lam(k) - self._lam(k - 1)) / (_lambda(s_next) - self._lam(k))
            d = d + (1 / (2 * r)) * (d - self.d[-2])
        return (s_next / s) * start + c_next * d


@torch.no_grad()
def sample(
    model: FlowModel,
    cond: Conditioning,
    seeds: Sequence[int],
    steps: int,
    shift: float | None = None,
    solver: str = "euler",
    guidance_scale: float = 1.0,
    uncond: Conditioning | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    transformer: nn.Module | None = None,
    noise_level: float = 0.7,
    couple: Coupling | None = None,
) -> torch.Tensor:
    """ODE from noise to x0 for each (cond[i], seeds[i]); returns the final latents [B, ...].

    `solver` is "euler", "dpm2" (DPM-Solver++ 2M, second order: fewer steps at equal quality), "unipc", or
    "flow_sde" (Flow-GRPO's SDE at `noise_level` on every step but the last, its noise fixed by each seed; with
    `couple`, its noise is the Brownian path of that finer SDE's: sampling.sde.coupled_noise).
    guidance_scale > 1 applies classifier-free guidance against `uncond` (one row, broadcast).
    The schedule is the model's own (`model.sigmas`); `shift` overrides its shift.
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
    sig, host = schedule_pair(model, steps, shift, device)
    bs = batch_size or len(seeds)
    fine = (schedule_pair(model, couple.steps, shift, device)[1], couple.window) if couple else None
    outs = []
    for i in range(0, len(seeds), bs):
        x = seeded_noise(seeds[i : i + bs], tuple(model.latent_shape), device, dtype)
        if solver in SDE_SOLVERS or fine is not None:  # a coupled preview is an SDE sample, as the graphed path
            def velocity(x: torch.Tensor, t: torch.Tensor, c: Conditioning) -> torch.Tensor:
                return model.velocity(x, t, c, transformer=transformer)

            outs.append(sample_sde(velocity, x, cond[i : i + bs], seeds[i : i + bs], host,
                                   sde_window(steps, 0, None, None), noise_level, guidance_scale, uncond,
                                   couple=fine))  # fmt: skip
            continue
        outs.append(_solve(model, x, cond[i : i + bs], sig, host, solver, guidance_scale, uncond, transformer))
    return torch.cat(outs)


def sample_sde(velocity: Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor], x: torch.Tensor,
               cond: Conditioning, seeds: Sequence[int], host: list[float], window: tuple[int, int],
               noise_level: float, guidance_scale: float = 1.0, uncond: Conditioning | None = None,
               trace: list[torch.Tensor] | None = None,
               couple: tuple[list[float], tuple[int, int]] | None = None) -> torch.Tensor:  # fmt: skip
    """Flow-GRPO's SDE (sampling.sde.solve_sde) from the seeds' initial noise `x`, each step's noise drawn from the
    same seeds: the SDE on `window`, Euler elsewhere; `trace` receives the window's states. `couple` (a finer
    schedule's host floats and its SDE window): the noise is that SDE's Brownian path, on the steps that overlap
    its window (sampling.sde.coupled_noise), in place of `window`."""
    if couple is not None:
        noise, window, scales = coupled_noise(seeds, host, couple[0], couple[1], tuple(x.shape[1:]), x.device)
        return solve_sde(velocity, x, cond, host, noise, window, noise_level, guidance_scale, uncond, trace, scales)
    noise = step_noise(seeds, len(host) - 1, tuple(x.shape[1:]), x.device)
    return solve_sde(velocity, x, cond, host, noise, window, noise_level, guidance_scale, uncond, trace)
