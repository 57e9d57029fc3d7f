"""From a training config to the objects the layers below take: the rollouts (device, policy dtype, model,
reward, how to sample) and the explore pass (its settings -> `explore.plan` -> an Explorer over the copy).

Why here: RLConfig is read in rl/ only. Everything under it (sampling.Rollouts, explore.plan, the Explorer)
takes plain values, so another trainer reaches them exactly as ours does.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from solrl_engine.explore.choice import ExploreChoice
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.explore.explorer import Explorer
from solrl_engine.explore.plan import ExploreSpec, plan
from solrl_engine.models import load_model, model_spec
from solrl_engine.rewards import check_reward, load_reward, parse_reward_args
from solrl_engine.rl.config import FAMILY_TABLE, RLConfig, resolve_policy_dtype, resolve_runtime
from solrl_engine.sampling.rollouts import Rollouts, RolloutSettings, model_guidance

log = logging.getLogger("solrl_engine.rl")
Agree = Callable[[ExploreChoice], ExploreChoice]  # every rank takes one answer (Dist.broadcast_object)


def rollout_settings(cfg: RLConfig) -> RolloutSettings:
    """How the config's rollouts sample; its family may force the compiled sampler (the `compile` family)."""
    compiled = True if FAMILY_TABLE[cfg.family].compiled else cfg.compiled_sampler
    return RolloutSettings(full_steps=cfg.full_steps, shift=cfg.shift, solver=cfg.solver,
                           batch_size=cfg.rollout_batch_size, guidance_scale=cfg.guidance_scale, compiled=compiled,
                           compile_mode=cfg.compile_mode, compile_regional=cfg.compile_regional,
                           compile_cache_dir=cfg.compile_cache_dir, reward_name=cfg.reward)  # fmt: skip


def build_rollouts(cfg: RLConfig) -> Rollouts:
    """The config's model (on its device, in its policy dtype, frozen) and reward, behind one Rollouts. A
    missing reward weight fails before any model loads."""
    spec = model_spec(cfg.model)
    reward_args = parse_reward_args(cfg.reward_args)
    check_reward(cfg.reward, reward_args)
    device, dtype = resolve_runtime(cfg)
    log.info("policy dtype %s: %s", str(dtype).removeprefix("torch."), resolve_policy_dtype(cfg, device)[1])
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
    )
    model.requires_grad_(False)
    reward = load_reward(cfg.reward, reward_args)
    reward.frames, reward.frame_agg = cfg.reward_frames, cfg.reward_frame_agg  # what an image reward sees of a clip
    return Rollouts(model, spec, reward, rollout_settings(cfg))


def plan_explore(cfg: RLConfig, ro: Rollouts, agree: Agree | None = None, choice: ExploreChoice | None = None,
                 measure: bool = True) -> ExploreSpec:  # fmt: skip
    """The config's explore pass resolved for the rollouts' model and device (explore.plan)."""
    return plan(cfg.explore_settings(), ro.spec, ro.device, ro.dtype, ro.model.transformer, autocast=ro.autocast,
                agree=agree, choice=choice, measure=measure, rows=ro.forward_rows)  # fmt: skip


def build_explorer(ro: Rollouts, spec: ExploreSpec | None, n: int, k: int, steps: int, rng: Any = None) -> Explorer:
    """An Explorer over the rollouts: with the copy `spec` asks for, or the policy itself (spec None, or
    POLICY). The copy is built from the rollouts' transformer as it is now. `rng` draws seeds when the
    caller gives none (the trainer always gives them)."""
    copy = ExploreCopy.from_spec(ro.model.transformer, spec, borrow=True)  # no second whole copy at start
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
