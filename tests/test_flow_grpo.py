"""Flow-GRPO and Flow-GRPO-Fast (sampling/sde.py, rl/objectives/flow_grpo.py): the SDE step, its log-probability and
the loss equal the official flow_grpo code's formulas on random inputs; a seed fixes every step's noise; the window
runs Euler outside; the trainer runs both objectives in every family, resumes exactly, and refuses what cannot run.

The official formulas, as flow_grpo writes them (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
`sde_step_with_logprob`, and scripts/train_sd3.py's loss), are restated below in `official_step` and `official_loss`
term for term: the engine's code is written otherwise (its own helpers, rows as vectors), so agreement is a check.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from solrl_engine.rl.config import ConfigError, RLConfig
from solrl_engine.rl.objectives.flow_grpo import flow_grpo_loss
from solrl_engine.sampling.sampler import sample, sample_sde, seeded_noise
from solrl_engine.sampling.sde import sde_log_prob, sde_std, sde_transition, sde_window, step_noise


def official_step(model_output, sigmas, step_index, sample, noise_level, prev_sample=None, noise=None):  # noqa: ANN001
    """flow_grpo's sde_step_with_logprob, its lines kept (a scheduler's `sigmas` and the rows' step indices)."""
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    prev_step_index = [step + 1 for step in step_index]
    sigma = sigmas[step_index].view(-1, *([1] * (sample.dim() - 1)))
    sigma_prev = sigmas[prev_step_index].view(-1, *([1] * (sample.dim() - 1)))
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)  # fmt: skip
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def official_loss(log_prob, old_log_prob, advantages, adv_clip_max, clip_range, beta, mean, mean_ref, std_dev_t):  # noqa: ANN001
    """scripts/train_sd3.py's GRPO loss, its lines kept."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    kl_loss = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.dim())), keepdim=True) / (2 * std_dev_t**2)
    return policy_loss + beta * torch.mean(kl_loss), policy_loss


def _schedule(steps: int, shift: float) -> torch.Tensor:
    t = torch.linspace(1, 0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)  # SD3's shifted schedule: starts at exactly 1, ends at 0


@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (5, 16, 6), (2, 3, 2, 4, 4)], ids=["image", "tokens", "video"])
@pytest.mark.parametrize("dist", ["gaussian", "outliers", "decades"])
def test_the_sde_step_and_its_log_probability_equal_flow_grpos(shape, dist):
    g = torch.Generator().manual_seed(hash((shape, dist)) % 2**31)
    x, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if dist == "outliers":
        v[:, 0] *= 50
    if dist == "decades":
        x = x * torch.logspace(-3, 3, shape[-1])
    sig = _schedule(10, 3.0)
    for level in (0.7, 1.2):
        idx = torch.randint(0, 10, (shape[0],), generator=g)
        idx[0] = 0  # sigma == 1: the schedule's second value stands in
        noise = torch.randn(shape, generator=g)
        prev, lp, mean_o, std_o = official_step(v, sig, idx.tolist(), x, level, noise=noise)
        mean, scale = sde_transition(x, v, sig[idx], sig[idx + 1], float(sig[1]), level)
        torch.testing.assert_close(mean, mean_o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mean + scale * noise, prev, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sde_log_prob(prev, mean, scale), lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sde_std(sig[idx].view_as(std_o), float(sig[1]), level), std_o)
        # a given sample (the update's case): the log-probability of another point, and of a NaN one
        other = prev + 0.1 * torch.randn(shape, generator=g)
        other[-1].view(-1)[0] = float("nan")
        _, lp_o, _, _ = official_step(v, sig, idx.tolist(), x, level, prev_sample=other)
        lp_e = sde_log_prob(other, mean, scale)
        torch.testing.assert_close(lp_e, lp_o, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.isnan(lp_e[-1]) and torch.isfinite(lp_e[:-1]).all()


@pytest.mark.parametrize("kl", [0.0, 0.04])
def test_the_loss_equals_flow_grpos_clipped_ratio_and_kl(kl):
    g = torch.Generator().manual_seed(7)
    for clip in (1e-4, 0.2):
        lp = torch.randn(12, generator=g) * 0.3
        old = lp + torch.randn(12, generator=g) * 0.2
        adv = torch.randn(12, generator=g) * 4  # some past the clip of 5
        adv[0] = 9.0
        mean, ref = torch.randn(12, 4, 6, 6, generator=g), torch.randn(12, 4, 6, 6, generator=g)
        std = torch.rand(12, 1, 1, 1, generator=g) + 0.1
        lp_req = lp.clone().requires_grad_(True)
        loss, parts = flow_grpo_loss(lp_req, old, adv, clip, 5.0, mean, ref, std, kl)
        want, policy = official_loss(lp, old, adv, 5.0, clip, kl, mean, ref, std)
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(parts["policy_loss"], policy)
        loss.backward()  # the gradient flows through the unclipped ratios only
        ratio = torch.exp(lp - old)
        a = adv.clamp(-5, 5)
        inside = (-a * ratio >= -a * ratio.clamp(1 - clip, 1 + clip))
        torch.testing.assert_close(lp_req.grad, torch.where(inside, -a * ratio / 12, torch.zeros(12)))


def test_a_seed_fixes_every_steps_noise_and_no_noise_is_euler(small_model):
    from solrl_engine.models import load_model

    model = load_model("tiny", small_model, device="cpu")
    cond = model.encode_prompts(["a red circle", "a blue square", "a red circle"])
    seeds = [11, 22, 11]
    both = sample(model, cond, seeds, 4, solver="flow_sde")
    alone = sample(model, cond[1:2], seeds[1:2], 4, solver="flow_sde")
    # row i: its seed alone, not its batch (a batch's GEMMs round otherwise: 1e-5)
    torch.testing.assert_close(both[1:2], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[0], both[2], rtol=1e-5, atol=1e-5)
    assert (both[0] - both[1]).abs().max() > 0.1
    euler = sample(model, cond, seeds, 4, solver="euler")
    assert (both - euler).abs().max() > 1e-3  # the SDE moves off the ODE ...
    torch.testing.assert_close(sample(model, cond, seeds, 4, solver="flow_sde", noise_level=0.0), euler,
                               rtol=1e-5, atol=1e-5)  # ... and without noise it is Euler's step  # fmt: skip
    # the step noise: drawn after the initial noise from each seed's generator
    n = step_noise([5], 3, (2, 3))
    g = torch.Generator().manual_seed(5)
    torch.testing.assert_close(torch.randn((2, 3), generator=g), seeded_noise([5], (2, 3))[0])
    torch.testing.assert_close(n[0, 0], torch.randn((2, 3), generator=g))


def test_the_window_runs_the_sde_inside_and_euler_outside(small_model):
    from solrl_engine.models import load_model
    from solrl_engine.sampling.sampler import model_sigmas

    model = load_model("tiny", small_model, device="cpu")
    cond = model.encode_prompts(["a red circle", "a blue square"])
    host = model_sigmas(model, 6).tolist()
    x = seeded_noise([3, 4], tuple(model.latent_shape))

    def vel(x, t, c):  # noqa: ANN001, ANN202
        return model.velocity(x, t, c)

    trace: list[torch.Tensor] = []
    with torch.no_grad():
        out = sample_sde(vel, x, cond, [3, 4], host, (2, 4), 0.7, trace=trace)
        states = trace[0]
        assert states.shape == (2, 3, *model.latent_shape)
        # before the window: Euler, exactly the ODE's first two steps
        xe = x.clone()
        for k in range(2):
            xe = xe + (host[k + 1] - host[k]) * vel(xe, torch.full((2,), host[k]), cond)
        torch.testing.assert_close(states[:, 0], xe, rtol=1e-6, atol=1e-6)
        # inside: each transition is the Gaussian's mean plus its scale times that step's seeded noise
        noise = step_noise([3, 4], 6, tuple(model.latent_shape))
        for j in range(2):
            t = torch.full((2,), host[2 + j])
            mean, scale = sde_transition(states[:, j], vel(states[:, j], t, cond), t, torch.full((2,), host[3 + j]),
                                         host[1], 0.7)  # fmt: skip
            torch.testing.assert_close(states[:, j + 1], mean + scale * noise[:, 2 + j], rtol=1e-6, atol=1e-6)
        # after it: Euler again to the end
        xe = states[:, -1]
        for k in range(4, 6):
            xe = xe + (host[k + 1] - host[k]) * vel(xe, torch.full((2,), host[k]), cond)
        torch.testing.assert_close(out, xe, rtol=1e-6, atol=1e-6)
    # the windows: Flow-GRPO every step but the last; Fast, `size` steps in the first half, drawn from the generator
    assert sde_window(10, 0, None, None) == (0, 9)
    g = torch.Generator().manual_seed(0)
    seen = {sde_window(10, 2, None, g) for _ in range(200)}
    assert seen == {(k, k + 2) for k in range(4)}


def _cfg(small_model: str, tmp, **kw) -> RLConfig:  # noqa: ANN001
    base = dict(name="fg", model="tiny", model_path=small_model, objective="flow_grpo", n=6, k=4, prompts_per_iter=2,
                preview_steps=2, full_steps=4, iterations=2, eval_every=1, eval_prompt_count=2, eval_seeds=1,
                save_every=1, lora_rank=4, lora_alpha=8, lr=1e-2, rollout_batch_size=8, train_batch_size=4,
                explore_precision="nvfp4", kl_beta=0.04, clip_range=0.2, device="cpu", output=str(tmp))  # fmt: skip
    return RLConfig(**{**base, **kw})


@pytest.mark.parametrize(("family", "objective", "mode"),
                         [("sol_rl", "flow_grpo", "lora"), ("naive_quant", "flow_grpo_fast", "lora"),
                          ("diffusionnft", "flow_grpo", "full")])  # fmt: skip
def test_the_trainer_runs_flow_grpo_in_every_family_and_resumes_exactly(small_model, tmp_path, family, objective,
                                                                        mode):  # fmt: skip
    from solrl_engine.rl.trainer import Trainer

    kw = dict(family=family, objective=objective, train_mode=mode, **({"n": 4} if family == "diffusionnft" else {}))
    if mode == "full":
        kw["lr"] = 1e-3
    whole = Trainer(_cfg(small_model, tmp_path / "whole", **kw), progress=False)
    before = [p.detach().clone() for p in whole.adapters.params("default")]
    whole.run()
    after = whole.adapters.params("default")
    assert any(not torch.equal(a, p) for a, p in zip(before, after, strict=True))  # it trained
    # on-policy: the old policy (which samples the next rollouts) is the trained one after each update
    for o, p in zip(whole.adapters._old(), whole.adapters._trained(), strict=True):
        torch.testing.assert_close(o, p, rtol=0, atol=0)
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["objective"] == objective for r in rows)
    if objective == "flow_grpo":  # every step but the last: the window always starts at 0
        assert [r["sde_window_start"] for r in rows] == [0.0, 0.0]
    else:
        assert all(0 <= r["sde_window_start"] <= 1 for r in rows)  # sde_window 2 in the first half of 4 steps
    # the first optimizer step of an iteration sees ratio 1: the update's policy sampled the rollouts
    assert all(r["approx_kl"] < 1e-3 for r in rows), rows
    # resume: one iteration, stop, one more, equals two in a row (the window and noise come from saved generators)
    Trainer(_cfg(small_model, tmp_path / "split", iterations=1, **kw), progress=False).run()
    split = Trainer(_cfg(small_model, tmp_path / "split", **kw), progress=False)
    split.run(resume=True)
    rows2 = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, rows2, strict=True):
        for key in ("reward_mean", "loss", "policy_loss", "kl", "grad_norm", "selection_digest", "sde_window_start"):
            assert a[key] == b[key], key
    for a, b in zip(after, split.adapters.params("default"), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_what_an_sde_objective_cannot_use_is_refused_with_the_choices():
    def cfg(**kw):  # noqa: ANN202
        return RLConfig(**{"name": "t", "model": "tiny", "objective": "flow_grpo", **kw})

    with pytest.raises(ConfigError, match=r"sde_noise_level = 0.0: flow_grpo trains on per-step log-probabilities, "
                                          r"which a sampler without noise has none of.*\('nft', 'awm'\)"):
        cfg(sde_noise_level=0.0).validate()
    with pytest.raises(ConfigError, match="clip_range = 0.0: the probability ratio's clip must be > 0"):
        cfg(clip_range=0.0).validate()
    with pytest.raises(ConfigError, match="full_steps = 1: flow_grpo trains on every SDE step but the last"):
        cfg(full_steps=1, preview_steps=1).validate()
    with pytest.raises(ConfigError, match=r"sde_window = 6: SDE steps per rollout: between 1 and sde_window_range "
                                          r"\(5; None is half of full_steps\): lower sde_window, or raise "
                                          r"sde_window_range up to full_steps - 1 \(9\)"):
        cfg(objective="flow_grpo_fast", sde_window=6).validate()
    with pytest.raises(ConfigError, match=r"sde_window_range = 10: .*between 1 and full_steps - 1 \(9\)"):
        cfg(objective="flow_grpo_fast", sde_window_range=10).validate()
    cfg(objective="flow_grpo_fast", sde_window=3, sde_window_range=9).validate()
    RLConfig(name="t", model="tiny", sde_noise_level=0.0).validate()  # nft trains on final samples: no SDE needed


def test_coupled_noise_is_the_fine_sdes_brownian_path():
    """A preview's SDE noise on the regeneration's Brownian path (sampling.sde.coupled_noise): on the fine grid itself
    it is the fine SDE's own noise; on a grid nested in it, each coarse step's increment is the sum of the fine ones it
    spans, exactly; on any grid the noise is standard normal and uncorrelated across steps (the bridge), and the steps
    outside a window get none, a step half inside half the variance."""
    from solrl_engine.sampling.sde import coupled_noise

    fine = [1 - k / 10 for k in range(11)]
    shape = (3,)
    n, w, sc = coupled_noise([7, 8], fine, fine, (0, 9), shape)
    torch.testing.assert_close(n[:, :9], step_noise([7, 8], 10, shape)[:, :9], rtol=0, atol=1e-6)
    assert w == (0, 9) and sc == [1.0] * 9 + [0.0]
    nested = [1 - j / 5 for j in range(6)]  # every other fine time
    n5, w5, _ = coupled_noise([7, 8], nested, fine, (0, 9), shape)
    eps = step_noise([7, 8], 10, shape)
    for j in range(4):
        want = (math.sqrt(0.1) * (eps[:, 2 * j] + eps[:, 2 * j + 1])) / math.sqrt(0.2)
        torch.testing.assert_close(n5[:, j], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(n5[:, 4], eps[:, 8], rtol=0, atol=1e-5)  # its span ends at the window's end (0.1)
    assert w5 == (0, 5)
    coarse = [1.0, 0.83, 0.61, 0.47, 0.22, 0.0]  # no time shared with the fine grid but the first
    many, _, sc2 = coupled_noise(list(range(4000)), coarse, fine, (0, 9), (1,))
    x = many[:, :, 0]
    assert x.mean(0).abs().max() < 0.06 and (x.std(0) - 1).abs().max() < 0.06
    corr = torch.corrcoef(x.T)
    assert (corr - torch.eye(5)).abs().max() < 0.06
    assert sc2[-1] == pytest.approx(math.sqrt((0.22 - 0.1) / 0.22))  # the last step: partly past the window
    # Flow-GRPO-Fast's window (2 fine steps, [0.7, 0.5]): coarse steps outside it get no noise
    nf, wf, scf = coupled_noise([1, 2], coarse, fine, (3, 5), shape)
    assert wf == (1, 3) and scf[0] == scf[3] == scf[4] == 0 and (nf[:, [0, 3, 4]] == 0).all()
    assert scf[1] == pytest.approx(math.sqrt((0.7 - 0.61) / (0.83 - 0.61)))
    assert scf[2] == pytest.approx(math.sqrt((0.61 - 0.5) / (0.61 - 0.47)))


def test_coupled_previews_sample_through_the_rollouts_and_the_trainer(small_model, tmp_path):
    """A coupled preview on the full grid is the regeneration's SDE sample itself; sol_rl with preview_sde trains;
    preview_sde is refused where no SDE regeneration exists to couple to."""
    from solrl_engine.rl.runtime import build_rollouts
    from solrl_engine.rl.trainer import Trainer
    from solrl_engine.sampling.sde import Coupling

    cfg = _cfg(small_model, tmp_path / "c", objective="flow_grpo_fast", preview_sde=True, iterations=1)
    ro = build_rollouts(cfg)
    cond = ro.encode(["a red circle"] * 3)
    with torch.no_grad():
        final = ro.sample(cond, [1, 2, 3], 4, window=(1, 3))
        same = ro.sample(cond, [1, 2, 3], 4, couple=Coupling(4, (1, 3)))
        preview = ro.sample(cond, [1, 2, 3], 2, couple=Coupling(4, (1, 3)))
    torch.testing.assert_close(same, final, rtol=0, atol=1e-5)
    assert preview.shape == final.shape and torch.isfinite(preview).all()
    m = Trainer(cfg, progress=False).step()
    assert math.isfinite(m["loss"]) and m["objective"] == "flow_grpo_fast"
    # auto (None): coupled where sol_rl regenerates with an SDE; False: the previews sample `solver` as it is
    from solrl_engine.rl.objectives import preview_coupling

    assert preview_coupling(_cfg(small_model, tmp_path, objective="flow_grpo_fast"), (1, 3)) == Coupling(4, (1, 3))
    assert preview_coupling(_cfg(small_model, tmp_path, objective="flow_grpo_fast", preview_sde=False), (1, 3)) is None
    assert preview_coupling(_cfg(small_model, tmp_path, objective="flow_grpo", family="naive_quant"), (0, 3)) is None
    with pytest.raises(ConfigError, match=r"preview_sde = True: .*objective='nft'.*leave preview_sde None \(auto\)"):
        RLConfig(name="t", model="tiny", preview_sde=True).validate()
    with pytest.raises(ConfigError, match=r"preview_sde = True: .*family='naive_quant'"):
        RLConfig(name="t", model="tiny", objective="flow_grpo", family="naive_quant", preview_sde=True).validate()
