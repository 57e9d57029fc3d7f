"""How a run is judged: the held-out evaluation of the EMA adapter (fixed prompts and seeds, paired with the
first evaluation), the training-prompt curve beside it, the best evaluation's adapter kept as OUT/lora_best,
a degrading policy reported, the reward plot, and the end-of-run before/after picture (compare.png).

Why apart from the trainer: the trainer's step() is the method (explore, select, regenerate, update,
refresh); this is the bookkeeping around it, with its own state in the checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from solrl_engine.evaluation import (
    COMPARE_GIF,
    COMPARE_PNG,
    Comparison,
    EvalResult,
    compare_figure,
    compare_gif,
    eval_grid,
    evaluate_rollouts,
    mean_stderr,
    spread,
)
from solrl_engine.rl.adapters import TRAIN
from solrl_engine.rl.export import save_trained
from solrl_engine.rl.full import TrainedWeights
from solrl_engine.sampling.rollouts import Rollouts
from solrl_engine.store import checkpoint
from solrl_engine.store.safe import read_regular
from solrl_engine.viz import line_plot, save_image

log = logging.getLogger("solrl_engine.rl")


COMPARE_PAIRS = 8  # prompts in the end-of-run picture, base vs the EMA adapter


def picture_prompts(prompts: Sequence[str], max_pairs: int = COMPARE_PAIRS) -> list[str]:
    """The held-out prompts the end-of-run picture shows: `max_pairs` spread over the set."""
    prompts = list(prompts)
    return [prompts[i] for i in spread(len(prompts), max_pairs)]


@torch.no_grad()
def compare_adapters(ro: Rollouts, adapters: TrainedWeights, prompts: Sequence[str], seeds_per_prompt: int = 1
                     ) -> Comparison:  # fmt: skip
    """The base model (adapters off) and the EMA adapter of a training run through the run's own rollout path,
    on the same prompts and seeds."""
    with adapters.using("ref"):
        base = evaluate_rollouts(ro, prompts, seeds_per_prompt, tag="ref")
    with adapters.ema_weights():
        trained = evaluate_rollouts(ro, prompts, seeds_per_prompt, tag=TRAIN)
    return Comparison(base, trained)


def write_compare(out_dir: Any, ro: Rollouts, adapters: TrainedWeights, prompts: Sequence[str], header: str,
                  tracker: Any = None, step: int = 0, max_pairs: int = COMPARE_PAIRS
                  ) -> tuple[Comparison, Any]:  # fmt: skip
    """End of a training run: OUT/compare.png of `max_pairs` held-out prompts spread over the set (seed
    0), base vs the EMA adapter, also to the tracker (TensorBoard / wandb) when the run logs to one.
    Regenerated here rather than kept from the first evaluation: a resumed run has the same picture,
    and it costs 2 x `max_pairs` images."""
    cmp = compare_adapters(ro, adapters, picture_prompts(prompts, max_pairs))
    g, _se = cmp.gain
    head = f"{header}  |  these {len(cmp.base.rewards)}: {cmp.base.mean:.3f} -> {cmp.trained.mean:.3f} ({g:+.3f})"
    fig = compare_figure(cmp, head, ("base", "trained (EMA)"), max_pairs)
    gif = compare_gif(Path(out_dir) / COMPARE_GIF, cmp)  # videos: the pairs as they play (images: None)
    path = save_image(fig, Path(out_dir) / COMPARE_PNG)
    if tracker is not None:
        tracker.image("eval/compare", fig, step)
        if gif is not None:
            tracker.video("eval/compare_video", gif, step)
    return cmp, path


class HeldOut:
    """The held-out evaluations of one run and what follows from them (see the module docstring). Every rank
    evaluates a share; rank 0 writes the grids, lora_best and the pictures."""

    def __init__(self, out: Path, rollouts: Rollouts, adapters: TrainedWeights, dist: Any, eval_prompts: list[str],
                 train_prompts: list[str], seeds: int) -> None:  # fmt: skip
        self.out, self.rollouts, self.adapters, self.dist = out, rollouts, adapters, dist
        # OUT/lora_best, or OUT/transformer_best for full fine-tuning
        self.best_name = checkpoint.EXPORT_DIRS[adapters.kind][2]
        self.best_dir = out / self.best_name
        self.eval_prompts, self.train_prompts, self.seeds = eval_prompts, train_prompts, seeds
        self.evals: list[tuple[int, float, float]] = []  # (iteration, mean, standard error)
        self.train_evals: list[tuple[int, float, float]] = []  # the same on the training prompts
        # The first evaluation's per-image rewards: later ones (same prompts, same seeds) are compared
        # image by image, a paired difference whose noise is far below the mean's own standard error.
        self.eval_base: torch.Tensor | None = None
        self.gains: list[tuple[int, float, float]] = []  # (iteration, mean paired gain, its standard error)
        # The best held-out evaluation so far, (iteration, per-image rewards): its EMA adapter is
        # OUT/lora_best, and a later evaluation that falls well below it is reported as a degrading policy.
        self.best: tuple[int, torch.Tensor] | None = None

    @torch.no_grad()
    def evaluate(self, iteration: int, tracker: Any = None) -> float:
        """Mean reward on the held-out prompts with the EMA adapter (fixed seeds 0 .. seeds - 1), and on the
        training prompts with the same seeds when there are any; writes an image grid of the held-out images
        with each one's prompt and reward."""
        dist = self.dist
        prompts = self.eval_prompts + self.train_prompts  # one pass: held-out first, then training
        # each share (a rank, or a context-parallel group) evaluates a contiguous part, the last one padded
        per = -(-len(prompts) // dist.dp_world)
        padded = prompts + [prompts[-1]] * (per * dist.dp_world - len(prompts))
        mine = padded[dist.dp_rank * per : (dist.dp_rank + 1) * per]
        with self.adapters.ema_weights():
            res = evaluate_rollouts(self.rollouts, mine, self.seeds, tag=TRAIN)
        n = len(self.eval_prompts) * self.seeds
        rewards = dist.gather_rows(res.rewards.to(self.rollouts.device)).cpu()[: len(prompts) * self.seeds]
        full = EvalResult(list(self.eval_prompts), [], res.images, rewards[:n])
        mean, sem = full.mean, full.stderr
        if self.eval_base is None or len(self.eval_base) != n:
            self.eval_base = full.rewards.clone()
        gain, gain_sem = mean_stderr(full.rewards - self.eval_base)
        self.gains.append((iteration, gain, gain_sem))
        self.track_best(iteration, full.rewards)
        if self.train_prompts:
            tr = EvalResult(list(self.train_prompts), [], res.images, rewards[n:])
            self.train_evals.append((iteration, tr.mean, tr.stderr))
        if dist.main:
            head = (f"iter {iteration}: held-out reward {mean:.3f} +- {sem:.3f}, "
                    f"gain {gain:+.3f} +- {gain_sem:.3f} (EMA adapter, {n} images, same seeds)")  # fmt: skip
            grid = eval_grid(res, self.seeds, head)  # rank 0's share starts with the held-out prompts
            save_image(grid, self.out / f"eval_{iteration:05d}.png")
            if tracker is not None:
                tracker.image("eval/grid", grid, iteration)
        self.evals.append((iteration, mean, sem))
        return mean

    def track_best(self, iteration: int, rewards: torch.Tensor) -> None:
        """Export the EMA adapter of a new best held-out evaluation as OUT/lora_best (a long run that
        degrades keeps its best adapter), and warn when an evaluation falls more than 3 standard errors
        below the best (paired: the same prompts and seeds), naming what to change."""
        mean, best_dir = rewards.mean().item(), self.best_dir
        if self.best is None or mean > self.best[1].mean().item():
            self.best = (iteration, rewards.clone())
            if iteration > 0 and (self.dist.main or self.adapters.collective_io):  # at 0 the best is the base model
                info = {checkpoint.BEST_INFO: json.dumps({"iteration": iteration, "heldout_reward": mean})}
                save_trained(self.adapters, best_dir, self.rollouts.spec.pipeline, ema=True, extra=info,
                             write=self.dist.main)  # fmt: skip
            return
        it, best_rewards = self.best
        gain, se = mean_stderr(rewards - best_rewards)
        if -gain > 3 * se and len(rewards) > 1 and self.dist.main:
            kept = f"{best_dir} holds that evaluation's EMA adapter" if it > 0 else "the base model was better"
            log.warning(
                "iteration %d: the held-out reward (%.3f) is %.3f +- %.3f below its best (%.3f at iteration %d, "
                "same prompts and seeds): the policy is degrading; %s. For a longer run anchor the policy "
                "(e.g. --set kl_beta=0.1) or lower the learning rate (e.g. --set lr=3e-4)",
                iteration, mean, -gain, se, best_rewards.mean().item(), it, kept,
            )  # fmt: skip

    def state(self) -> dict[str, Any]:
        """The checkpoint's part: the curves, the paired base and the best evaluation."""
        return {
            "evals": list(self.evals),
            "train_evals": list(self.train_evals),
            "eval_base": None if self.eval_base is None else self.eval_base.tolist(),
            "gains": list(self.gains),
            "best": None if self.best is None else [self.best[0], self.best[1].tolist()],
        }

    def load_state(self, st: dict[str, Any]) -> None:
        """Continue from a checkpoint's part (keys absent in older checkpoints start afresh), then drop a
        lora_best written after that checkpoint."""
        self.evals = [tuple(e) for e in st["evals"]]  # type: ignore[misc]
        self.train_evals = [tuple(e) for e in st.get("train_evals", [])]  # type: ignore[misc]
        base = st.get("eval_base")  # absent in checkpoints of older versions: gains restart from here
        self.eval_base = None if base is None else torch.tensor(base)
        self.gains = [tuple(g) for g in st.get("gains", [])]  # type: ignore[misc]
        best = st.get("best")  # absent in checkpoints of older versions: tracked from here on
        self.best = None if best is None else (best[0], torch.tensor(best[1]))
        self.drop_stale_best()

    def drop_stale_best(self) -> None:
        """A lora_best written after the checkpoint being resumed belongs to iterations that will run
        again: remove it, so the directory always matches the best the run knows of."""
        best_dir = self.best_dir
        if not self.dist.main or not best_dir.exists():
            return
        try:  # missing or torn (a crash while it was written): unknown, so the directory goes
            on_disk = json.loads(read_regular(best_dir / checkpoint.BEST_INFO)).get("iteration")
        except (OSError, ValueError, AttributeError):
            on_disk = None
        if self.best is None or on_disk != self.best[0]:
            log.info("removing %s (iteration %s): it was written after the resumed checkpoint", best_dir, on_disk)
            best_dir.unlink() if best_dir.is_symlink() else shutil.rmtree(best_dir)  # a link: removed, not followed

    def last(self) -> dict[str, Any]:
        """The last evaluation's numbers for the iteration's metrics record."""
        m = {"heldout_stderr": self.evals[-1][2]}
        m["heldout_gain"], m["heldout_gain_stderr"] = self.gains[-1][1:]
        if self.train_evals:
            m["train_prompt_reward"], m["train_prompt_stderr"] = self.train_evals[-1][1:]
        return m

    def plot(self, history: list[dict[str, Any]], title: str, reward: str) -> None:
        """OUT/reward.png: each iteration's rollout reward, the held-out and training-prompt curves with
        their standard-error bands."""
        done = [h for h in history if "reward_mean" in h]  # skipped iterations have no rewards
        series = {"rollout reward (each iteration's prompts)": ([h["iter"] for h in done],
                                                               [h["reward_mean"] for h in done])}  # fmt: skip
        parts = [k for k in (done[-1] if done else {}) if k.startswith("reward_") and k.endswith("_mean")
                 and k != "reward_mean"]  # fmt: skip
        for k in parts:  # several rewards: each one's rollout curve (the metrics' reward_<name>_mean)
            series[f"{k.removeprefix('reward_').removesuffix('_mean')} (rollouts)"] = (
                [h["iter"] for h in done if k in h], [h[k] for h in done if k in h])
        bands = {}
        for name, evals in (("held-out prompts (EMA)", self.evals), ("training prompts (EMA)", self.train_evals)):
            if evals:
                series[name] = ([e[0] for e in evals], [e[1] for e in evals])
                bands[name] = [e[2] for e in evals]
        line_plot(self.out / "reward.png", series, title, "iteration", f"{reward} reward", bands)

    def compare(self, name: str, iteration: int, tracker: Any = None) -> Path | None:
        """The end of a run: compare.png, base vs the EMA adapter on held-out prompts (None without an
        evaluation to head it)."""
        if not self.eval_prompts or not self.gains or self.eval_base is None:
            return None
        if not self.dist.main:  # a sharded policy: every rank samples the pictures (collectives), rank 0 draws
            compare_adapters(self.rollouts, self.adapters, picture_prompts(self.eval_prompts))
            return None
        it, g, se = self.gains[-1]
        head = f"{name}: held-out paired gain {g:+.3f} +- {se:.3f} ({len(self.eval_base)} images, iteration {it})"
        return write_compare(self.out, self.rollouts, self.adapters, self.eval_prompts, head, tracker, iteration)[1]

    def summary(self) -> dict[str, Any]:
        """The run summary's held-out part."""
        ev, tr, gains = self.evals, self.train_evals, self.gains
        return {
            "heldout_reward_start": ev[0][1] if ev and ev[0][0] == 0 else None,
            "heldout_reward_final": ev[-1][1] if ev else None,
            "heldout_stderr_final": ev[-1][2] if ev else None,
            # paired over the same prompts and seeds as the first evaluation
            "heldout_gain_final": gains[-1][1] if gains else None,
            "heldout_gain_stderr_final": gains[-1][2] if gains else None,
            "train_prompt_reward_start": tr[0][1] if tr else None,
            "train_prompt_reward_final": tr[-1][1] if tr else None,
        }

    def best_summary(self) -> dict[str, Any]:
        """The run summary's best-adapter part (None: no evaluation beat the base model)."""
        best = self.best
        return {
            "heldout_best_iteration": None if best is None else best[0],
            "heldout_reward_best": None if best is None else best[1].mean().item(),
            self.best_name: str(self.best_dir) if best and best[0] > 0 else None,
        }
