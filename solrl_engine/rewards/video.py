"""Rewards for video: every image reward scored on a set number of frames spread over each clip and aggregated
(their mean, or their minimum: a clip is as good as its worst frame), and a temporal-consistency term.

Why frames and not whole clips: the image rewards (ImageReward, CLIPScore, PickScore, HPSv2) were trained on
stills; a handful of frames spread from the first to the last judges a clip's content at a fraction of scoring
all of them, and `temporal` adds what stills cannot see, whether consecutive frames agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from solrl_engine.viz import frame_indices  # which frames: the same ones the pictures show

FRAME_AGGREGATES = ("mean", "min")


def score_frames(fn: Callable[[torch.Tensor, list[str]], torch.Tensor], videos: torch.Tensor, prompts: list[str],
                 k: int = 4, agg: str = "mean") -> torch.Tensor:  # fmt: skip
    """An image reward `fn` on `k` frames of each video [B, T, 3, H, W], aggregated per video by `agg`."""
    if agg not in FRAME_AGGREGATES:
        raise ValueError(f"frame aggregate {agg!r}: choose one of {FRAME_AGGREGATES}")
    b, t = videos.shape[:2]
    idx = frame_indices(t, k)
    stills = videos[:, idx].flatten(0, 1)
    r = torch.as_tensor(fn(stills, [p for p in prompts for _ in idx])).float().view(b, len(idx))
    return r.mean(dim=1) if agg == "mean" else r.amin(dim=1)


class TemporalConsistency:
    """How much consecutive frames agree: the mean cosine similarity of each frame with the next, each frame
    downsampled to `size` x `size` and centred (its own mean removed, so a global brightness drift does not
    count as agreement). In [-1, 1]; a still clip scores 1, independent noise about 0. Takes videos only."""

    video = True  # WeightedReward hands it whole clips, not frames

    def __init__(self, size: int = 32) -> None:
        self.size = size

    def __call__(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if videos.dim() != 5:
            raise ValueError(f"the temporal reward scores videos [B, T, 3, H, W]; got a tensor of shape "
                             f"{tuple(videos.shape)} (images have no consecutive frames)")  # fmt: skip
        b, t = videos.shape[:2]
        if t < 2:
            return torch.ones(b)
        small = F.adaptive_avg_pool2d(videos.float().flatten(0, 1), self.size).view(b, t, -1)
        small = small - small.mean(dim=2, keepdim=True)
        return F.cosine_similarity(small[:, :-1], small[:, 1:], dim=2, eps=1e-6).mean(dim=1).cpu()
