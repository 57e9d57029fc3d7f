"""The one rollout path: a model, its schedule and guidance, a sampler, a reward, and optionally the
quantized explore copy, all built from one RLConfig.

The trainer, `solrl fidelity`, `solrl eval` and `solrl sample` sample and score through this object,
so the same weights get the same images and the same score everywhere (same solver, schedule,
guidance, decode and reward).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from solrl_engine.models import ModelSpec, load_model, model_spec
from solrl_engine.models.base import Conditioning, FlowModel
from solrl_engine.quant.recipe import RECIPES, get_recipe
from solrl_engine.rewards import RewardFn, check_reward, load_reward, parse_reward_args
from solrl_engine.rl.config import RLConfig, autocast_for, resolve_policy_dtype, resolve_runtime
from solrl_engine.sampling import GraphedSampler

log = logging.getLogger("solrl_engine.rollout")


def explore_rule(cfg: RLConfig, spec: ModelSpec, precision: str | None = None) -> dict[str, Any]:
    """The explore copy's layer rule: the model family's (the paper's choice), widened for a format
    that allows it (`spec.explore_rule_by_format`, e.g. INT8 on every eligible layer), each part
    overridable from the config (explore_layers, explore_skip, explore_skip_max_dim)."""
    rule = dict(spec.explore_rule)
    if precision is not None and precision in RECIPES:
        rule.update(spec.explore_rule_by_format.get(get_recipe(precision).format, {}))
    if cfg.explore_layers is not None:
        rule["include"] = tuple(cfg.explore_layers)
    if cfg.explore_skip is not None:
        rule["extra_skip"] = tuple(cfg.explore_skip)
    if cfg.explore_skip_max_dim is not None:
        rule["skip_max_dim"] = cfg.explore_skip_max_dim
    for field in ("rht", "four_over_six", "lowrank"):  # NVFP4 recipe options (QuantRecipe fields)
        if getattr(cfg, f"explore_{field}"):
            rule[field] = getattr(cfg, f"explore_{field}")
    return rule


@dataclass
class Scored:
    """Images and their rewards (total and per component of a weighted reward)."""

    images: torch.Tensor
    rewards: torch.Tensor
    components: dict[str, torch.Tensor]


class Rollouts:
    """Build once from a config; see the module docstring."""

    def __init__(
        self,
        cfg: RLConfig,
        explore: bool = False,
        model: FlowModel | None = None,
        reward: RewardFn | None = None,
        dist: Any = None,
        merged_rollouts: bool = False,
    ) -> None:
        """`model` and `reward` given: use those (a caller's pipeline, wrapped; any reward callable)
        instead of loading what the config names. `dist` (rl.distributed.Dist): under torchrun every
        rank takes rank 0's timed explore_precision choice. `merged_rollouts` (the trainer's, with
        merge_lora): also build `policy_copy`, the policy at its own precision with the "old" LoRA merged,
        through which full-precision rollouts run (like-for-like with the merged quantized copy)."""
        self.cfg = cfg
        self.spec = model_spec(cfg.model)
        self.reward_args = parse_reward_args(cfg.reward_args)
        if reward is None:
            check_reward(cfg.reward, self.reward_args)  # a missing weight fails here, before any model loads
        if model is None:
            self.device, self.dtype = resolve_runtime(cfg)
            log.info("policy dtype %s: %s", str(self.dtype).removeprefix("torch."),
                     resolve_policy_dtype(cfg, self.device)[1])  # fmt: skip
            model = load_model(
                cfg.model,
                cfg.model_path,
                self.device,
                self.dtype,
                resolution=cfg.resolution,
                offload_text_encoders=cfg.offload_text_encoders,
                decode_batch_size=cfg.decode_batch_size,
                guidance_scale=self._guidance() if self.spec.guidance == "embedded" else None,
            )
            model.requires_grad_(False)
        else:
            p = next(model.transformer.parameters())
            self.device, self.dtype = p.device, p.dtype
        self.model = model
        self.reward = load_reward(cfg.reward, self.reward_args) if reward is None else reward
        self.policy_copy = None
        if merged_rollouts and cfg.merge_lora:
            from solrl_engine.rl.explore import POLICY, ExploreCopy

            self.policy_copy = ExploreCopy(self.model.transformer, POLICY)
        self.explore = None
        self.explore_choice = None  # the resolved explore_precision and its reason, when exploring quantized
        self.explore_bound: dict[str, Any] | None = None  # the copy's quantized FLOP share and speedup bound
        if explore:
            from solrl_engine.hw import resolve_explore_precision

            choice = resolve_explore_precision(
                cfg.explore_precision, self.device, self.dtype, self.model.transformer, explore_rule(cfg, self.spec),
                autocast=lambda: autocast_for(self.device, self.dtype),
            )  # fmt: skip
            if dist is not None:  # timings differ between ranks; the explore copy must not
                choice = dist.broadcast_object(choice)
            self.build_explore(choice)
        self.cfg_guidance = self._guidance() if self.spec.guidance == "cfg" else 1.0
        self._uncond: Conditioning | None = None
        # `compile` (and compiled_sampler) sample through torch.compile: on GPU + one CUDA graph per
        # batch shape, on CPU through inductor (no graphs); both read the weights in place, so
        # updates need no re-capture or recompile.
        from solrl_engine.rl.config import FAMILY_TABLE

        want = cfg.compiled_sampler if cfg.compiled_sampler is not None else self.device.type == "cuda"
        graphed = FAMILY_TABLE[cfg.family].compiled or want
        if graphed and self.device.type not in ("cuda", "cpu"):
            log.info("compiled sampler: needs a CUDA device or the CPU; sampling eagerly on %s.", self.device.type)
        if graphed:
            from solrl_engine.sampling.compile import use_cache_dir

            use_cache_dir(cfg.compile_cache_dir)
        regional = cfg.compile_regional if cfg.compile_regional is not None else self.device.type == "cuda"
        self.sampler = GraphedSampler(self.model, enabled=graphed and self.device.type in ("cuda", "cpu"),
                                      cpu_compile=graphed, mode=cfg.compile_mode, regional=regional,
                                      blocks=self.spec.repeated_blocks)  # fmt: skip

    def build_explore(self, choice: Any) -> None:
        """Explore as `choice` (an hw.ExploreChoice) says: a quantized copy of the policy's transformer
        in its precision, or, for hw.POLICY, no copy (the policy explores itself: one model in memory,
        nothing to refresh). Built before the LoRA is attached, or again on resume (the checkpoint's
        choice), when a copy of the adapted transformer starts from the adapted weights."""
        from solrl_engine.hw import POLICY
        from solrl_engine.rl.explore import ExploreCopy

        cfg, rule = self.cfg, explore_rule(self.cfg, self.spec, choice.precision)
        self.explore_choice, recipe = choice, choice.precision
        log.info("explore precision %s: %s", recipe, choice.reason)
        nvfp4_only = [k for k in ("rht", "four_over_six", "lowrank") if k in rule]
        if recipe != POLICY and nvfp4_only and get_recipe(recipe).format != "nvfp4":  # auto chose another format
            log.warning("explore_precision=auto chose %s on this device: %s apply to NVFP4 only and are "
                        "not used", recipe, ", ".join(f"explore_{k}" for k in nvfp4_only))  # fmt: skip
            for k in nvfp4_only:
                rule.pop(k)
        self.explore = None if recipe == POLICY else ExploreCopy(self.model.transformer, recipe, changes=rule)
        self.explore_bound = self._speed_bound(choice) if self.explore is not None else None
        if self.explore_bound is not None:
            log.info("explore copy: %s", self.explore_bound["line"])
        if self.explore is not None and not self.explore.report.quantized and recipe != "bf16":
            log.warning(
                "the explore copy quantizes no layer of %s under its rule (%s): exploration runs at full "
                "precision; see quantization.txt in the run directory for why each layer was kept",
                cfg.model, explore_rule(cfg, self.spec),
            )

    # what one quantized GEMM gains over BF16 on the tensor cores of the hardware plan (peak-rate ratios),
    # used for the bound where explore_precision was set rather than timed
    NOMINAL_GEMM_SPEEDUP = {"fp8": 2.0, "int8": 2.0, "nvfp4": 4.0}

    def _speed_bound(self, choice: Any) -> dict[str, Any] | None:
        """The explore copy's quantized share of the denoiser's GEMM FLOPs (one eager step, batch 1) and
        the Amdahl bound it puts on the explore forward's speedup at the GEMM rate ratio: measured at
        start where auto timed it, else the tensor cores' nominal ratio on a GPU (none on a CPU)."""
        from solrl_engine.nn.flops import amdahl_bound
        from solrl_engine.rl.fidelity import linear_flops

        copy = self.explore
        if copy is None or copy.te or not copy.report.quantized:
            return None
        share = linear_flops(self, copy.transformer).quantized_share()
        fmt = copy.quant_recipe.format
        t = choice.timings_ms
        if t.get("policy") and t.get(choice.precision):
            rate, how = t["policy"] / t[choice.precision], "measured at start"
        elif self.device.type == "cuda" and fmt in self.NOMINAL_GEMM_SPEEDUP:
            rate, how = self.NOMINAL_GEMM_SPEEDUP[fmt], "the tensor cores' nominal ratio"
        else:
            line = f"{share:.0%} of the denoiser's GEMM FLOPs in {copy.recipe} (no GEMM timing to bound the speedup)"
            return {"quantized_flop_share": share, "gemm_speedup": None, "bound": None, "line": line}
        bound = amdahl_bound(share, rate)
        line = (f"{share:.0%} of the denoiser's GEMM FLOPs in {copy.recipe}: at most {bound:.2f}x per forward at "
                f"{rate:.2f}x per GEMM ({how})")  # fmt: skip
        return {"quantized_flop_share": share, "gemm_speedup": rate, "bound": bound, "line": line}

    @property
    def rollout_form(self) -> str:
        """How the "old" adapter is applied where the policy samples at full precision: "merged" (a copy
        with the LoRA merged, as the quantized copy has it) or "unmerged" (PEFT's LoRA branches)."""
        return "merged" if self.policy_copy is not None else "unmerged"

    @property
    def explore_recipe(self) -> str:
        """What explores, for logs and summaries: the explore copy's recipe, or the policy itself."""
        if self.explore is not None:
            return self.explore.recipe
        return f"policy ({str(self.dtype).removeprefix('torch.')})"

    def _guidance(self) -> float:
        gs = self.cfg.guidance_scale
        return float(self.spec.guidance_scale if gs is None else gs)

    # --- sampling -----------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        with torch.no_grad():
            return self.model.encode_prompts(list(prompts))

    def uncond(self) -> Conditioning | None:
        """The empty prompt's conditioning when classifier-free guidance is on, else None."""
        if self.cfg_guidance == 1.0:
            return None
        if self._uncond is None:
            self._uncond = self.encode([""])
        return self._uncond

    def sample(
        self,
        cond: Conditioning,
        seeds: Sequence[int],
        steps: int,
        transformer: nn.Module | None = None,
        tag: str = "",
    ) -> torch.Tensor:
        """Final latents for (cond[i], seeds[i]) with the policy (its active adapter, named by `tag`
        for the graph cache) or another copy of the denoiser (the explore copy)."""
        c = self.cfg
        with autocast_for(self.device, self.dtype):
            return self.sampler.sample(
                cond,
                list(seeds),
                steps,
                shift=c.shift,
                solver=c.solver,
                batch_size=c.rollout_batch_size,
                dtype=self.dtype,
                transformer=transformer,
                tag=tag,
                guidance_scale=self.cfg_guidance,
                uncond=self.uncond(),
            )

    def training_sigmas(self) -> torch.Tensor:
        """The rollout's flow times t in (0, 1] at the full step budget: where the loss is taken."""
        from solrl_engine.sampling.sampler import model_sigmas

        return model_sigmas(self.model, self.cfg.full_steps, self.cfg.shift)[:-1]

    # --- scoring ------------------------------------------------------------------------------------

    def score(self, x0: torch.Tensor, prompts: Sequence[str]) -> Scored:
        """Decode and score; rewards are checked (shape [B], finite dtype) and land on the device."""
        images = self.model.decode(x0)
        r = self.reward(images, list(prompts))
        if not isinstance(r, torch.Tensor) or r.shape != (len(prompts),) or not r.is_floating_point():
            got = f"{type(r).__name__} {tuple(r.shape)} {r.dtype}" if isinstance(r, torch.Tensor) else type(r).__name__
            raise TypeError(f"reward {self.cfg.reward!r} returned {got}; it must return a float Tensor[{len(prompts)}]")
        comps = getattr(self.reward, "last_components", None) or {"reward": r.detach()}
        return Scored(images, r.float().to(self.device), {k: v.float().cpu() for k, v in comps.items()})

    def generate(
        self, prompts: Sequence[str], seeds: Sequence[int], steps: int | None = None, tag: str = ""
    ) -> Scored:
        """Images and rewards for (prompts[i], seeds[i]) with the policy as it is (its active adapter)."""
        x0 = self.sample(self.encode(prompts), seeds, steps or self.cfg.full_steps, tag=tag)
        return self.score(x0, prompts)


# --- the drop-in explorer: Sol-RL's explore -> select as a library call ------------------------------


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
        train on ODE samples (DiffusionNFT-style)."""
        import inspect

        ex = self.explorer
        if ex is None:
            raise ValueError("this Selection has no explorer to take the resolution and reward from")
        kw: dict[str, Any] = {"num_inference_steps": steps, "output_type": "pt", "height": ex.resolution,
                              "width": ex.resolution, "guidance_scale": ex.pipeline_guidance}  # fmt: skip
        if "use_resolution_binning" in inspect.signature(type(pipe).__call__).parameters:
            kw["use_resolution_binning"] = False
        kw.update(call_kwargs)
        prompts, images = self.flat_prompts, []
        for i in range(0, len(prompts), batch_size):
            noise = self.noise[i : i + batch_size]
            dtype = next(pipe.transformer.parameters()).dtype
            out = pipe(prompt=prompts[i : i + batch_size], latents=noise.to(dtype), **kw)
            images.append(out.images.float().cpu())
        imgs = torch.cat(images)
        r = ex.reward(imgs, prompts)
        return Regenerated(imgs, torch.as_tensor(r).float().cpu().view(len(self.prompts), -1))

    def fidelity(self, bf16_rewards: torch.Tensor) -> dict[str, Any]:
        """How faithfully the proxy ranked the selected seeds against the caller's full-precision
        rewards [P, K]: mean Spearman and Kendall over prompts (and per prompt)."""
        from solrl_engine.rl.ranking import kendall, spearman

        full = torch.as_tensor(bf16_rewards).float().cpu().view_as(self.proxy_rewards)
        sp, kd = spearman(self.proxy_rewards.cpu(), full), kendall(self.proxy_rewards.cpu(), full)
        return {"spearman": sp.mean().item(), "kendall": kd.mean().item(), "per_prompt_spearman": sp.tolist(),
                "per_prompt_kendall": kd.tolist()}  # fmt: skip


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
    "four_over_six": True}); the caller's pipeline is never changed. `reward` is any
    `(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]`.
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
    ) -> None:
        import random

        from solrl_engine.models import wrap_pipeline

        model, family = wrap_pipeline(pipeline_or_model, resolution=resolution, guidance_scale=guidance_scale)
        q = quantize or {}
        cfg = RLConfig(
            name="explorer", family="sol_rl", model=family, n=n, k=k, preview_steps=preview_steps,
            full_steps=max(preview_steps, 10), solver=solver, guidance_scale=guidance_scale,
            explore_precision=explore_precision, rollout_batch_size=batch_size,
            explore_layers=None if quantize is None else quantize.get("include"),
            explore_skip=None if quantize is None else quantize.get("extra_skip"),
            explore_skip_max_dim=None if quantize is None else quantize.get("skip_max_dim"),
            explore_rht=q.get("rht", 0), explore_four_over_six=q.get("four_over_six", False),
            explore_lowrank=q.get("lowrank", 0),
        ).validate()  # fmt: skip
        self.rollouts = Rollouts(cfg, explore=explore_precision != "bf16", model=model, reward=reward)
        self._init(self.rollouts, n, k, preview_steps, random.Random(seed))
        self.resolution = resolution or getattr(model, "resolution", None)

    def _init(self, ro: Rollouts, n: int, k: int, steps: int, rng: Any, tag: str = "explore") -> None:
        self.rollouts, self.model, self.reward = ro, ro.model, ro.reward
        self.n, self.k, self.steps, self.rng, self.tag = n, k, steps, rng, tag
        self.transformer = ro.explore.transformer if ro.explore is not None else None
        self.fast_path: Any = None  # nn.FastPathRecord of the last select's quantized layers (None: none ran)
        self._reported = False

    @classmethod
    def from_rollouts(cls, ro: Rollouts, n: int, k: int, steps: int, rng: Any, quantized: bool = True) -> Explorer:
        """The trainer's explorer: its Rollouts, exploring with the explore copy (`quantized`) or
        with the policy itself (its active adapter) at `steps`."""
        self = cls.__new__(cls)
        self._init(ro, n, k, steps, rng, tag="explore" if quantized else "old")
        if not quantized:
            self.transformer = None
        self.resolution = getattr(ro.model, "resolution", None)
        return self

    @property
    def pipeline_guidance(self) -> float:
        """The guidance_scale a stock pipeline call needs to match this explorer's sampling."""
        ro = self.rollouts
        return ro._guidance() if ro.spec.guidance == "embedded" else ro.cfg_guidance

    def draw_seeds(self, prompts: Sequence[str]) -> list[list[int]]:
        return [[self.rng.randrange(2**31) for _ in range(self.n)] for _ in prompts]

    @torch.no_grad()
    def select(
        self,
        prompts: Sequence[str],
        seeds: Sequence[Sequence[int]] | None = None,
        cond: Conditioning | None = None,
        keep_samples: bool = False,
    ) -> Selection:
        """Explore N seeds per prompt (given, or drawn from the explorer's seeded generator), score
        the previews, keep the most contrastive K. `keep_samples` keeps the selected previews'
        latents (for training on the quantized samples themselves, as naive_quant does)."""
        from solrl_engine.rl.ranking import select_contrastive
        from solrl_engine.sampling import seeded_noise

        prompts = list(prompts)
        seeds = [list(map(int, s)) for s in seeds] if seeds is not None else self.draw_seeds(prompts)
        if len(seeds) != len(prompts) or any(len(s) != self.n for s in seeds):
            raise ValueError(f"give {self.n} seeds for each of the {len(prompts)} prompts")
        cond = self.rollouts.encode(prompts) if cond is None else cond
        flat = [s for row in seeds for s in row]
        x = self.rollouts.sample(cond.repeat_interleave(self.n), flat, self.steps, self.transformer, self.tag)
        self._record_fast_path()
        scored = self.rollouts.score(x, [p for p in prompts for _ in range(self.n)])
        r = scored.rewards.view(len(prompts), self.n)
        idx = select_contrastive(r, self.k)
        ranks = torch.sort(r, dim=1, descending=True, stable=True).indices.argsort(dim=1).gather(1, idx)
        sel = [[row[i] for i in ix] for row, ix in zip(seeds, idx.tolist(), strict=True)]
        lat = seeded_noise([s for row in sel for s in row], tuple(self.model.latent_shape))
        noise = self.model.pipeline_latents(lat) if hasattr(self.model, "pipeline_latents") else lat
        samples = None
        if keep_samples:
            rows = torch.arange(len(prompts), device=idx.device)[:, None]
            samples = x.view(len(prompts), self.n, *x.shape[1:])[rows, idx].flatten(0, 1)
        self.last_components = {k: v.view(len(prompts), self.n) for k, v in scored.components.items()}
        return Selection(prompts, sel, r.gather(1, idx), ranks, noise, seeds, r, idx, self, samples)

    def _record_fast_path(self) -> None:
        """Read back which implementation each quantized layer ran (`self.fast_path`); the first
        explore says it in the log, e.g. "explore: 80/80 quantized layers on the fast path (...)"."""
        from solrl_engine.nn import fast_path

        if self.transformer is None:
            return
        rec = fast_path(self.transformer)
        if not rec.layers:
            return
        self.fast_path = rec
        if not self._reported:
            (log.warning if rec.reference and self.rollouts.device.type == "cuda" else log.info)(
                "explore: %s", rec.summary())  # fmt: skip
            self._reported = True

    @torch.no_grad()
    def sync_(self, policy: Any) -> int:
        """Write the caller's updated weights into the explore copy, in place (no re-capture, no
        recompile): `policy` is the transformer (a PEFT LoRA on it is merged on the fly), a pipeline,
        or a state dict of the transformer's weights. Returns the number of quantized layers rewritten."""
        from solrl_engine.nn import requantize_

        if self.transformer is None:
            return 0
        src = getattr(policy, "transformer", policy)
        return requantize_(self.transformer, source=src)
