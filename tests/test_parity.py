"""Parity with the official Sol-RL / DiffusionNFT code where it was found off: the schedules come
from the pipelines' own schedulers, the solver update is FP32 in a BF16 rollout, the EMA uses the
update count after the update, advantages are grouped by prompt text."""

from __future__ import annotations

import torch

from solrl_engine.models.base import Conditioning
from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters
from solrl_engine.rl.ranking import group_advantages
from solrl_engine.sampling.sampler import _solve, sample, schedule_pair


def test_sd3_schedule_is_the_schedulers_set_timesteps_with_its_shift():
    """At shift 3 and 10 steps the last non-zero sigma is 0.0089 (double-shifted sigma_min), not
    the 0.25 of linspace-then-shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from solrl_engine.models.sd3 import SD3Model

    m = SD3Model.__new__(SD3Model)  # only the schedule is exercised: no weights needed
    m.pipe = type("P", (), {"scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0)})()
    sig = m.sigmas(10)
    assert sig.shape == (11,) and sig[0] == 1 and sig[-1] == 0
    assert abs(sig[-2].item() - 0.0089) < 1e-4
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(10)
    torch.testing.assert_close(sig, ref.sigmas.float())


def test_flux_schedule_uses_the_dynamic_shift_of_the_token_count():
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from solrl_engine.models.flux import FluxModel

    m = FluxModel.__new__(FluxModel)
    m.pipe = type("P", (), {"scheduler": FluxModel.default_scheduler()})()
    m.latent_shape = (16, 64, 64)  # 512 px: 32 x 32 = 1024 packed tokens
    sig = m.sigmas(6)
    ref = FluxModel.default_scheduler()
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=calculate_shift(1024, 256, 4096, 0.5, 1.15))
    torch.testing.assert_close(sig, ref.sigmas.float())
    m.latent_shape = (16, 128, 128)  # 1024 px: more tokens, a larger shift, later sigmas higher
    assert (m.sigmas(6)[1:-1] > sig[1:-1]).all()


class _Toy:
    """A velocity field in BF16, like a BF16 policy's output."""

    latent_shape = (4, 3, 3)

    def velocity(self, x, t, cond, transformer=None):  # noqa: ANN001, ANN201
        return (torch.sin(3 * x.float()) * 0.7 + cond.hidden.float().mean() * t).to(x.dtype)


def test_bf16_rollout_computes_each_solver_update_in_fp32():
    """The state between steps is BF16, the update is FP32 from FP32 velocities (as diffusers'
    schedulers compute it), which is closer to the FP64 solution than all-BF16 arithmetic."""
    toy = _Toy()
    g = torch.Generator().manual_seed(0)
    cond = Conditioning(torch.randn(64, 5, 8, generator=g), torch.randn(64, 8, generator=g))
    for solver in ("euler", "dpm2"):
        sig, host = schedule_pair(toy, 10, 3.0, "cpu")
        x0 = torch.randn(64, *toy.latent_shape, generator=g)
        got = _solve(toy, x0.bfloat16(), cond, sig, host, solver, 1.0, None, None)
        ref = _solve(toy, x0.double(), cond, sig, host, solver, 1.0, None, None)
        assert got.dtype == torch.bfloat16
        # the same loop with every update rounded to BF16 (what the engine did before)
        x, prev = x0.bfloat16(), None
        for k in range(10):
            t, tn = host[k], host[k + 1]
            v = toy.velocity(x, sig[k], cond)
            if solver == "euler" or tn == 0:
                x = x + (tn - t) * v
                continue
            x0p = x - t * v
            d = x0p
            if prev is not None and host[k - 1] < 1:
                import math

                lam = lambda s: math.log((1 - s) / s)  # noqa: E731
                r = (lam(t) - lam(host[k - 1])) / (lam(tn) - lam(t))
                d = (1 + 1 / (2 * r)) * x0p - (1 / (2 * r)) * prev
            x = (tn / t) * x + ((1 - tn) - (1 - t) * tn / t) * d
            prev = x0p
        err_fp32 = (got.double() - ref).abs().mean()
        err_bf16 = (x.double() - ref).abs().mean()
        # DPM2's update mixes two data predictions and the state: rounding it in BF16 costs the most
        assert err_fp32 < (0.95 if solver == "dpm2" else 1.0) * err_bf16, (solver, err_fp32, err_bf16)


def test_seeded_noise_is_the_pipelines_generator_noise():
    """A seed's initial latent equals torch.Generator().manual_seed(seed) noise of the latent shape,
    what a diffusers pipeline draws with that generator (so the stock pipeline regenerates it)."""
    toy = _Toy()
    cond = Conditioning(torch.zeros(1, 5, 8), torch.zeros(1, 8))
    g = torch.Generator().manual_seed(123)
    want = torch.randn((1, *toy.latent_shape), generator=g)
    got = sample(toy, cond, [123], steps=1, solver="euler")  # one Euler step to t = 0 from the noise
    v = toy.velocity(want, torch.tensor(1.0), cond)
    torch.testing.assert_close(got, want - v)


def test_ema_decay_uses_the_update_count_after_the_update():
    from diffusers import SD3Transformer2DModel

    net = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8)  # fmt: skip
    ad = LoraAdapters(net, 2, 4, ("attn.to_q",))
    start = [e.clone() for e in ad.ema]
    with torch.no_grad():
        for p in ad.params(TRAIN):
            p.add_(1.0)
    ad.update_ema(1)  # after the first update, as the trainer now calls it
    d = 2 / 11  # min((1 + 1) / (10 + 1), 0.9)
    for e, s, p in zip(ad.ema, start, ad.params(TRAIN), strict=True):
        torch.testing.assert_close(e, d * s + (1 - d) * p.detach())


def test_an_adapter_switch_is_one_assignment_and_computes_what_peft_switching_does(monkeypatch):
    """`use` walks no layer and no parameter (PEFT's set_adapter flips every adapter's requires_grad in each layer):
    the trained, old and reference (no adapter) outputs equal PEFT's own switching; after PEFT switched the layers
    itself, the next `use` shares the switch again; only the trained adapter ever takes gradients."""
    from diffusers import SD3Transformer2DModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(0)
    net = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8)  # fmt: skip
    ad = LoraAdapters(net, 2, 4, ("attn.to_q", "attn.to_k", "ff.net.2"))
    with torch.no_grad():  # two distinct non-zero adapters (B starts at zero)
        for name in (TRAIN, OLD):
            for p in ad.params(name):
                p.add_(torch.randn_like(p) * 0.3)
    x, ctx, pooled = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 16), torch.randn(1, 16)

    def out() -> torch.Tensor:
        with torch.no_grad():
            return net(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled,
                       timestep=torch.tensor([0.5])).sample  # fmt: skip

    peft = {}
    for which in (TRAIN, OLD, "ref"):  # PEFT's own switching, through the model (walks every layer)
        if which == "ref":
            net.disable_adapters()
        else:
            net.enable_adapters()
            net.set_adapter(which)
        peft[which] = out()
    assert not torch.equal(peft[TRAIN], peft[OLD]) and not torch.equal(peft[OLD], peft["ref"])
    ad.use(TRAIN)  # PEFT switched the layers itself above: shared again here
    flips, sets = [], []
    monkeypatch.setattr(torch.Tensor, "requires_grad_", lambda self, *a: flips.append(1) or self)
    monkeypatch.setattr(BaseTunerLayer, "set_adapter", lambda *a, **k: sets.append(1))
    for which in (OLD, "ref", TRAIN, OLD, "ref"):
        ad.use(which)
        torch.testing.assert_close(out(), peft[which], rtol=0, atol=0)
    with ad.using(OLD):
        torch.testing.assert_close(out(), peft[OLD], rtol=0, atol=0)
    torch.testing.assert_close(out(), peft[TRAIN], rtol=0, atol=0)  # `using` returns to the trained adapter
    assert flips == [] and sets == []
    assert all(p.requires_grad for p in ad.params(TRAIN)) and not any(p.requires_grad for p in ad.params(OLD))


def test_advantages_group_rows_of_the_same_prompt():
    r = torch.tensor([[1.0, 3.0], [5.0, 7.0], [0.0, 2.0]])
    adv = group_advantages(r, clip=100, prompts=["a", "a", "b"])
    std = r.std(unbiased=False) + 1e-4
    want = torch.tensor([[1 - 4.0, 3 - 4.0], [5 - 4.0, 7 - 4.0], [0 - 1.0, 2 - 1.0]]) / std
    torch.testing.assert_close(adv, want)
    # without prompt texts (or with distinct prompts) each row is its own group, as before
    torch.testing.assert_close(group_advantages(r, clip=100), group_advantages(r, clip=100, prompts=["a", "b", "c"]))
