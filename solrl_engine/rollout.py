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
from solrl_engine.models.base import Conditioning
from solrl_engine.rewards import check_reward, load_reward, parse_reward_args
from solrl_engine.rl.config import RLConfig, autocast_for, resolve_runtime
from solrl_engine.sampling import GraphedSampler

log = logging.getLogger("solrl_engine.rollout")


def explore_rule(cfg: RLConfig, spec: ModelSpec) -> dict[str, Any]:
    """The explore copy's layer rule: the model family's (the paper's choice), each part
    overridable from the config (explore_layers, explore_skip, explore_skip_max_dim)."""
    rule = dict(spec.explore_rule)
    if cfg.explore_layers is not None:
        rule["include"] = tuple(cfg.explore_layers)
    if cfg.explore_skip is not None:
        rule["extra_skip"] = tuple(cfg.explore_skip)
    if cfg.explore_skip_max_dim is not None:
        rule["skip_max_dim"] = cfg.explore_skip_max_dim
    return rule


@dataclass
class Scored:
    """Images and their rewards (total and per component of a weighted reward)."""

    images: torch.Tensor
    rewards: torch.Tensor
    components: dict[str, torch.Tensor]


class Rollouts:
    """Build once from a config; see the module docstring."""

    def __init__(self, cfg: RLConfig, explore: bool = False) -> None:
        self.cfg = cfg
        self.spec = model_spec(cfg.model)
        self.reward_args = parse_reward_args(cfg.reward_args)
        check_reward(cfg.reward, self.reward_args)  # a missing weight fails here, before any model loads
        self.device, self.dtype = resolve_runtime(cfg)
        self.model = load_model(
            cfg.model,
            cfg.model_path,
            self.device,
            self.dtype,
            resolution=cfg.resolution,
            offload_text_encoders=cfg.offload_text_encoders,
            decode_batch_size=cfg.decode_batch_size,
            guidance_scale=self._guidance() if self.spec.guidance == "embedded" else None,
        )
        self.model.requires_grad_(False)
        self.reward = load_reward(cfg.reward, self.reward_args)
        self.explore = None
        if explore:
            from solrl_engine.rl.explore import ExploreCopy, resolve_explore_recipe

            recipe = resolve_explore_recipe(cfg.explore_precision, self.device)
            self.explore = ExploreCopy(self.model.transformer, recipe, changes=explore_rule(cfg, self.spec))
            if not self.explore.report.quantized and recipe != "bf16":
                log.warning(
                    "the explore copy quantizes no layer of %s under its rule (%s): exploration runs at full "
                    "precision; see quantization.txt in the run directory for why each layer was kept",
                    cfg.model, explore_rule(cfg, self.spec),
                )
        self.cfg_guidance = self._guidance() if self.spec.guidance == "cfg" else 1.0
        self._uncond: Conditioning | None = None
        # `compile` (and sol_rl by default) sample through torch.compile + one CUDA graph per batch
        # shape; the graphs read the weights in place, so updates need no re-capture.
        from solrl_engine.rl.config import FAMILY_TABLE

        graphed = FAMILY_TABLE[cfg.family].compiled or cfg.compiled_sampler
        if graphed and self.device.type != "cuda":
            log.info("compiled sampler: needs a CUDA device; sampling eagerly on %s.", self.device.type)
        self.sampler = GraphedSampler(self.model, enabled=graphed and self.device.type == "cuda")

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
        with autocast_for(self.device):
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
        comps = getattr(self.reward, "last_components", None) or {self.cfg.reward: r}
        return Scored(images, r.float().to(self.device), {k: v.float().cpu() for k, v in comps.items()})

    def generate(
        self, prompts: Sequence[str], seeds: Sequence[int], steps: int | None = None, tag: str = ""
    ) -> Scored:
        """Images and rewards for (prompts[i], seeds[i]) with the policy as it is (its active adapter)."""
        x0 = self.sample(self.encode(prompts), seeds, steps or self.cfg.full_steps, tag=tag)
        return self.score(x0, prompts)
