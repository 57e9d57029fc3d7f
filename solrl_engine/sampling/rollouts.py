"""The one rollout path: a model, its schedule and guidance, a sampler and a reward.

The trainer, `solrl fidelity`, `solrl eval`, `solrl sample` and the Explorer sample and score through this
object, so the same weights get the same images and the same score everywhere (same solver, schedule,
guidance, decode and reward). It knows nothing of a training config: `rl.runtime.build_rollouts` makes one
from an RLConfig, the Explorer from a caller's pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from solrl_engine.hw import autocast_for
from solrl_engine.models import ModelSpec
from solrl_engine.models.base import Conditioning, FlowModel, RewardFn
from solrl_engine.models.experts import ExpertGuidance, expert_guidance
from solrl_engine.nn.flops import LinearFlops, count_linear_flops
from solrl_engine.sampling.compile import use_cache_dir
from solrl_engine.sampling.graphed import GraphedSampler
from solrl_engine.sampling.sampler import model_sigmas, sample
from solrl_engine.sampling.sde import Coupling

log = logging.getLogger("solrl_engine.sampling")


@dataclass(frozen=True)
class RolloutSettings:
    """How rollouts sample. `guidance_scale` None: the model family's. `compiled`: torch.compile the sampler
    (on a GPU also one CUDA graph per batch shape; None: on with CUDA, off on a CPU, where a cold compile
    costs more than a short run saves); `compile_regional` None: on with CUDA (see sampling.compile)."""

    full_steps: int = 10
    shift: float | None = None
    solver: str = "dpm2"
    sde_noise_level: float = 0.7  # Flow-GRPO's SDE (solver flow_sde, and an SDE objective's rollouts): its eta
    batch_size: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # a two-expert model's low-noise expert's (None: guidance_scale)
    compiled: bool | None = None
    compile_mode: str | None = None
    compile_regional: bool | None = None
    compile_cache_dir: str | None = None
    reward_name: str = "reward"  # how errors name the reward (the config's spec, or the caller's callable)


@dataclass
class Scored:
    """Images and their rewards (total and per component of a weighted reward)."""

    images: torch.Tensor
    rewards: torch.Tensor
    components: dict[str, torch.Tensor]

    @classmethod
    def join(cls, parts: Sequence[Scored]) -> Scored:
        """Consecutive batches' scores as one."""
        comps = {k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components}
        return cls(torch.cat([p.images for p in parts]), torch.cat([p.rewards for p in parts]), comps)


class Pending:
    """Latents sampled by `Rollouts.start_scored` whose scores may still be in flight; `result()` waits for them and
    records the reward seconds hidden behind sampling and exposed (waited for) in `reward_time`, its own and the
    rollouts' (the last result's)."""

    def __init__(self, rollouts: Rollouts, x0: torch.Tensor | None, prompts: list[str]) -> None:
        self.rollouts, self.x0, self.prompts = rollouts, x0, prompts
        self.futures: list[Future[Scored]] = []  # one per sampled batch, where scoring overlaps
        self.spent: list[float] = []  # each scored batch's seconds (decode and reward)
        self.reward_time = {"hidden_s": 0.0, "exposed_s": 0.0}

    def score(self, x: torch.Tensor, prompts: Sequence[str]) -> Scored:
        """Score one batch (on the scoring thread), timed."""
        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # grad mode is per thread
                return self.rollouts.score(x, prompts)
        finally:
            self.spent.append(time.perf_counter() - t0)

    def result(self) -> tuple[torch.Tensor, Scored]:
        """(latents, their images and rewards): waits for the scores (scoring them now where nothing overlaps)."""
        assert self.x0 is not None
        t = time.perf_counter()
        if not self.futures:
            scored = self.rollouts.score(self.x0, self.prompts)
            self.reward_time = {"hidden_s": 0.0, "exposed_s": time.perf_counter() - t}
        else:
            try:
                scored = Scored.join([f.result() for f in self.futures])  # a reward's error surfaces here
            except BaseException:
                self.rollouts.drop_queued()
                raise
            exposed = time.perf_counter() - t
            self.reward_time = {"hidden_s": max(0.0, sum(self.spent) - exposed), "exposed_s": exposed}
        self.rollouts.reward_time = dict(self.reward_time)
        return self.x0, scored


def model_guidance(spec: ModelSpec, guidance_scale: float | None) -> float:
    """The guidance scale rollouts use: the given one, else the model's own default."""
    return float(spec.guidance_scale if guidance_scale is None else guidance_scale)


def compiled_sampling(spec: ModelSpec, device: torch.device, compiled: bool | None,
                      transformer: torch.nn.Module | None = None) -> bool:  # fmt: skip
    """Whether rollouts sample through the compiled sampler (`compiled` None: on with CUDA): on a GPU that is one
    captured CUDA graph per batch shape, which a model whose forward reads values on the host cannot be
    (`spec.capturable`, or a denoiser's own `capturable`: two experts switched by the timestep): it samples eagerly
    there, and the log says why."""
    cuda = device.type == "cuda"
    graphed = compiled if compiled is not None else cuda
    if graphed and device.type not in ("cuda", "cpu"):
        log.info("compiled sampler: needs a CUDA device or the CPU; sampling eagerly on %s.", device.type)
    if graphed and cuda and not (spec.capturable and getattr(transformer, "capturable", True)):
        log.info("compiled sampler: %s's forward reads values on the host, which a captured CUDA graph would "
                 "freeze; sampling eagerly.", spec.name)  # fmt: skip
        return False
    return graphed


class Rollouts:
    """A model (on its device, in its dtype), its family's spec, a reward and how to sample: see the module
    docstring."""

    reward_time: dict[str, float] = {"hidden_s": 0.0, "exposed_s": 0.0}  # the last sample_scored's reward seconds

    def __init__(self, model: FlowModel, spec: ModelSpec, reward: RewardFn, settings: RolloutSettings) -> None:
        self.model, self.spec, self.reward, self.settings = model, spec, reward, settings
        p = next(model.transformer.parameters())
        # the model's device (a pipeline model's own: a staged start-up's transformer is still on the CPU until
        # sharding moves it, rl/sharding.py), else its transformer's
        dev = getattr(model, "device_", None)
        self.device, self.dtype = (torch.device(dev) if dev is not None else p.device), p.dtype
        self.cfg_guidance = model_guidance(spec, settings.guidance_scale) if spec.guidance == "cfg" else 1.0
        if settings.guidance_scale_2 is not None and spec.guidance == "cfg":  # each expert its own (ExpertGuidance)
            self.cfg_guidance = expert_guidance(model, self.cfg_guidance, settings.guidance_scale_2)
        self._uncond: Conditioning | None = None
        self._pool: ThreadPoolExecutor | None = None  # the scoring thread of a served reward (start_scored)
        self.autocast_cache = True  # False: no cached BF16 casts of trainable weights (sharded full fine-tuning)
        # compiled: on GPU + one CUDA graph per batch shape, on CPU through inductor (no graphs); both read
        # the weights in place, so updates need no re-capture or recompile
        cuda = self.device.type == "cuda"
        graphed = compiled_sampling(spec, self.device, settings.compiled, model.transformer)
        if graphed:
            use_cache_dir(settings.compile_cache_dir)
        regional = settings.compile_regional if settings.compile_regional is not None else cuda
        self.sampler = GraphedSampler(self.model, enabled=graphed and self.device.type in ("cuda", "cpu"),
                                      cpu_compile=graphed, mode=settings.compile_mode, regional=regional,
                                      blocks=self.spec.repeated_blocks)  # fmt: skip

    @property
    def pipeline_guidance(self) -> float:
        """The guidance_scale a stock pipeline call needs to match this sampling."""
        if self.spec.guidance == "embedded":
            return model_guidance(self.spec, self.settings.guidance_scale)
        return self.cfg_guidance - self.spec.pipeline_guidance_offset

    @property
    def pipeline_guidance_2(self) -> float | None:
        """The guidance_scale_2 (a two-expert pipeline's low-noise expert's) a stock pipeline call needs, where the
        experts are guided apart; else None."""
        g = self.cfg_guidance
        return g.low - self.spec.pipeline_guidance_offset if isinstance(g, ExpertGuidance) else None

    @property
    def forward_rows(self) -> int | None:
        """Token rows one batched forward of the denoiser's linear layers sees while exploring: the rollout batch
        x the model's image tokens per sample (`tokens_per_sample`; guidance's two passes run in turn, not
        batched), None where the model or the batch size does not say. An upper bound where a rank has fewer
        seeds than a batch. explore_precision=auto times its candidates at this size: at a tenth of it, launch
        overhead hid the GEMMs and FP8 timed slower than BF16 on an H200."""
        tokens = getattr(self.model, "tokens_per_sample", None)
        if not tokens or not self.settings.batch_size:
            return None
        return int(tokens) * self.settings.batch_size

    def autocast(self) -> Any:
        """The rollouts' autocast (hw.autocast_for this device and policy dtype; `autocast_cache`)."""
        return autocast_for(self.device, self.dtype, cache=self.autocast_cache)

    # --- sampling -----------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        with torch.no_grad():
            return self.model.encode_prompts(list(prompts))

    def uncond(self) -> Conditioning | None:
        """The empty prompt's conditioning when classifier-free guidance is on, else None."""
        if self.cfg_guidance == 1.0:
            return None
        if self._uncond is None:  # as the family's pipeline encodes its negative prompt, where the model says how
            own = getattr(self.model, "encode_unconditional", None)
            self._uncond = own() if own is not None else self.encode([""])
        return self._uncond

    def sample(
        self,
        cond: Conditioning,
        seeds: Sequence[int],
        steps: int,
        transformer: nn.Module | None = None,
        tag: str = "",
        window: tuple[int, int] | None = None,
        trace: list[torch.Tensor] | None = None,
        couple: Coupling | None = None,
    ) -> torch.Tensor:
        """Final latents for (cond[i], seeds[i]) with the policy (its active adapter, named by `tag`
        for the graph cache) or another copy of the denoiser (the explore copy). A `window` of steps samples with
        Flow-GRPO's SDE there (Euler elsewhere) whatever the solver, and `trace` receives its states per batch:
        the rollouts an SDE objective trains on (sampling.sde). `couple`: Flow-GRPO's SDE whose noise is the
        Brownian path of the regeneration's (a preview coupled to its final: sampling.sde.coupled_noise)."""
        s = self.settings
        with self.autocast():
            return self.sampler.sample(
                cond,
                list(seeds),
                steps,
                shift=s.shift,
                solver=s.solver,
                batch_size=s.batch_size,
                dtype=self.dtype,
                transformer=transformer,
                tag=tag,
                guidance_scale=self.cfg_guidance,
                uncond=self.uncond(),
                noise_level=s.sde_noise_level,
                window=window,
                trace=trace,
                couple=couple,
            )

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, transformer: nn.Module | None = None,
                tag: str = "") -> torch.Tensor:  # fmt: skip
        """Velocities at rows (x[i], t[i], cond[i]) of the policy (its active adapter, named by `tag`) or another
        copy of the denoiser, under the rollouts' autocast, at their batch size and through their sampler's
        compiled (GPU: graph-captured) path; no gradient. In the denoiser's output dtype."""
        with self.autocast():
            return self.sampler.predict(x, t, cond, batch_size=self.settings.batch_size, transformer=transformer,
                                        tag=tag)  # fmt: skip

    def training_sigmas(self) -> torch.Tensor:
        """The rollout's flow times t in (0, 1] at the full step budget: where the loss is taken."""
        return model_sigmas(self.model, self.settings.full_steps, self.settings.shift)[:-1]

    def linear_flops(self, transformer: nn.Module) -> LinearFlops:
        """Linear FLOPs of `transformer` (an explore copy, or the policy) per denoising step, by formats,
        counted on one eager step of one sample (the shares do not depend on the batch)."""
        probe = getattr(self.model, "probe_prompt", None)  # a conditioned model's: an instruction with its image
        cond, s = self.encode([probe() if probe is not None else "a"]), self.settings

        def step() -> None:  # eager: a replayed CUDA graph would run no hooks
            with autocast_for(self.device):
                sample(self.model, cond, [0], 1, s.shift, s.solver, 1.0, None, 1, self.dtype, transformer)

        return count_linear_flops(transformer, step)

    # --- scoring ------------------------------------------------------------------------------------

    def score(self, x0: torch.Tensor, prompts: Sequence[str]) -> Scored:
        """Decode and score; rewards are checked (shape [B], finite dtype) and land on the device."""
        images = self.model.decode(x0)
        r = self.reward(images, list(prompts))
        if not isinstance(r, torch.Tensor) or r.shape != (len(prompts),) or not r.is_floating_point():
            got = f"{type(r).__name__} {tuple(r.shape)} {r.dtype}" if isinstance(r, torch.Tensor) else type(r).__name__
            raise TypeError(f"reward {self.settings.reward_name!r} returned {got}; it must return a float "
                            f"Tensor[{len(prompts)}]")  # fmt: skip
        comps = getattr(self.reward, "last_components", None) or {"reward": r.detach()}
        return Scored(images, r.float().to(self.device), {k: v.float().cpu() for k, v in comps.items()})

    @property
    def overlaps(self) -> bool:
        """Whether scoring overlaps sampling: a reward scored by a server (rewards.remote) waits on the network, so
        batch i is scored on a worker thread while batch i+1 is sampled. An in-process reward shares the sampler's
        device and cores, and is scored after the sampling, as before."""
        return any(getattr(fn, "remote", False) for _, _, fn in getattr(self.reward, "parts", ()))

    def sample_scored(self, cond: Conditioning, prompts: Sequence[str], seeds: Sequence[int], steps: int,
                      transformer: nn.Module | None = None, tag: str = "", window: tuple[int, int] | None = None,
                      trace: list[torch.Tensor] | None = None, couple: Coupling | None = None
                      ) -> tuple[torch.Tensor, Scored]:  # fmt: skip
        """(final latents, their images and rewards) for (cond[i], prompts[i], seeds[i]): `sample` then `score`,
        the same latents and rewards; where scoring `overlaps`, batch by batch (the sampler's batch size), each
        batch scored on a worker thread while the next is sampled. `reward_time` keeps this call's reward seconds:
        hidden behind sampling and exposed (waited for after it). `window`, `trace` and `couple`: as `sample`'s."""
        return self.start_scored(cond, prompts, seeds, steps, transformer, tag, window, trace, couple).result()

    def drop_queued(self) -> None:
        """Cancel the batches still waiting for the scoring thread (a reward failed: the run stops)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def start_scored(self, cond: Conditioning, prompts: Sequence[str], seeds: Sequence[int], steps: int,
                     transformer: nn.Module | None = None, tag: str = "", window: tuple[int, int] | None = None,
                     trace: list[torch.Tensor] | None = None, couple: Coupling | None = None) -> Pending:  # fmt: skip
        """`sample_scored` in two halves: sample every batch now (where scoring `overlaps`, each batch goes to the
        scoring thread as soon as it is sampled) and return before the last scores arrive; `Pending.result()`
        waits for them. Work the caller does in between (sampling the next phase) hides the last batch's scoring.
        Batches are scored in the order they were sampled, across calls (one scoring thread)."""
        if not self.overlaps:
            x0 = self.sample(cond, seeds, steps, transformer, tag, window, trace, couple)
            return Pending(self, x0, list(prompts))
        b = max(1, self.settings.batch_size or len(seeds))
        pending = Pending(self, None, list(prompts))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="solrl-reward")
        xs = []
        for i in range(0, len(seeds), b):
            xs.append(self.sample(cond[i : i + b], seeds[i : i + b], steps, transformer, tag, window, trace, couple))
            pending.futures.append(self._pool.submit(pending.score, xs[-1], list(prompts[i : i + b])))
        pending.x0 = torch.cat(xs)
        return pending

    def generate(
        self, prompts: Sequence[str], seeds: Sequence[int], steps: int | None = None, tag: str = ""
    ) -> Scored:
        """Images and rewards for (prompts[i], seeds[i]) with the policy as it is (its active adapter)."""
        return self.sample_scored(self.encode(prompts), prompts, seeds, steps or self.settings.full_steps, tag=tag)[1]
