"""Mean reward of a model on a prompt set: the number every model card, RL curve and `solrl eval`
reports. `evaluate_rollouts` is the one evaluator of configured runs (the trainer's held-out
curve and `solrl eval` call it); `evaluate` serves a bare FlowModel (pretraining) with the same
solver, steps and seeds by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from solrl_engine.models.base import FlowModel
from solrl_engine.rewards import RewardFn
from solrl_engine.sampling import sample

if TYPE_CHECKING:
    from solrl_engine.sampling.rollouts import Rollouts


def mean_stderr(r: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error of a 1-D sample (of rewards, or of paired per-image differences)."""
    r = r.float()
    return r.mean().item(), (r.std().item() / len(r) ** 0.5 if len(r) > 1 else 0.0)


@dataclass
class EvalResult:
    """Rewards of prompts x seeds: the mean, its standard error, and the same per reward component."""

    prompts: list[str]
    seeds: list[int]
    images: torch.Tensor
    rewards: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        return mean_stderr(self.rewards)[0]

    @property
    def stderr(self) -> float:
        return mean_stderr(self.rewards)[1]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reward_mean": self.mean, "reward_stderr": self.stderr, "n": len(self.rewards)}
        if len(self.components) > 1:
            for k, v in self.components.items():
                out[f"reward_{k}_mean"], out[f"reward_{k}_stderr"] = mean_stderr(v)
        return out


@torch.no_grad()
def evaluate_rollouts(
    ro: Rollouts, prompts: Sequence[str], seeds_per_prompt: int, tag: str = "", batch_prompts: int = 64
) -> EvalResult:
    """Each prompt with seeds 0 .. seeds_per_prompt - 1 through the config's rollout path, with the
    policy as it is now (its active adapter, named by `tag` for the graph cache)."""
    ps = [p for p in prompts for _ in range(seeds_per_prompt)]
    seeds = [j for _ in prompts for j in range(seeds_per_prompt)]
    images, rewards, comps = [], [], []
    step = max(1, batch_prompts) * seeds_per_prompt
    for i in range(0, len(ps), step):
        scored = ro.generate(ps[i : i + step], seeds[i : i + step], tag=tag)
        images.append(scored.images.cpu())
        rewards.append(scored.rewards.float().cpu())
        comps.append(scored.components)
    components = {k: torch.cat([c[k] for c in comps]) for k in comps[0]} if comps else {}
    return EvalResult(ps, seeds, torch.cat(images), torch.cat(rewards), components)


@torch.no_grad()
def generate(
    model: FlowModel,
    prompts: Sequence[str],
    seeds: Sequence[int],
    steps: int = 10,
    shift: float | None = None,
    batch_size: int = 64,
    solver: str = "dpm2",
    transformer: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] for (prompts[i], seeds[i]), no guidance."""
    cond = model.encode_prompts(list(prompts))
    x0 = sample(
        model, cond, list(seeds), steps, shift=shift, solver=solver, batch_size=batch_size, transformer=transformer
    )
    return model.decode(x0)


@torch.no_grad()
def evaluate(
    model: FlowModel,
    reward: RewardFn,
    prompts: Sequence[str],
    seeds_per_prompt: int = 4,
    steps: int = 10,
    seed0: int = 0,
    batch_size: int = 64,
    solver: str = "dpm2",
) -> dict[str, float]:
    """Mean / std of `reward` over prompts x seeds (seeds seed0 .. seed0 + seeds_per_prompt - 1),
    with the trainer's default solver (DPM-Solver++ 2M) so both report the same number."""
    ps = [p for p in prompts for _ in range(seeds_per_prompt)]
    seeds = [seed0 + j for _ in prompts for j in range(seeds_per_prompt)]
    images = generate(model, ps, seeds, steps, batch_size=batch_size, solver=solver)
    r = reward(images, ps).float()
    return {"reward_mean": r.mean().item(), "reward_std": r.std().item(), "n": len(ps)}


def eval_grid(res: EvalResult, seeds_per_prompt: int, header: str, max_images: int = 16) -> Any:
    """A grid of the first seed of up to 16 prompts, each captioned with its reward and prompt."""
    from solrl_engine.viz import frame_strips, image_grid

    pick = list(range(0, len(res.prompts), max(1, seeds_per_prompt)))[:max_images]
    captions = [f"{res.rewards[i].item():.3f} {res.prompts[i]}" for i in pick]
    video = res.images.dim() == 5  # a clip is a strip of its frames
    return image_grid(frame_strips(res.images[pick]), captions, ncol=2 if video else 4, header=header,
                      tile=512 if video else 256)  # fmt: skip


# --- before / after: the base model and the trained adapter, side by side ---------------------------

COMPARE_PNG = "compare.png"


@dataclass
class Comparison:
    """The base model and a trained adapter on the same prompts and seeds: per-image rewards of both,
    and the paired gain (mean and standard error of the per-image differences)."""

    base: EvalResult
    trained: EvalResult

    @property
    def gain(self) -> tuple[float, float]:
        return mean_stderr(self.trained.rewards - self.base.rewards)

    def line(self, path: Any, what: str = "EMA adapter") -> str:
        """The sentence a run ends with: where the picture is and what the paired gain was."""
        g, se = self.gain
        n = len(self.base.rewards)
        return (f"before/after: {path} (base vs {what}, {n} images, same prompts and seeds): "
                f"reward {self.base.mean:.3f} -> {self.trained.mean:.3f}, gain {g:+.3f} +- {se:.3f}")  # fmt: skip


def spread(n: int, k: int) -> list[int]:
    """k indices evenly spaced over range(n) (all of them when n <= k): which prompts a picture shows,
    chosen without looking at rewards, and in proportion to the kinds of prompt the set holds (the
    shapes world's held-out set opens with its 12 one-object prompts, then 52 two-object ones)."""
    return list(range(n)) if n <= k else [i * n // k for i in range(k)]


def compare_figure(cmp: Comparison, header: str = "", labels: tuple[str, str] = ("base", "trained"),
                   max_pairs: int = 8, seeds_per_prompt: int = 1) -> Any:  # fmt: skip
    """compare.png: the first seed of `max_pairs` prompts spread evenly over the set (`spread`: not
    picked by reward), base | trained side by side, each image's reward under it and the prompt under
    the pair."""
    from solrl_engine.viz import frame_strips, pair_grid

    b, t = cmp.base, cmp.trained
    step = max(1, seeds_per_prompt)
    pick = [i * step for i in spread(len(b.prompts) // step, max_pairs)]

    def parts(r: EvalResult, i: int) -> str:  # several rewards: each one's score after the total
        if len(r.components) < 2:
            return ""
        return "  [" + ", ".join(f"{k} {v[i].item():.3f}" for k, v in r.components.items()) + "]"

    picked = [b.prompts[i] for i in pick]
    sources = source_images(picked, tuple(b.images.shape[-2:])) if b.images.dim() == 4 else None  # edits' sources
    return pair_grid(
        frame_strips(b.images[pick]), frame_strips(t.images[pick]),
        [f"{b.rewards[i].item():.3f}{parts(b, i)}" for i in pick],
        [f"{t.rewards[i].item():.3f}  ({t.rewards[i].item() - b.rewards[i].item():+.3f}){parts(t, i)}" for i in pick],
        picked, labels=labels, header=header, sources=sources,
        **({"pairs_per_row": 1, "tile": 512} if b.images.dim() == 5 else {}),
    )  # fmt: skip


def source_images(prompts: Sequence[str], size: tuple[int, int]) -> torch.Tensor | None:
    """[B, 3, H, W] in [0, 1]: each conditioned prompt's source image at `size`, for pictures that show an edit
    beside its source; None when the prompts carry no images."""
    from solrl_engine.data import prompt_images
    from solrl_engine.rewards.edit import SourceImages

    if not prompts or not all(prompt_images(p) for p in prompts):
        return None
    return SourceImages()(list(prompts), size, "compare.png")


COMPARE_GIF = "compare.gif"


def compare_gif(path: Any, cmp: Comparison, max_pairs: int = 4, seeds_per_prompt: int = 1) -> Any:
    """For videos, compare.png's pairs as they play: base | trained of up to `max_pairs` prompts spread over the
    set (the same pick as compare.png), one GIF; None for images."""
    from solrl_engine.viz import write_gif

    b, t = cmp.base, cmp.trained
    if b.images.dim() != 5:
        return None
    step = max(1, seeds_per_prompt)
    pick = [i * step for i in spread(len(b.prompts) // step, max_pairs)]
    pairs = torch.stack([torch.stack([b.images[i], t.images[i]]) for i in pick]).flatten(0, 1)
    return write_gif(path, pairs, ncol=2)
