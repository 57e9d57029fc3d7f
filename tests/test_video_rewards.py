"""Rewards for video: image rewards score frames spread over each clip (mean, or min), a weighted mix hands
image rewards frames and video rewards whole clips, and the temporal term tells a steady clip from a
flickering one. Images keep their interface."""

from __future__ import annotations

import pytest
import torch

from solrl_engine.rewards import WeightedReward, load_reward
from solrl_engine.rewards.video import TemporalConsistency, score_frames
from solrl_engine.viz import frame_indices, frame_strips


def _brightness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    assert images.dim() == 4 and len(prompts) == len(images)  # an image reward sees stills only
    return images.float().mean(dim=(1, 2, 3))


def _ramp(b: int = 2, t: int = 9) -> torch.Tensor:
    """Clips whose frame f has brightness (f + 1) / (t + 1) x (clip + 1) / b: every frame different."""
    levels = (torch.arange(t) + 1.0) / (t + 1)
    scale = (torch.arange(b) + 1.0) / b
    return (levels[None, :, None, None, None] * scale[:, None, None, None, None]).expand(b, t, 3, 8, 8).clone()


def test_frames_spread_over_the_clip_first_and_last_included():
    assert frame_indices(9, 4) == [0, 3, 5, 8] and frame_indices(81, 3) == [0, 40, 80]
    assert frame_indices(5, 8) == [0, 1, 2, 3, 4] and frame_indices(9, 1) == [4]
    with pytest.raises(ValueError, match="at least one frame"):
        frame_indices(9, 0)


def test_image_rewards_score_frames_and_aggregate_by_mean_or_min():
    v = _ramp()
    mean = score_frames(_brightness, v, ["a", "b"], k=4, agg="mean")
    worst = score_frames(_brightness, v, ["a", "b"], k=4, agg="min")
    picked = v[:, [0, 3, 5, 8]].mean(dim=(2, 3, 4))
    torch.testing.assert_close(mean, picked.mean(dim=1))
    torch.testing.assert_close(worst, picked.amin(dim=1))
    assert (worst < mean).all()
    with pytest.raises(ValueError, match="choose one of"):
        score_frames(_brightness, v, ["a", "b"], agg="median")


def test_the_temporal_term_tells_a_steady_clip_from_flicker():
    g = torch.Generator().manual_seed(0)
    still = torch.rand(1, 3, 16, 16, generator=g).expand(9, 3, 16, 16)[None]
    flicker = torch.rand(1, 9, 3, 16, 16, generator=g)
    drift = still + torch.linspace(0, 0.3, 9).view(1, 9, 1, 1, 1)  # a brightness drift is not disagreement
    r = TemporalConsistency()(torch.cat([still, flicker, drift]), ["a"] * 3)
    assert r[0] == pytest.approx(1.0, abs=1e-5) and abs(r[1]) < 0.2 and r[2] == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="scores videos"):
        TemporalConsistency()(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_a_mix_hands_image_rewards_frames_and_video_rewards_clips():
    v = _ramp()
    mix = WeightedReward([("bright", 1.0, _brightness), ("temporal", 0.5, TemporalConsistency())], frames=3,
                         frame_agg="min")  # fmt: skip
    r = mix(v, ["a", "b"])
    want = score_frames(_brightness, v, ["a", "b"], k=3, agg="min")
    torch.testing.assert_close(mix.last_components["bright"], want)
    torch.testing.assert_close(r, want + 0.5 * mix.last_components["temporal"])
    imgs = torch.rand(2, 3, 8, 8)  # images: the image reward sees them as they are
    got = WeightedReward([("bright", 1.0, _brightness)])(imgs, ["a", "b"])
    torch.testing.assert_close(got, _brightness(imgs, ["a", "b"]))


def test_the_registry_builds_the_temporal_reward_by_name():
    r = load_reward("temporal")
    clip = _ramp(1)
    assert r(clip, ["x"]).shape == (1,)


def test_a_clip_is_shown_as_a_strip_of_its_frames():
    v = _ramp(2, 9)
    s = frame_strips(v, k=4)
    assert s.shape == (2, 3, 8, 32) and torch.equal(s[..., 8:16], v[:, 3])
    imgs = torch.rand(2, 3, 8, 8)
    assert frame_strips(imgs) is imgs
