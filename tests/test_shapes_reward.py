"""The analytic `shapes` reward against the renderer it measures."""

from __future__ import annotations

import random

import pytest
import torch

from solrl_engine.data import shapes as world
from solrl_engine.rewards import load_reward
from solrl_engine.rewards.shapes import score


def _sample_prompts(split: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    ps = world.prompts(split)
    return [rng.choice(ps) for _ in range(n)]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_ground_truth_renders_score_above_0_9(split):
    ps = _sample_prompts(split, 120, 1)
    r = load_reward("shapes")(world.render_batch(ps, 7), ps)
    assert r.shape == (120,) and r.dtype == torch.float32
    assert r.min().item() > 0.9, ps[int(r.argmin())]


def test_images_of_another_prompt_score_low():
    ps = _sample_prompts("train", 120, 2)
    imgs = world.render_batch(ps, 8)
    # a prompt naming colours absent from the image
    others = []
    for p in ps:
        cols = {o.color for o in world.parse(p).objects}
        free = [c for c in world.COLORS if c not in cols]
        others.append(f"a {free[0]} {world.SHAPES[0]}")
    r = score(imgs, others)
    assert r.max().item() < 0.2
    # right colour, wrong shape: clearly below the right prompt
    singles = [p for p in ps if world.parse(p).relation is None][:20]
    imgs1 = world.render_batch(singles, 9)
    wrong = []
    for p in singles:
        o = world.parse(p).objects[0]
        wrong.append(p.replace(o.shape, world.SHAPES[(world.SHAPES.index(o.shape) + 1) % 3]))
    assert (score(imgs1, wrong) < score(imgs1, singles) - 0.25).all()


def test_wrong_relation_scores_lower():
    imgs = world.render_batch(["a red circle to the left of a blue square"] * 8, 3)
    right = score(imgs, ["a red circle to the left of a blue square"] * 8)
    wrong = score(imgs, ["a red circle to the right of a blue square"] * 8)
    assert (wrong < right - 0.4).all()


def test_reward_is_invariant_to_batch_composition():
    ps = _sample_prompts("train", 24, 3)
    imgs = world.render_batch(ps, 4)
    full = score(imgs, ps)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    shuffled = score(imgs[perm], [ps[i] for i in perm])
    torch.testing.assert_close(shuffled, full[perm], rtol=0, atol=1e-6)
    alone = torch.stack([score(imgs[i : i + 1], [ps[i]])[0] for i in range(5)])
    torch.testing.assert_close(alone, full[:5], rtol=0, atol=1e-6)


def test_scores_are_continuous_and_bounded_on_noisy_images():
    ps = _sample_prompts("train", 96, 5)
    g = torch.Generator().manual_seed(0)
    imgs = (world.render_batch(ps, 5) + 0.15 * torch.randn(96, 3, 32, 32, generator=g)).clamp(0, 1)
    r = score(imgs, ps)
    assert (r >= 0).all() and (r <= 1).all()
    assert r.unique().numel() >= 90  # few ties, so rankings are meaningful


def test_bad_inputs_raise_clear_errors():
    reward = load_reward("shapes")
    with pytest.raises(ValueError, match="grammar"):
        reward(torch.zeros(1, 3, 32, 32), ["a photo of a cat"])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.zeros(3, 32, 32), ["a red circle"])
    with pytest.raises(ValueError, match="prompts"):
        reward(torch.zeros(2, 3, 32, 32), ["a red circle"])
    with pytest.raises(ValueError, match="unknown reward"):
        load_reward("aesthetics-v9")


def test_other_resolutions_are_scored_consistently():
    ps = _sample_prompts("train", 16, 6)
    imgs = world.render_batch(ps, 6)
    big = torch.nn.functional.interpolate(imgs, scale_factor=2, mode="bilinear", align_corners=False)
    # areas are normalised to 32x32; upsampling widens anti-aliased edges, so scores stay high, not equal
    r = score(big, ps)
    assert r.mean() > 0.85 and r.min() > 0.75
