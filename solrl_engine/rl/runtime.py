"""From a training config to the objects the layers below take. First `resolve(cfg, target) -> RunPlan`: the
run resolved once, before any weight loads, for the machine it runs on (or one `solrl plan` is told about): the
policy dtype, the update's sizes and settings, the rollouts' settings, the explore pass as it can resolve at start,
and the memory plan. Then the rollouts (model, reward, how to sample) and the explore pass (its settings ->
`explore.plan` -> an Explorer over the copy).

Why here: RLConfig is read in rl/ only. Everything under it (sampling.Rollouts, explore.plan, the Explorer)
takes plain values, so another trainer reaches them exactly as ours does; the trainer, `solrl plan` and the GPU
session read one RunPlan instead of re-deriving its parts.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from solrl_engine.explore.choice import ExploreChoice
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.explore.explorer import Explorer
from solrl_engine.explore.plan import ExploreSettings, ExploreSpec, device_problems, foresee, plan
from solrl_engine.kernels import device_capability
from solrl_engine.models import load_model, model_spec
from solrl_engine.rewards import check_reward, load_reward, parse_reward_args
from solrl_engine.rewards.remote import parse_reward_urls
from solrl_engine.rl import memplan
from solrl_engine.rl.config import FAMILY_TABLE, ConfigError, RLConfig, resolve_policy_dtype, resolve_runtime
from solrl_engine.rl.memplan import MemoryPlan
from solrl_engine.rl.objectives import settings_of
from solrl_engine.rl.sizing import NothingFits, UpdateSizes
from solrl_engine.sampling.rollouts import Rollouts, RolloutSettings, model_guidance

log = logging.getLogger("solrl_engine.rl")
Agree = Callable[[ExploreChoice], ExploreChoice]  # every rank takes one answer (Dist.broadcast_object)


@dataclass(frozen=True)
class Target:
    """The machine a run is resolved for: `device` (a CUDA device for a GPU, also one `solrl plan` is told about
    from a machine without it), its memory in GiB (None: a CPU, nothing to size against), its compute capability
    (None: not known; auto's explore is then planned over every GPU format) and the ranks of the job."""

    device: torch.device
    gpu_gib: float | None = None
    capability: tuple[int, int] | None = None
    world: int = 1

    @classmethod
    def here(cls, cfg: RLConfig, world: int = 1) -> Target:
        """This machine as the config's `device` picks it (a CUDA device that is not there is a ConfigError)."""
        device = resolve_runtime(cfg)[0]
        return cls(device, memplan.device_memory_gib(device), device_capability(device), world)

    @classmethod
    def gpu(cls, gib: float, world: int = 1, capability: tuple[int, int] | None = None) -> Target:
        """A GPU of `gib` GiB (and `capability`, where known), `world` of them, not necessarily this machine's."""
        return cls(torch.device("cuda"), gib, capability, world)

    def describe(self) -> str:
        """As a plan names it: "4 x 80 GiB GPUs (sm_90)", "this CPU"."""
        if self.gpu_gib is None:
            return "this CPU" if self.device.type == "cpu" else f"{self.device} (memory not known)"
        sm = f" (sm_{self.capability[0]}{self.capability[1]})" if self.capability else ""
        return f"{self.world} x {self.gpu_gib:g} GiB GPU{'s' if self.world > 1 else ''}{sm}"


@dataclass(frozen=True)
class RunPlan:
    """A run resolved once, before any weight loads, for one Target. `cfg` is the config with its auto sizes
    replaced by their values (what config.json and checkpoints record); `explore` every spec the explore pass can
    resolve to at start (one for a set precision; auto's candidates and the policy; empty where the family
    explores with the policy: its timing at start picks one, Trainer.explore_spec); `memory` the memory plan
    (None on a CPU, or where none could be made or none was asked for)."""

    cfg: RLConfig
    target: Target
    dtype: torch.dtype
    dtype_reason: str
    sizes: UpdateSizes
    rollouts: RolloutSettings
    update: Any  # the objective's settings (rl/objectives/: what its update reads of the config)
    explore: tuple[ExploreSpec, ...]
    memory: MemoryPlan | None

    def check(self) -> None:
        """Refuse, before any weight loads, a run whose memory plan does not fit its GPU (ConfigError with the plan
        and what to change); memory_check=false starts anyway, as does a run without a plan."""
        if self.memory is None or not self.cfg.memory_check:
            return
        if not self.memory.fits:
            raise ConfigError(f"config {self.cfg.name!r}: its memory plan does not fit this GPU "
                              f"({self.target.gpu_gib:.0f} GiB); change what it suggests, or set memory_check=false "
                              "to start anyway\n" + self.memory.render())  # fmt: skip
        log.info("memory plan: peak %.1f GiB (%s) of %.0f GiB", self.memory.peak_gib, self.memory.peak_phase,
                 self.target.gpu_gib)  # fmt: skip

    def lines(self) -> list[str]:
        """What was resolved, a line each (`solrl plan` prints them above the memory plan)."""
        dtype = str(self.dtype).removeprefix("torch.")
        if not self.explore:
            explore = f"the policy itself ({self.cfg.family} explores with it)"
        elif len(self.explore) == 1:
            explore = f"{self.explore[0].precision} ({self.explore[0].reason})"
        else:
            explore = f"one of {', '.join(e.precision for e in self.explore)} ({self.explore[0].reason})"
        split = ([f"  explore copy: split over the {self.target.world} GPUs (explore_sharding=shard: gathered block by "
                  "block, sampled eagerly)"] if self.cfg.explore_sharding == "shard" and self.explore else [])
        return [f"run plan for {self.cfg.name} on {self.target.describe()}",
                f"  policy dtype: {dtype} ({self.dtype_reason})",
                f"  update sizes: train_batch_size {self.sizes.train_batch_size}, gradient_checkpointing "
                f"{self.sizes.recompute} ({self.sizes.reason})",
                f"  explore: {explore}", *split]  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON values (`solrl plan --json`, the GPU session's records)."""
        t = self.target
        return {"config": self.cfg.name, "device": str(t.device), "gpu_gib": t.gpu_gib, "world": t.world,
                "capability": list(t.capability) if t.capability else None,
                "policy_dtype": str(self.dtype).removeprefix("torch."), "policy_dtype_reason": self.dtype_reason,
                "update_sizes": {"train_batch_size": self.sizes.train_batch_size,
                                 "gradient_checkpointing": self.sizes.recompute, "reason": self.sizes.reason},
                "explore": [{"precision": e.precision, "reason": e.reason} for e in self.explore],
                "memory": self.memory.to_dict() if self.memory is not None else None}  # fmt: skip


def resolve(cfg: RLConfig, target: Target | None = None, show: bool = False) -> RunPlan:
    """`cfg` resolved once for `target` (default: this machine, one rank), before any weight loads: the update's
    sizes (auto: from the GPU's memory plan; rl/sizing.py), the explore pass as it can resolve at start
    (explore.plan.foresee), and on a GPU the memory plan of what it resolved while memory_check is on (a plan that
    cannot be made is a warning, not a refusal). Raises ConfigError where not even the smallest update fits.
    `show`: a plan to look at (`solrl plan`): the memory plan is always made (its failure raised), and where nothing
    fits it shows the smallest update (one sample, every block recomputed) instead of refusing."""
    cfg = cfg.validate()
    target = target if target is not None else Target.here(cfg)
    if target.device.type == "cuda" and target.capability is not None and FAMILY_TABLE[cfg.family].quantized_explore:
        for name, why in device_problems(cfg.explore_settings(), target.capability):
            key = ExploreSettings.key(name)
            raise ConfigError(f"config {cfg.name!r}: {key} = {getattr(cfg, key)!r}: {why}")
    dtype, why = resolve_policy_dtype(cfg, target.device)
    gpu = target.device.type == "cuda"
    explore = (foresee(cfg.explore_settings(), model_spec(cfg.model), target.capability, gpu=gpu)
               if FAMILY_TABLE[cfg.family].quantized_explore else ())  # fmt: skip
    cfg = resolve_explore_sharding(cfg, target, explore)
    try:
        sizes = memplan.resolve_update_sizes(cfg, target.world, target.gpu_gib)
    except NothingFits as e:
        if not show:
            raise
        sizes = e.smallest()
    cfg = sizes.apply(cfg)
    mem = None
    if target.gpu_gib is not None and (show or cfg.memory_check):
        try:
            mem = memplan.memory_plan(cfg, target.world, target.gpu_gib, explore=explore, sizes=sizes)
        except Exception as e:  # noqa: BLE001 - advice, not a gate: a plan that fails must not stop a run that fits
            if show:
                raise
            log.warning("memory plan not made (%s: %s); starting without it", type(e).__name__, str(e)[:200])
    return RunPlan(cfg, target, dtype, why, sizes, rollout_settings(cfg), settings_of(cfg), explore, mem)


def resolve_explore_sharding(cfg: RLConfig, target: Target, explore: tuple[ExploreSpec, ...]) -> RLConfig:
    """explore_sharding=auto resolved for `target`: "shard" only where the run is sharded over several GPUs, explores
    through a quantized copy, and its memory plan does not fit with the copy whole but fits (or peaks lower) with it
    split; else "none" (a whole copy samples through captured graphs, a split one eagerly). A plan that cannot be
    made keeps it whole."""
    if cfg.explore_sharding != "auto":
        return cfg
    choice, why = "none", "the run is not sharded over several GPUs, or explores with the policy"
    if cfg.sharding != "none" and target.world > 1 and target.gpu_gib is not None and any(e.quantized
                                                                                          for e in explore):
        try:
            whole = memplan.memory_plan(dataclasses.replace(cfg, explore_sharding="none"), target.world,
                                        target.gpu_gib, explore=explore)  # fmt: skip
            split = None if whole.fits else memplan.memory_plan(dataclasses.replace(cfg, explore_sharding="shard"),
                                                                target.world, target.gpu_gib, explore=explore)
        except Exception as e:  # noqa: BLE001 - advice: a plan that cannot be made keeps the copy whole
            whole, split = None, None
            why = f"no memory plan ({type(e).__name__}: {str(e)[:120]}): kept whole"
        if whole is not None and whole.fits:
            why = f"the copy whole fits (peak {whole.peak_gib:.1f} GiB)"
        elif whole is not None and split is not None and split.peak_gib < whole.peak_gib:
            choice = "shard"
            why = f"peak {whole.peak_gib:.1f} GiB with the copy whole, {split.peak_gib:.1f} split over the GPUs"
    log.info("explore_sharding=auto: %s (%s)", choice, why)
    return dataclasses.replace(cfg, explore_sharding=choice)


def rollout_settings(cfg: RLConfig) -> RolloutSettings:
    """How the config's rollouts sample; its family may force the compiled sampler (the `compile` family)."""
    compiled = True if FAMILY_TABLE[cfg.family].compiled else cfg.compiled_sampler
    if cfg.context_parallel > 1:  # every attention a collective: sampled eagerly (no captured graphs)
        compiled = False
    return RolloutSettings(full_steps=cfg.full_steps, shift=cfg.shift, solver=cfg.solver,
                           sde_noise_level=cfg.sde_noise_level,
                           batch_size=cfg.rollout_batch_size, guidance_scale=cfg.guidance_scale,
                           guidance_scale_2=cfg.guidance_scale_2, compiled=compiled,
                           compile_mode=cfg.compile_mode, compile_regional=cfg.compile_regional,
                           compile_cache_dir=cfg.compile_cache_dir, reward_name=cfg.reward)  # fmt: skip


def staged(cfg: RLConfig, world: int) -> bool:
    """Whether a run's start-up is staged on the CPU: sharded over several ranks, each rank loads the base on the
    CPU, builds the explore copy on its device a layer at a time, and FSDP2 moves the policy to the device a block
    at a time as it shards it (rl/sharding.py), so no GPU holds the whole base."""
    return cfg.sharding != "none" and world > 1


def build_rollouts(cfg: RLConfig, run: RunPlan | None = None) -> Rollouts:
    """The config's model (on its device, in its policy dtype, frozen) and reward, behind one Rollouts: as `run`
    resolved them (the trainer's plan), else resolved here. A missing reward weight fails before any model loads."""
    spec = model_spec(cfg.model)
    reward_args = parse_reward_args(cfg.reward_args)
    urls = parse_reward_urls(cfg.reward_url)  # rewards scored by servers (rewards.remote)
    check_reward(cfg.reward, reward_args, urls, cfg.reward_wait_s)
    if run is None:
        device = resolve_runtime(cfg)[0]
        dtype, why = resolve_policy_dtype(cfg, device)
    else:
        device, dtype, why = run.target.device, run.dtype, run.dtype_reason
    log.info("policy dtype %s: %s", str(dtype).removeprefix("torch."), why)
    model = load_model(
        cfg.model,
        cfg.model_path,
        device,
        dtype,
        resolution=cfg.resolution,
        offload_text_encoders=cfg.offload_text_encoders,
        decode_batch_size=cfg.decode_batch_size,
        guidance_scale=model_guidance(spec, cfg.guidance_scale) if spec.guidance == "embedded" else None,
        **({"frames": cfg.frames, "width": cfg.width} if spec.video else {}),
        **({"lora_experts": cfg.lora_experts} if spec.two_experts else {}),
        # a sharded start-up: the transformer stays on the CPU until sharding moves it a block at a time
        **({"transformer_on_cpu": True} if run is not None and staged(cfg, run.target.world) else {}),
    )
    model.requires_grad_(False)
    reward = load_reward(cfg.reward, reward_args, urls, cfg.reward_wait_s)
    reward.frames, reward.frame_agg = cfg.reward_frames, cfg.reward_frame_agg  # what an image reward sees of a clip
    reward.combine = cfg.reward_combine  # how several rewards rank and train a prompt group
    return Rollouts(model, spec, reward, rollout_settings(cfg) if run is None else run.rollouts)


def plan_explore(cfg: RLConfig, ro: Rollouts, agree: Agree | None = None, choice: ExploreChoice | None = None,
                 measure: bool = True) -> ExploreSpec:  # fmt: skip
    """The config's explore pass resolved for the rollouts' model and device (explore.plan)."""
    return plan(cfg.explore_settings(), ro.spec, ro.device, ro.dtype, ro.model.transformer, autocast=ro.autocast,
                agree=agree, choice=choice, measure=measure, rows=ro.forward_rows)  # fmt: skip


def build_explorer(ro: Rollouts, spec: ExploreSpec | None, n: int, k: int, steps: int, rng: Any = None) -> Explorer:
    """An Explorer over the rollouts: with the copy `spec` asks for, or the policy itself (spec None, or
    POLICY). The copy is built from the rollouts' transformer as it is now. `rng` draws seeds when the
    caller gives none (the trainer always gives them)."""
    # no second whole copy at start; on the rollouts' device (a staged start-up's base is still on the CPU)
    copy = ExploreCopy.from_spec(ro.model.transformer, spec, borrow=True, device=ro.device)
    return Explorer.from_rollouts(ro, copy, spec, n, k, steps, rng)


def explorer_for(cfg: RLConfig, ro: Rollouts | None = None, agree: Agree | None = None,
                 choice: ExploreChoice | None = None) -> Explorer:  # fmt: skip
    """The config's explore pass over its rollouts (built when not given), as the trainer runs it: planned for
    the families that explore quantized (FAMILY_TABLE), at the family's step budget (preview or full steps);
    the other families explore with the policy itself."""
    ro = ro if ro is not None else build_rollouts(cfg)
    rule = FAMILY_TABLE[cfg.family]
    steps = cfg.preview_steps if rule.preview else cfg.full_steps
    spec = plan_explore(cfg, ro, agree=agree, choice=choice) if rule.quantized_explore else None
    return build_explorer(ro, spec, cfg.n, cfg.k, steps, random.Random(cfg.seed + 1))
