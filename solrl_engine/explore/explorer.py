"""Sol-RL's explore-and-select as a library call: the public Explorer (and its Selection) that other trainers
use as a drop-in rollout backend, and that the trainer itself explores through.

Why here, below rl/: a trainer that is not ours reaches the explore layer exactly as ours does (plan ->
ExploreSpec -> the copy -> select), with no training config in between.
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from solrl_engine.data import prompt_images
from solrl_engine.explore.copy import ExploreCopy, speed_bound
from solrl_engine.explore.plan import ExploreSettings, ExploreSpec, plan
from solrl_engine.explore.ranking import kendall, nk_problem, select_contrastive, spearman
from solrl_engine.models import model_spec, wrap_pipeline
from solrl_engine.models.base import Conditioning, RewardFn
from solrl_engine.nn import fast_path, requantize_
from solrl_engine.sampling import seeded_noise
from solrl_engine.sampling.rollouts import Pending, Rollouts, RolloutSettings
from solrl_engine.sampling.sampler import SOLVERS
from solrl_engine.sampling.sde import Coupling

log = logging.getLogger("solrl_engine.explore")


def _check_args(n: int, k: int, preview_steps: int, solver: str, guidance_scale: float | None, batch_size: int,
                settings: ExploreSettings) -> None:  # fmt: skip
    """The Explorer's arguments, checked before anything is built: one ValueError naming the argument."""
    problems = [("k", nk_problem(n, k)),
                ("preview_steps", None if preview_steps >= 1 else "must be >= 1"),
                ("solver", None if solver in SOLVERS else f"choose one of {SOLVERS}"),
                ("guidance_scale", None if guidance_scale is None or guidance_scale >= 0 else
                 "must be >= 0 (1.0: no classifier-free guidance; None: the model's default)"),
                ("batch_size", None if batch_size >= 1 else "must be >= 1")]  # fmt: skip
    values = {"k": k, "preview_steps": preview_steps, "solver": solver, "guidance_scale": guidance_scale,
              "batch_size": batch_size}  # fmt: skip
    for name, why in problems:
        if why is not None:
            raise ValueError(f"Explorer: {name} = {values[name]!r}: {why}")
    quantize_key = {"precision": "explore_precision", "layers": "quantize['include']",
                    "skip": "quantize['extra_skip']"}  # fmt: skip
    for name, why in settings.problems():
        key = quantize_key.get(name, f"quantize[{name!r}]")
        raise ValueError(f"Explorer: {key} = {getattr(settings, name)!r}: {why}")
    if settings.precision == "bf16" and settings.attention != "bf16":
        raise ValueError(f"Explorer: quantize['attention'] = {settings.attention!r}: with explore_precision='bf16' "
                         "your pipeline explores itself, its attention as it is: choose a quantized explore_precision "
                         "(nvfp4, fp8, auto) or leave attention out")  # fmt: skip


def _prompt_list(prompts: Any) -> list[str]:
    """The prompts as a list of strings, or one line saying what is wrong (a bare string would be split into
    its characters)."""
    if isinstance(prompts, str):
        raise ValueError(f"Explorer.select: prompts is one string ({prompts[:40]!r}); pass a list of prompts, "
                         "e.g. [prompt]")  # fmt: skip
    try:
        out = list(prompts)
    except TypeError:
        raise ValueError(f"Explorer.select: prompts is a {type(prompts).__name__}; pass a list of strings") from None
    if not out:
        raise ValueError("Explorer.select: prompts is empty; pass at least one prompt")
    if not all(isinstance(p, str) for p in out):
        kind = next(type(p).__name__ for p in out if not isinstance(p, str))
        raise ValueError(f"Explorer.select: prompts holds a value of type {kind}; every prompt is a string")
    return out


def _seed_rows(seeds: Any, prompts: int, n: int) -> list[list[int]]:
    """The given seeds as `prompts` rows of `n` ints, or one line saying what is wrong."""
    want = f"give {n} seeds for each of the {prompts} prompts (a list of {prompts} lists of {n} ints)"
    try:
        rows = [list(row) for row in seeds]
        if len(rows) != prompts or any(len(r) != n for r in rows):
            raise ValueError
        if any(isinstance(x, bool) or int(x) != x or not 0 <= int(x) < 2**63 for r in rows for x in r):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"Explorer.select: seeds do not fit: {want}, each a whole number >= 0") from None
    return [[int(x) for x in r] for r in rows]


@dataclass
class Regenerated:
    """The caller's pipeline run on the selected seeds' noise: images [P*K, 3, H, W], rewards [P, K]."""

    images: torch.Tensor
    rewards: torch.Tensor


@dataclass
class Selection:
    """What `Explorer.select` found, per prompt: the top K/2 then the bottom K/2 seeds by proxy reward.

    seeds: [P][K] ints; proxy_rewards / ranks: [P, K] (rank 0 = best of the N explored);
    noise: [P*K, ...] prompt-major, each row the initial latent of its seed in the layout the
    pipeline's `latents=` argument takes (torch.Generator().manual_seed(seed) noise);
    all_seeds / all_rewards: the N explored seeds and their proxy rewards [P, N].
    """

    prompts: list[str]
    seeds: list[list[int]]
    proxy_rewards: torch.Tensor
    ranks: torch.Tensor
    noise: torch.Tensor
    all_seeds: list[list[int]]
    all_rewards: torch.Tensor
    index: torch.Tensor
    explorer: Explorer | None = None
    samples: torch.Tensor | None = None  # the selected previews' final latents, when asked for
    nonfinite: str | None = None  # select(nonfinite="defer"): which rewards were NaN or inf (nothing was ranked)
    trace: torch.Tensor | None = None  # select(window=...): the selected rollouts' SDE states [P*K, W + 1, ...]

    @classmethod
    def join(cls, parts: Sequence[Selection]) -> Selection:
        """One Selection of several over consecutive prompt groups (an explore run in parts), prompt-major."""
        def cat(name: str) -> Any:
            vals = [getattr(p, name) for p in parts]
            return None if any(v is None for v in vals) else torch.cat(vals)

        first = parts[0]
        unranked = "; ".join(p.nonfinite for p in parts if p.nonfinite) or None
        return cls([q for p in parts for q in p.prompts], [row for p in parts for row in p.seeds], cat("proxy_rewards"),
                   cat("ranks"), cat("noise"), [row for p in parts for row in p.all_seeds], cat("all_rewards"),
                   cat("index"), first.explorer, cat("samples"), unranked, cat("trace"))  # fmt: skip

    @property
    def flat_prompts(self) -> list[str]:
        k = len(self.seeds[0]) if self.seeds else 0
        return [p for p in self.prompts for _ in range(k)]

    @property
    def flat_seeds(self) -> list[int]:
        return [s for row in self.seeds for s in row]

    def regenerate(self, pipe: Any, steps: int = 10, batch_size: int = 8, **call_kwargs: Any) -> Regenerated:
        """Run the caller's pipeline on the selected seeds' noise (`latents=`) and score the images
        with the explorer's reward: the full-precision twins of the previews, for trainers that
        train on ODE samples (DiffusionNFT-style). Conditioned prompts (an editing or image-to-video set) pass
        their image, one prompt's seeds a call."""
        ex = self.explorer
        if ex is None:
            raise ValueError("this Selection has no explorer to take the resolution and reward from")
        for name, v in (("steps", steps), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Selection.regenerate: {name} = {v!r}: must be a whole number >= 1")
        kw: dict[str, Any] = {"num_inference_steps": steps, "output_type": "pt", "height": ex.resolution,
                              "width": getattr(ex.model, "width", None) or ex.resolution,
                              "guidance_scale": ex.pipeline_guidance}  # fmt: skip
        takes = inspect.signature(type(pipe).__call__).parameters
        if (low := ex.rollouts.pipeline_guidance_2) is not None and "guidance_scale_2" in takes:  # two experts apart
            kw["guidance_scale_2"] = low
        if getattr(ex.model, "frames", None):  # a video pipeline: its clip length, as the previews had it, under the
            kw["num_frames" if "num_frames" in takes else "frames"] = ex.model.frames  # pipeline's name (SANA-Video's)
        if "use_resolution_binning" in takes:
            kw["use_resolution_binning"] = False
        kw.update(call_kwargs)
        prompts, images = self.flat_prompts, []
        inputs = getattr(ex.model, "pipeline_inputs", None)
        dtype = next(pipe.transformer.parameters()).dtype
        for i, j in _batches(prompts, batch_size):
            # a conditioned prompt's image (an edit's source, a clip's first frame) as the pipeline takes it: one
            # image a call, so a batch holds one prompt's seeds
            extra = inputs(prompts[i], j - i) if inputs is not None and prompt_images(prompts[i]) else {}
            out = pipe(prompt=prompts[i:j], latents=self.noise[i:j].to(dtype), **{**kw, **extra})
            images.append((out.frames if hasattr(out, "frames") else out.images).float().cpu())  # videos: frames
        imgs = torch.cat(images)
        r = ex.reward(imgs, prompts)
        return Regenerated(imgs, torch.as_tensor(r).float().cpu().view(len(self.prompts), -1))

    def fidelity(self, bf16_rewards: torch.Tensor) -> dict[str, Any]:
        """How faithfully the proxy ranked the selected seeds against the caller's full-precision
        rewards [P, K]: mean Spearman and Kendall over prompts (and per prompt)."""
        full = torch.as_tensor(bf16_rewards).float().cpu()
        if full.numel() != self.proxy_rewards.numel():
            raise ValueError(f"Selection.fidelity: bf16_rewards has shape {tuple(full.shape)}; give one reward per "
                             f"selected seed, [P, K] = {tuple(self.proxy_rewards.shape)} (Regenerated.rewards)")
        if not bool(torch.isfinite(full).all()):
            raise ValueError("Selection.fidelity: bf16_rewards holds NaN or inf: a rank correlation of those means "
                             "nothing; check the reward of the regenerated images")  # fmt: skip
        full = full.view_as(self.proxy_rewards)
        sp, kd = spearman(self.proxy_rewards.cpu(), full), kendall(self.proxy_rewards.cpu(), full)
        return {"spearman": sp.mean().item(), "kendall": kd.mean().item(), "per_prompt_spearman": sp.tolist(),
                "per_prompt_kendall": kd.tolist()}  # fmt: skip



@dataclass
class Exploring:
    """Previews sampled by `Explorer.start`, their rewards possibly in flight; `finish()` ranks them (Selection)."""

    explorer: Explorer
    prompts: list[str]
    seeds: list[list[int]]
    pending: Pending
    states: list[torch.Tensor] | None
    keep_samples: bool
    nonfinite: str

    def finish(self) -> Selection:
        return self.explorer._rank(self)

class Explorer:
    """Sol-RL's explore-and-select for any trainer: explore N seeds per prompt cheaply in the explore
    precision at `preview_steps`, keep the top K/2 and bottom K/2 by `reward`, hand back their seeds
    and initial noise so the caller's own sampler (ODE or SDE, with its own log-probs) regenerates
    exactly those.

        explorer = Explorer(pipe, reward, n=96, k=24, preview_steps=6)   # a stock diffusers pipeline
        sel = explorer.select(prompts)                                    # sel.seeds, sel.noise, ...
        ... your update of pipe.transformer ...
        explorer.sync_(pipe.transformer)                                  # the explore copy follows

    The quantized copy is built once from the pipeline's transformer with the family's layer rule
    (`quantize` overrides it: QuantRecipe changes such as {"include": (...)} or {"rht": 16,
    "four_over_six": True}, and {"attention": "fp8"}: the copy's attention on FP8 q, k, v); the caller's
    pipeline is never changed. `reward` is any
    `(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]`; a video pipeline (WanPipeline) hands it videos
    [B, F, 3, H, W] (solrl_engine.rewards' WeightedReward scores image rewards on frames of them), and takes
    `frames` and `width` (`resolution` is then the height; None: the pipeline's defaults). A two-expert pipeline
    (Wan2.2-A14B) takes `guidance_scale_2`, its low-noise expert's guidance, as WanPipeline does.
    """

    def __init__(
        self,
        pipeline_or_model: Any,
        reward: RewardFn,
        n: int = 96,
        k: int = 24,
        preview_steps: int = 6,
        explore_precision: str = "auto",
        quantize: dict[str, Any] | None = None,
        resolution: int | None = None,
        solver: str = "dpm2",
        guidance_scale: float | None = None,
        batch_size: int = 96,
        seed: int = 0,
        frames: int | None = None,
        width: int | None = None,
        guidance_scale_2: float | None = None,
    ) -> None:
        video = {k: v for k, v in (("frames", frames), ("width", width)) if v is not None}
        model, name = wrap_pipeline(pipeline_or_model, resolution=resolution, guidance_scale=guidance_scale, **video)
        settings = ExploreSettings.from_quantize(explore_precision, quantize)
        _check_args(n, k, preview_steps, solver, guidance_scale, batch_size, settings)
        spec_m = model_spec(name)
        how = RolloutSettings(full_steps=max(preview_steps, 10), solver=solver, guidance_scale=guidance_scale,
                              guidance_scale_2=guidance_scale_2, batch_size=batch_size,
                              reward_name=getattr(reward, "__name__", "reward"))  # fmt: skip
        ro = Rollouts(model, spec_m, reward, how)
        spec = None
        if explore_precision != "bf16":  # bf16: the caller's policy explores, no copy
            spec = plan(settings, spec_m, ro.device, ro.dtype, model.transformer, autocast=ro.autocast,
                        rows=ro.forward_rows)  # fmt: skip
        self._init(ro, ExploreCopy.from_spec(model.transformer, spec), spec, n, k, preview_steps,
                   random.Random(seed))  # fmt: skip
        self.resolution = resolution or getattr(model, "resolution", None)

    def _init(self, ro: Rollouts, copy: ExploreCopy | None, spec: ExploreSpec | None, n: int, k: int, steps: int,
              rng: Any, tag: str = "explore") -> None:  # fmt: skip
        self.rollouts, self.model, self.reward = ro, ro.model, ro.reward
        self.n, self.k, self.steps, self.rng, self.tag = n, k, steps, rng, tag
        self.copy, self.spec = copy, spec
        self.transformer = copy.transformer if copy is not None else None
        self.bound = speed_bound(ro, copy, spec) if copy is not None and spec is not None else None
        if self.bound is not None:
            log.info("explore copy: %s", self.bound["line"])
        if copy is not None and spec is not None and not copy.report.quantized and spec.precision != "bf16":
            log.warning("the explore copy quantizes no layer of %s under its rule (%s): exploration runs at full "
                        "precision; see quantization.txt in the run directory for why each layer was kept",
                        ro.spec.name, dict(spec.rule))  # fmt: skip
        self.fast_path: Any = None  # nn.FastPathRecord of the last select's quantized layers (None: none ran)
        self._reported = False

    @classmethod
    def from_rollouts(cls, ro: Rollouts, copy: ExploreCopy | None, spec: ExploreSpec | None, n: int, k: int,
                      steps: int, rng: Any) -> Explorer:  # fmt: skip
        """The trainer's explorer over its Rollouts: exploring with `copy` (built from `spec`), or, where
        there is none, with the policy itself (its active adapter) at `steps`."""
        self = cls.__new__(cls)
        self._init(ro, copy, spec, n, k, steps, rng, tag="explore" if copy is not None else "old")
        self.resolution = getattr(ro.model, "resolution", None)
        return self

    @property
    def recipe_label(self) -> str:
        """What explores, for logs and summaries: the copy's recipe, or the policy itself."""
        if self.copy is not None:
            return self.copy.recipe
        return f"policy ({str(self.rollouts.dtype).removeprefix('torch.')})"

    @property
    def pipeline_guidance(self) -> float:
        """The guidance_scale a stock pipeline call needs to match this explorer's sampling."""
        return self.rollouts.pipeline_guidance

    def draw_seeds(self, prompts: Sequence[str]) -> list[list[int]]:
        return [[self.rng.randrange(2**31) for _ in range(self.n)] for _ in prompts]

    @torch.no_grad()
    def select(
        self,
        prompts: Sequence[str],
        seeds: Sequence[Sequence[int]] | None = None,
        cond: Conditioning | None = None,
        keep_samples: bool = False,
        nonfinite: str = "raise",
        window: tuple[int, int] | None = None,
        couple: Coupling | None = None,
    ) -> Selection:
        """Explore N seeds per prompt (given, or drawn from the explorer's seeded generator), score
        the previews, keep the most contrastive K. `keep_samples` keeps the selected previews'
        latents (for training on the quantized samples themselves, as naive_quant does). Non-finite
        preview rewards are never ranked: ValueError naming the prompts and seeds, or with
        `nonfinite="defer"` (a trainer with its own policy) the Selection keeps them unranked and says so
        in `nonfinite`. A `window` of steps explores with Flow-GRPO's SDE there (sampling.sde) and keeps the selected
        rollouts' states in `trace`, for an objective that trains on the explored rollouts themselves. `couple`: the
        previews sample Flow-GRPO's SDE on the Brownian path of the regeneration's (sampling.sde.coupled_noise)."""
        return self.start(prompts, seeds, cond, keep_samples, nonfinite, window, couple).finish()

    @torch.no_grad()
    def start(
        self,
        prompts: Sequence[str],
        seeds: Sequence[Sequence[int]] | None = None,
        cond: Conditioning | None = None,
        keep_samples: bool = False,
        nonfinite: str = "raise",
        window: tuple[int, int] | None = None,
        couple: Coupling | None = None,
    ) -> Exploring:
        """`select` in two halves: sample the previews now and return while the last ones may still be scored (a
        served reward: Rollouts.start_scored); `finish()` ranks them. Sampling something else in between hides
        the last batch's scoring."""
        prompts = _prompt_list(prompts)
        seeds = _seed_rows(seeds, len(prompts), self.n) if seeds is not None else self.draw_seeds(prompts)
        if nonfinite not in ("raise", "defer"):
            raise ValueError(f"Explorer.select: nonfinite = {nonfinite!r}: choose raise or defer")
        cond = self.rollouts.encode(prompts) if cond is None else cond
        flat = [s for row in seeds for s in row]
        per_seed = [p for p in prompts for _ in range(self.n)]
        states: list[torch.Tensor] | None = [] if window is not None else None
        pending = self.rollouts.start_scored(cond.repeat_interleave(self.n), per_seed, flat, self.steps,
                                             self.transformer, self.tag, window, states, couple)  # fmt: skip
        self._record_fast_path()
        return Exploring(self, prompts, seeds, pending, states, keep_samples, nonfinite)

    @torch.no_grad()
    def _rank(self, ex: Exploring) -> Selection:
        """Exploring.finish: wait for the previews' rewards and keep the most contrastive K per prompt."""
        prompts, seeds, nonfinite, states = ex.prompts, ex.seeds, ex.nonfinite, ex.states
        x, scored = ex.pending.result()
        r = scored.rewards.view(len(prompts), self.n)
        self.last_totals = r  # the reward itself (the weighted sum), before a group-normalised combination
        comps_pn = {k: v.view(len(prompts), self.n) for k, v in scored.components.items()}
        value = getattr(self.rollouts.reward, "group_value", None)  # several rewards normalised per group, if asked
        r = value(r, comps_pn).to(r.device) if value is not None else r
        bad = ~torch.isfinite(r)
        unranked = None
        if bool(bad.any()):
            rows = [(prompts[i], seeds[i][j]) for i, j in bad.nonzero().tolist()]
            unranked = (f"{len(rows)} of {r.numel()} preview rewards are NaN or inf (first: prompt {rows[0][0]!r} "
                        f"seed {rows[0][1]}{'' if len(rows) == 1 else f'; prompt {rows[1][0]!r} seed {rows[1][1]}'})")
            if nonfinite == "raise":
                raise ValueError(f"Explorer.select: {unranked}; nothing was ranked: the reward or the explore copy "
                                 "gives non-finite values (check the reward on these images)")  # fmt: skip
            idx = torch.arange(self.k, device=r.device).expand(len(prompts), self.k).clone()  # the caller decides
        else:
            idx = select_contrastive(r, self.k)
        ranks = torch.sort(r, dim=1, descending=True, stable=True).indices.argsort(dim=1).gather(1, idx)
        sel = [[row[i] for i in ix] for row, ix in zip(seeds, idx.tolist(), strict=True)]
        lat = seeded_noise([s for row in sel for s in row], tuple(self.model.latent_shape))
        noise = self.model.pipeline_latents(lat) if hasattr(self.model, "pipeline_latents") else lat
        samples = trace = None
        rows = torch.arange(len(prompts), device=idx.device)[:, None]
        if ex.keep_samples:
            samples = x.view(len(prompts), self.n, *x.shape[1:])[rows, idx].flatten(0, 1)
        if states is not None:
            xs = torch.cat(states)
            trace = xs.view(len(prompts), self.n, *xs.shape[1:])[rows.to(xs.device), idx.to(xs.device)].flatten(0, 1)
        self.last_components = comps_pn
        return Selection(prompts, sel, r.gather(1, idx), ranks, noise, seeds, r, idx, self, samples, unranked, trace)

    def _record_fast_path(self) -> None:
        """Read back which implementation each quantized layer ran (`self.fast_path`); the first
        explore says it in the log, e.g. "explore: 80/80 quantized layers on the fast path (...)"."""
        if self.transformer is None:
            return
        rec = fast_path(self.transformer)
        if not rec.layers:
            return
        self.fast_path = rec
        if not self._reported:
            (log.warning if rec.reference and self.rollouts.device.type == "cuda" else log.info)(
                "explore: %s", rec.summary())  # fmt: skip
            if self.copy is not None and self.copy.attention != "bf16":
                log.info("explore attention (%s): %s", self.copy.attention, self.copy.attention_ran())
            self._reported = True

    @torch.no_grad()
    def sync_(self, policy: Any) -> int:
        """Write the caller's updated weights into the explore copy, in place (no re-capture, no
        recompile): `policy` is the transformer (a PEFT LoRA on it is merged on the fly), a pipeline,
        or a state dict of the transformer's weights. Returns the number of quantized layers rewritten."""
        if self.transformer is None:
            return 0
        src = getattr(policy, "transformer", policy)
        return requantize_(self.transformer, source=src)


def _batches(prompts: list[str], size: int) -> list[tuple[int, int]]:
    """[i, j) ranges of at most `size` rows; rows of conditioned prompts are batched only with the same prompt's
    (a stock editing or image-to-video pipeline takes one image a call)."""
    out, i = [], 0
    while i < len(prompts):
        j = i + 1
        while j < len(prompts) and j - i < size and (not prompt_images(prompts[i]) or prompts[j] == prompts[i]):
            j += 1
        out.append((i, j))
        i = j
    return out
