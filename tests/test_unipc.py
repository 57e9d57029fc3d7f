"""The `unipc` solver is diffusers' UniPCMultistepScheduler (bh2, order 2, flow prediction: the stock Wan
sampler) step for step: the same model, the same sigmas, the same samples, for several step counts and
shifts; and its predictor alone is our DPM-Solver++ 2M (the corrector is what differs)."""

from __future__ import annotations

import pytest
import torch

from solrl_engine.models.base import Conditioning
from solrl_engine.sampling.sampler import _solve


class _LinearFlow:
    """A flow model whose velocity is an affine map of x that depends on t: enough to exercise every
    coefficient of a multistep solver, in closed form."""

    def __init__(self, shape: tuple[int, ...], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a = torch.randn(shape, generator=g).double() * 0.3
        self.b = torch.randn(shape, generator=g).double()

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, transformer: object = None
                 ) -> torch.Tensor:  # fmt: skip
        tt = float(t)
        return (self.a * (1 + tt) * x.double() + self.b * (1 - tt) ** 2).to(x.dtype)


def _stock(model: _LinearFlow, x: torch.Tensor, steps: int, shift: float, corrector: bool) -> tuple[torch.Tensor,
                                                                                                   list[float]]:
    from diffusers import UniPCMultistepScheduler

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                    disable_corrector=[] if corrector else list(range(steps)))  # fmt: skip
    sched.set_timesteps(steps)
    sig = [float(s) for s in sched.sigmas]
    for i, ts in enumerate(sched.timesteps):
        v = model.velocity(x, torch.tensor(sig[i]), None)
        x = sched.step(v, ts, x, return_dict=False)[0]
    return x, sig


@pytest.mark.parametrize("steps", [1, 2, 3, 6, 10, 25])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_unipc_matches_the_diffusers_scheduler(steps, shift):
    model = _LinearFlow((2, 3, 4, 4), seed=steps)
    x0 = torch.randn((2, 3, 4, 4), generator=torch.Generator().manual_seed(1))
    want, sig = _stock(model, x0.clone(), steps, shift, corrector=True)
    cond = Conditioning(torch.zeros(2, 1, 1))
    got = _solve(model, x0.clone(), cond, torch.tensor(sig), sig, "unipc", 1.0, None, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if steps >= 3:  # the corrector changes the result (else this test would not tell them apart)
        dpm2 = _solve(model, x0.clone(), cond, torch.tensor(sig), sig, "dpm2", 1.0, None, None)
        assert (dpm2 - want).abs().max() > 1e-3


@pytest.mark.parametrize("steps", [3, 8])
def test_without_its_corrector_unipc_is_dpm_solver_2m(steps):
    model = _LinearFlow((1, 2, 3, 3), seed=7)
    x0 = torch.randn((1, 2, 3, 3), generator=torch.Generator().manual_seed(2))
    want, sig = _stock(model, x0.clone(), steps, 3.0, corrector=False)
    got = _solve(model, x0.clone(), Conditioning(torch.zeros(1, 1, 1)), torch.tensor(sig), sig, "dpm2", 1.0, None,
                 None)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
