"""Sol-RL pieces: selection, advantages, rank statistics, the DiffusionNFT loss, configs."""

from __future__ import annotations

import pytest
import torch

from solrl_engine.rl import ConfigError, RLConfig, apply_overrides, load_config
from solrl_engine.rl.objectives.nft import nft_loss
from solrl_engine.rl.ranking import group_advantages, kendall, overlap, select_contrastive, spearman


def test_selection_picks_exactly_the_top_and_bottom_seeds():
    r = torch.tensor([[0.5, 0.9, 0.1, 0.7, 0.3, 0.2], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    idx = select_contrastive(r, 4)
    assert idx.tolist() == [[1, 3, 5, 2], [5, 4, 1, 0]]
    assert select_contrastive(r, 6).tolist() == [list(range(6))] * 2
    g = torch.Generator().manual_seed(0)
    big = torch.rand(5, 96, generator=g)
    idx = select_contrastive(big, 24)
    for row, sel in zip(big, idx, strict=True):
        order = row.argsort(descending=True)
        assert set(sel[:12].tolist()) == set(order[:12].tolist())
        assert set(sel[12:].tolist()) == set(order[-12:].tolist())
    with pytest.raises(ValueError):
        select_contrastive(r, 7)


def test_advantages_per_prompt_mean_global_std_and_clip():
    r = torch.tensor([[1.0, 3.0], [10.0, 30.0]])
    a = group_advantages(r, clip=100.0)
    std = r.std(unbiased=False) + 1e-4
    torch.testing.assert_close(a, torch.tensor([[-1.0, 1.0], [-10.0, 10.0]]) / std)
    assert group_advantages(torch.tensor([[0.0, 100.0], [0.0, 0.0]]), clip=0.5).abs().max() == 0.5
    # sharded: the std comes from every rank's rewards
    a2 = group_advantages(r[:1], clip=100.0, global_rewards=r)
    torch.testing.assert_close(a2, a[:1])


def test_rank_statistics_on_known_cases():
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    assert spearman(a, a).item() == pytest.approx(1.0)
    assert spearman(a, -a).item() == pytest.approx(-1.0)
    assert kendall(a, a.flip(-1)).item() == pytest.approx(-1.0)
    b = torch.tensor([[1.0, 3.0, 2.0, 4.0, 5.0]])  # one swapped pair of 10
    assert kendall(a, b).item() == pytest.approx(0.8)
    assert spearman(a, b).item() == pytest.approx(1 - 6 * 2 / (5 * 24))
    ties = torch.tensor([[1.0, 1.0, 2.0, 3.0]])
    assert spearman(ties, torch.tensor([[1.0, 2.0, 3.0, 4.0]])).item() == pytest.approx(0.9486833, rel=1e-5)
    top, bot = overlap(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), torch.tensor([[4.0, 1.0, 3.0, 2.0]]), 2)
    assert top.item() == 1.0 and bot.item() == 0.0


def test_nft_loss_matches_a_hand_computed_case():
    # one 1x1x2 sample: x0 = [1, 0], noise-free xt at t = 0.5
    x0 = torch.tensor([[[[1.0, 0.0]]]])
    xt = torch.tensor([[[[0.5, 0.5]]]])
    t = torch.tensor([0.5])
    v_theta = torch.tensor([[[[-1.0, 1.0]]]], requires_grad=True)  # x0_pred = [1, 0]: exact
    v_old = torch.tensor([[[[0.0, 1.0]]]])
    v_ref = torch.tensor([[[[0.0, 0.0]]]])
    adv = torch.tensor([2.5])  # r = 2.5/10 + 0.5 = 0.75
    loss, parts = nft_loss(v_theta, v_old, v_ref, x0, xt, t, adv, beta=1.0, kl_beta=0.1, adv_clip=5.0)
    # v+ = v_theta -> error 0 (weight clamps to 1e-5, 0/1e-5 = 0)
    # v- = 2 v_old - v_theta = [1, 1] -> x0- = [0, 0], err [1, 0]: sq mean 0.5, abs mean 0.5 -> L- = 1
    # policy = 5 * (0.75 * 0 + 0.25 * 1) / 1 = 1.25 ; kl = mean([1, 1]) = 1 -> loss = 1.25 + 0.1
    assert parts["policy_loss"].item() == pytest.approx(1.25)  # parts stay on the device: no host sync in the loss
    assert parts["kl"].item() == pytest.approx(1.0) and not parts["loss"].requires_grad
    assert loss.item() == pytest.approx(1.35)
    loss.backward()
    assert v_theta.grad is not None and torch.isfinite(v_theta.grad).all()


def test_nft_loss_pulls_toward_good_samples_and_away_from_bad():
    torch.manual_seed(0)
    x0 = torch.randn(2, 3, 4, 4)
    noise = torch.randn_like(x0)
    t = torch.tensor([0.7, 0.7])
    xt = (1 - 0.7) * x0 + 0.7 * noise
    v_old = torch.randn_like(x0)
    v = v_old.clone().requires_grad_(True)
    for a in (5.0, -5.0):
        loss, _ = nft_loss(v, v_old, None, x0, xt, t, torch.full((2,), a), kl_beta=0.0)
        (g,) = torch.autograd.grad(loss, v)
        target = noise - x0  # the velocity that reconstructs x0 exactly
        toward = -(g * (target - v_old)).sum()  # > 0: a gradient step moves v toward the target
        assert (toward > 0) == (a > 0)


def test_config_validation_errors_name_the_key():
    base = RLConfig(n=16, k=8)
    assert base.validate() is base
    for changes, match in [
        ({"k": 32}, "k = 32.*k <= n"),
        ({"k": 7}, "even"),
        ({"preview_steps": 12}, "preview_steps"),
        ({"family": "ppo"}, "unknown family"),
        ({"family": "diffusionnft"}, "n must equal k"),
        ({"solver": "rk4"}, "solver"),
        ({"explore_precision": "int4"}, "explore_precision"),
    ]:
        with pytest.raises(ConfigError, match=match):
            RLConfig(**{**base.__dict__, "n": 16, "k": 8, **changes}).validate()


def test_overrides_are_typed_and_unknown_keys_suggest_a_fix():
    cfg = apply_overrides(RLConfig(), ["n=32", "lr=1e-4", "merge_lora=false", "lora_targets=a,b", "model_path=none"])
    assert (cfg.n, cfg.lr, cfg.merge_lora, cfg.lora_targets, cfg.model_path) == (32, 1e-4, False, ("a", "b"), None)
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        apply_overrides(RLConfig(), ["lrr=1"])
    with pytest.raises(ConfigError, match="expected int"):
        apply_overrides(RLConfig(), ["n=many"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(RLConfig(), ["n"])


def test_load_config_from_the_tiny_configs():
    cfg = load_config("configs/tiny.py:tiny_sol_rl_shapes")
    assert cfg.name == "tiny_sol_rl_shapes" and cfg.family == "sol_rl" and cfg.k < cfg.n
    paper = load_config("configs/tiny.py:tiny_sol_rl_shapes", ["paper_scale=true", "iterations=3"])
    assert (paper.n, paper.k, paper.iterations) == (96, 24, 3)
    nft = load_config("configs/tiny.py:tiny_diffusionnft_shapes")
    assert nft.n == nft.k
    for name in ("naive_scaling", "compile", "naive_quant"):
        assert load_config(f"configs/tiny.py:tiny_{name}_shapes").family == name
    with pytest.raises(ConfigError, match="no config function.*tiny_sol_rl_shapes"):
        load_config("configs/tiny.py:tiny_ppo_shapes")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.py:x")
    with pytest.raises(ConfigError, match="configs/<file>.py:<function>"):
        load_config("configs/tiny.py")
