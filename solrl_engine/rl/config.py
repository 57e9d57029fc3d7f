"""Typed RL configuration, validated at start, with `--set key=value` overrides.

Configs are Python functions returning an RLConfig (configs/<model>.py, named
<model>_<family>_<reward>); `load_config("configs/tiny.py:tiny_sol_rl_shapes", ["n=32"])` builds one.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import logging
import math
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from solrl_engine.explore.plan import EXPLORE_PRECISIONS, ExploreSettings, option_applies
from solrl_engine.explore.ranking import nk_problem
from solrl_engine.hw import autocast_for, pick_device, policy_dtype
from solrl_engine.quant.recipe import FORMAT_OPTIONS
from solrl_engine.sampling.sampler import SOLVERS

log = logging.getLogger("solrl_engine.rl")

__all__ = ["EXPLORE_PRECISIONS", "FAMILY_TABLE", "ConfigError", "RLConfig", "autocast_for", "load_config",
           "resolve_policy_dtype", "resolve_runtime"]


@dataclass(frozen=True)
class FamilyRule:
    """What one training family does differently; the trainer reads this table, never family names.

    quantized_explore: explore with the quantized copy (else the policy in BF16);
    preview: explore at preview_steps (else full_steps); regenerate: regenerate the selected
    seeds with the policy and train on those (else train on the explored samples); compiled: always
    sample through the compiled sampler (graph-captured on GPU, inductor on CPU); all_rollouts: N must equal K.
    """

    quantized_explore: bool = False
    preview: bool = False
    regenerate: bool = False
    compiled: bool = False
    all_rollouts: bool = False


FAMILY_TABLE: dict[str, FamilyRule] = {
    "diffusionnft": FamilyRule(all_rollouts=True),  # K BF16 rollouts, all trained on
    "naive_scaling": FamilyRule(),  # N BF16 rollouts -> K
    "compile": FamilyRule(compiled=True),  # as naive_scaling, compiled (+ graph-captured on GPU)
    "naive_quant": FamilyRule(quantized_explore=True),  # N quantized rollouts -> K, trained on directly
    "sol_rl": FamilyRule(quantized_explore=True, preview=True, regenerate=True),  # previews -> K regenerated
}
FAMILIES = tuple(FAMILY_TABLE)
TRAIN_MODES = ("lora", "full")  # what the update trains: LoRA adapters, or every transformer weight
# the policy replicated on every rank, FSDP2-sharded over all ranks, or HSDP: sharded within each group of
# shard_group_size ranks (a node's GPUs by default), replicated across the groups (nodes)
SHARDING = ("none", "fsdp", "hsdp")
EXPLORE_SHARDING = ("auto", "none", "shard")  # the explore copy of a sharded run: split over the ranks, or whole


@dataclass(frozen=True)
class ObjectiveSpec:
    """A registered objective (rl/objectives/): its name (the config's `objective`), a line saying what it is, its
    handler as "module:attr", imported on first use (the config checks names without the update code), and the
    rollouts it trains on: "samples" (final samples of any solver) or "sde" (Flow-GRPO's SDE states with per-step
    log-probabilities; `window`: on a window of sde_window steps, else every step but the last)."""

    name: str
    summary: str
    handler: str
    rollout: str = "samples"
    window: bool = False

    def load(self) -> Any:
        mod, attr = self.handler.split(":")
        return getattr(importlib.import_module(mod), attr)


# the objectives a run can train with, one handler each (rl/objectives/<name>.py)
OBJECTIVES: dict[str, ObjectiveSpec] = {
    "nft": ObjectiveSpec("nft", "DiffusionNFT (Zheng et al. 2025): the trained and old policies' implicit positive "
                                "and negative policies, weighted by the reward; the paper's and Sol-RL's loss",
                         "solrl_engine.rl.objectives.nft:OBJECTIVE"),  # fmt: skip
    "flow_grpo": ObjectiveSpec("flow_grpo", "Flow-GRPO (Liu et al. 2025): SDE rollouts with per-step Gaussian "
                                            "log-probabilities, a clipped probability ratio on group-normalised "
                                            "advantages and a KL to the reference; every step but the last",
                               "solrl_engine.rl.objectives.flow_grpo:FLOW_GRPO", rollout="sde"),  # fmt: skip
    "flow_grpo_fast": ObjectiveSpec("flow_grpo_fast", "Flow-GRPO-Fast: Flow-GRPO's loss on a window of sde_window "
                                                      "SDE steps placed at random in the first half, ODE elsewhere",
                                    "solrl_engine.rl.objectives.flow_grpo:FLOW_GRPO_FAST", rollout="sde",
                                    window=True),  # fmt: skip
    "awm": ObjectiveSpec("awm", "AWM, advantage-weighted matching (Xue et al. 2025): flow matching toward the "
                                "rollouts' samples, each weighed by its advantage, with the KL to the reference",
                         "solrl_engine.rl.objectives.awm:OBJECTIVE"),  # fmt: skip
}


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key and how to fix it."""


@dataclass
class RLConfig:
    """Everything one Sol-RL (or baseline) run needs. Defaults follow DiffusionNFT / Sol-RL."""

    name: str = "run"
    family: str = "sol_rl"
    # the loss the selected samples train with (rl/objectives/: nft, DiffusionNFT; flow_grpo, flow_grpo_fast); "family"
    # above is the rollout recipe (which precision explores, what is selected and regenerated), the objective what the
    # update optimizes. An SDE objective's trained rollouts are its own SDE at sde_noise_level (on sde_window steps
    # placed at random below sde_window_range, for flow_grpo_fast; None: half the steps); `solver` stays the previews'
    # and the evaluation's. clip_range: the probability ratio's clip (Flow-GRPO's base config: 1e-4)
    objective: str = "nft"
    sde_noise_level: float = 0.7
    sde_window: int = 2
    sde_window_range: int | None = None
    clip_range: float = 1e-4
    # sol_rl with an SDE objective: previews sample that SDE on the regeneration's Brownian path (a seed's preview and
    # its final share their noise: sampling.sde.coupled_noise). None: on where that is so (they rank its finals far
    # better than ODE previews: docs/training-and-configs.md); False: previews sample `solver` as it is
    preview_sde: bool | None = None
    # the model: a family of solrl_engine.models.MODELS (tiny, sd3, flux, sana); model_path is a local
    # pipeline directory or a hub id (None: the family's default weights); resolution in pixels
    # (None: the family's default, the paper's: SD3.5-L 1024, FLUX 512, SANA 1024)
    model: str = "tiny"
    model_path: str | None = None
    resolution: int | None = None
    # video models (model=wan): frames per clip (4k + 1) and the width in pixels (resolution is then the height);
    # None: the model's default (Wan2.1: 81 frames, 480 x 832)
    frames: int | None = None
    width: int | None = None
    # a reward name or a weighted sum ("pickscore:1.0,clipscore:0.5"); reward_args as name.key=value
    reward: str = "shapes"
    reward_args: tuple[str, ...] = ()
    # rewards scored by servers (`solrl reward-serve`): "pickscore=http://127.0.0.1:8000,b=URL2"; the others stay
    # in-process. An unreachable server is waited for up to reward_wait_s seconds, then the run stops resumably
    reward_url: str = ""
    reward_wait_s: float = 600.0
    # several rewards: "sum" ranks and trains on the weighted sum; "group_normalized" normalises each reward within
    # its prompt group (over its std) before weighting, so one of large spread cannot drown the others
    reward_combine: str = "sum"
    # video models: the image rewards score this many frames spread over each clip, aggregated by their mean
    # or min (reward "temporal" scores whole clips: consecutive frames agreeing)
    reward_frames: int = 4
    reward_frame_agg: str = "mean"
    train_prompts: str = "shapes/train"
    eval_prompts: str = "shapes/heldout"
    # rollout: N seeds explored per prompt, K trained on (top K/2 + bottom K/2)
    n: int = 96
    k: int = 24
    prompts_per_iter: int = 16
    preview_steps: int = 6
    full_steps: int = 10
    solver: str = "dpm2"
    shift: float | None = None  # sigma-schedule shift; None: the model's own schedule (its scheduler config)
    guidance_scale: float | None = None  # None: the model's default (CFG for sd3/sana, distilled for flux)
    # a two-expert model's (Wan2.2-A14B) low-noise expert's guidance, as WanPipeline's guidance_scale_2 (None: the
    # same as guidance_scale); guidance_scale is then the high-noise expert's
    guidance_scale_2: float | None = None
    explore_precision: str = "auto"
    # Which layers the explore copy quantizes: None takes the model's rule (models/, the paper's choice);
    # explore_layers are include patterns, explore_skip extra patterns kept in high precision,
    # explore_skip_max_dim keeps layers no wider than it (Sol-RL's 2432 rule; 0: off).
    explore_layers: tuple[str, ...] | None = None
    explore_skip: tuple[str, ...] | None = None
    explore_skip_max_dim: int | None = None
    # NVFP4 explore recipes beyond the TE recipe (solrl_engine.quant.recipe.QuantRecipe): a Hadamard
    # rotation along K (0, 16, 32, 64, 128), 4-over-6 block scales, a rank-r BF16 branch (SVDQuant)
    explore_rht: int = 0
    explore_four_over_six: bool = False
    explore_lowrank: int = 0
    # "fp8" or "int8": the explore copy's attention in that format, through its kernel where the GPU has the tensor
    # cores (FP8 sm_89+, INT8 sm_80+; a video forward's largest cost after its linears); "bf16": as the policy's
    explore_attention: str = "bf16"
    # torch.compile for rollouts, + CUDA graphs on GPU (always on for the `compile` family). None: on with
    # CUDA; off on a CPU, where a cold inductor compile (~25 s per batch shape on 2 cores) costs more than
    # a short run saves (rollouts about 1.3x faster once compiled); true compiles there too.
    compiled_sampler: bool | None = None
    # how the compiled sampler compiles (solrl_engine.sampling.compile): compile_mode None is inductor's
    # default (no autotuning), "max-autotune-no-cudagraphs" searches kernels (minutes per shape, cold);
    # compile_regional compiles the repeated transformer blocks once instead of the whole module (None: on
    # with CUDA, where a cold whole-module compile of a full-size denoiser takes minutes and CUDA graphs hide
    # the eager glue between blocks; off on a CPU, where the bundled model compiles whole in 40 s and its
    # forward runs 58 ms that way against 109 ms regional at batch 24: bench/results/2026-11-25-cpu-compile-time.json);
    # compile_cache_dir keeps inductor's compiled code on disk for the next run (None: torch's temporary
    # per-user directory)
    compile_mode: str | None = None
    compile_regional: bool | None = None
    compile_cache_dir: str | None = None
    # the update's forward and backward through the policy's repeated blocks compiled (regional, LoRA inside;
    # rl/update.py): None on with CUDA, off on a CPU (a cold compile of a block's forward and backward costs tens of
    # seconds on a few cores); true compiles there too. LoRA runs that are not sharded (the others stay eager)
    compiled_update: bool | None = None
    rollout_batch_size: int = 96
    decode_batch_size: int = 8  # images per VAE decode call (memory at 1024 px)
    offload_text_encoders: bool = True  # move the text encoders to CPU after the prompts are encoded
    # the update's recompute (gradient checkpointing): true recomputes every repeated block in the backward, a number
    # N the first N of them, false none; auto: on a GPU as few as the device needs (rl/sizing.py), on a CPU none
    gradient_checkpointing: bool | int | str = "auto"
    memory_check: bool = True  # on a GPU, refuse at start a run whose memory plan (rl/memplan.py) cannot fit
    # policy update (DiffusionNFT)
    train_mode: str = "lora"  # lora: adapters on the frozen base; full: every transformer weight (rl/full.py)
    lora_rank: int = 32
    lora_alpha: int = 64
    lora_targets: tuple[str, ...] | None = None  # None: the model's default LoRA targets
    # a two-expert model (Wan2.2-A14B: models/experts.py): which experts carry the LoRA: both, high (the high-noise
    # `transformer`) or low (`transformer_2`); the other samples with its base weights
    lora_experts: str = "both"
    merge_lora: bool = True
    # under torchrun: "fsdp" shards the policy over the ranks with FSDP2 (fully_shard per repeated block): a LoRA
    # run's frozen base weights (the adapters stay whole on every rank), or every weight of a full fine-tuning
    # run with its optimizer state and weight sets (docs/scale.md); "hsdp": sharded within groups of
    # shard_group_size ranks (0: each node's, torchrun's LOCAL_WORLD_SIZE) and replicated across them
    sharding: str = "none"
    shard_group_size: int = 0
    # with sharding: the explore copy's blocks split over the ranks too (rl/sharding.ShardedCopy), gathered block by
    # block in its forwards, which then run eagerly (no captured graphs): "shard", "none" (each rank holds it
    # whole), or "auto": shard only where the run's memory plan does not fit with the copy whole
    explore_sharding: str = "auto"
    # under torchrun: groups of this many consecutive ranks split each forward's sequence (tokens) and hold the same
    # samples (rl/context_parallel.py): ulysses (the heads split, an all-to-all), ring (keys and values passed
    # around; GPU attention kernels only) or auto (ulysses where the degree divides the heads)
    context_parallel: int = 1
    context_parallel_mode: str = "auto"
    lr: float = 3e-4
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    # the update's micro-batch (samples per forward and backward; gradients accumulate, so it changes memory and
    # speed, not the result); auto: on a GPU the largest that fits without recompute (rl/sizing.py), on a CPU 16
    train_batch_size: int | str = "auto"
    # optimizer steps per iteration, each on a random 1/updates_per_iter of the selected samples (the
    # official DiffusionNFT's gradient_step_per_epoch); the "old" adapter moves once per iteration
    updates_per_iter: int = 1
    beta: float = 1.0
    kl_beta: float = 1e-4
    adv_clip: float = 5.0
    timestep_fraction: float = 0.6
    old_decay_rate: float = 0.001
    old_decay_max: float = 0.5
    ema_decay_max: float = 0.9
    # loop
    iterations: int = 100
    eval_every: int = 5
    eval_prompt_count: int = 32
    eval_seeds: int = 2
    # training prompts (a fixed sample) evaluated beside the held-out ones, same seeds and EMA adapter:
    # the curve of what RL fits, next to what it generalizes (0: none)
    eval_train_prompt_count: int = 0
    save_every: int = 5
    keep_checkpoints: int = 2
    log_with: tuple[str, ...] = ()  # experiment trackers besides metrics.jsonl: tensorboard, wandb
    # trust: what a non-finite latent, velocity, loss or reward does ("skip" the iteration's update, or
    # "abort" the run), and the proxy-drift guard: when the mean proxy_spearman over the last
    # proxy_window iterations falls below proxy_floor, warn, and with proxy_fallback "steps" explore
    # at full_steps, with "bf16" explore with the policy itself, until the quantized proxy recovers
    nonfinite_policy: str = "skip"
    proxy_floor: float = 0.5
    proxy_window: int = 10
    proxy_fallback: str = "warn"
    seed: int = 0
    device: str = "auto"
    policy_dtype: str = "auto"
    output: str = ""

    def explore_settings(self) -> ExploreSettings:
        """The explore_* keys as the explore layer takes them (explore.plan.ExploreSettings)."""
        return ExploreSettings(
            precision=self.explore_precision,
            layers=None if self.explore_layers is None else tuple(self.explore_layers),
            skip=None if self.explore_skip is None else tuple(self.explore_skip),
            skip_max_dim=self.explore_skip_max_dim,
            rht=self.explore_rht,
            four_over_six=self.explore_four_over_six,
            lowrank=self.explore_lowrank,
            attention=self.explore_attention,
        )

    def _check_objective(self, bad: typing.Callable[[str, str], ConfigError]) -> None:
        """An SDE objective's keys: a noise that gives log-probabilities, a ratio clip, a window that fits."""
        spec = OBJECTIVES[self.objective]
        sde = tuple(n for n, o in OBJECTIVES.items() if o.rollout == "sde")
        if self.preview_sde is True and (spec.rollout != "sde" or not FAMILY_TABLE[self.family].regenerate):
            raise bad("preview_sde", f"SDE previews coupled to the regeneration's noise rank the finals of an SDE "
                                     f"objective ({sde}) that Sol-RL regenerates (family sol_rl); here objective="
                                     f"{self.objective!r}, family={self.family!r}: leave preview_sde None "
                                     "(auto)")  # fmt: skip
        if spec.rollout != "sde":
            return
        if not self.sde_noise_level > 0:
            raise bad("sde_noise_level", f"{self.objective} trains on per-step log-probabilities, which a sampler "
                                         "without noise has none of: use > 0 (Flow-GRPO's 0.7), or an objective that "
                                         f"trains on final samples ({tuple(n for n in OBJECTIVES if n not in sde)})")
        if not self.clip_range > 0:
            raise bad("clip_range", "the probability ratio's clip must be > 0 (Flow-GRPO's 1e-4)")
        if self.full_steps < 2:
            raise bad("full_steps", f"{self.objective} trains on every SDE step but the last: needs >= 2 steps")
        if spec.window:
            high = self.full_steps // 2 if self.sde_window_range is None else self.sde_window_range
            if not 1 <= high <= self.full_steps - 1:
                raise bad("sde_window_range", f"the window's steps lie below it: between 1 and full_steps - 1 "
                                              f"({self.full_steps - 1}); None: half the steps")  # fmt: skip
            if not 1 <= self.sde_window <= high:
                raise bad("sde_window", f"SDE steps per rollout: between 1 and sde_window_range ({high}; None is half "
                                        f"of full_steps): lower sde_window, or raise sde_window_range up to "
                                        f"full_steps - 1 ({self.full_steps - 1})")  # fmt: skip

    def validate(self) -> RLConfig:
        """Raise ConfigError on anything that cannot run; return self."""

        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"config {self.name!r}: {key} = {getattr(self, key)!r}: {msg}")

        if self.family not in FAMILIES:
            raise bad("family", f"unknown family; choose one of {FAMILIES}")
        if self.objective not in OBJECTIVES:
            raise bad("objective", f"unknown objective; choose one of {tuple(OBJECTIVES)} (family={self.family!r} "
                                   "says how rollouts are made; the objective, what the update optimizes)")
        self._check_objective(bad)
        from solrl_engine.models import MODELS

        if self.model not in MODELS:
            raise bad("model", f"unknown model family; choose one of {tuple(MODELS)}")
        if (why := nk_problem(self.n, self.k)) is not None:
            raise bad("k", why)
        if FAMILY_TABLE[self.family].all_rollouts and self.n != self.k:
            raise bad("n", f"{self.family} trains on every rollout, so n must equal k ({self.k})")
        if not 1 <= self.preview_steps <= self.full_steps:
            raise bad("preview_steps", f"must be between 1 and full_steps ({self.full_steps})")
        if self.solver not in SOLVERS:
            raise bad("solver", f"choose one of {SOLVERS} (dpm2: the stock SANA sampler; unipc: the stock Wan one; "
                                "flow_sde: Flow-GRPO's SDE)")
        explore = self.explore_settings().problems()  # explore/plan.py checks its own settings
        if explore and explore[0][0] == "precision":
            raise bad("explore_precision", explore[0][1])
        from solrl_engine.sampling.compile import COMPILE_MODES

        if self.compile_mode not in COMPILE_MODES:
            raise bad("compile_mode", f"choose one of {COMPILE_MODES} (null: inductor's default, no autotuning; modes "
                                      "with inductor's own CUDA graphs are refused: the sampler captures the loop)")
        for f in fields(self):  # a NaN passes every comparison below; an infinity only a few
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v) and not (f.name == "grad_clip" and v == math.inf):
                raise bad(f.name, "must be a finite number")
        if self.lr <= 0:
            raise bad("lr", "the learning rate must be > 0, e.g. 3e-4")
        for key in ("ema_decay_max", "old_decay_max"):  # decays: 1 would freeze the copy, above 1 diverge
            if not 0 <= getattr(self, key) < 1:
                raise bad(key, "a decay: must be in [0, 1)")
        if not 0 <= self.old_decay_rate <= 1:
            raise bad("old_decay_rate", "how fast the old policy's decay grows per iteration: must be in [0, 1]")
        if isinstance(self.lora_alpha, bool) or self.lora_alpha <= 0:
            raise bad("lora_alpha", "must be > 0 (the adapter's scale is lora_alpha / lora_rank; e.g. 2 x lora_rank)")
        if not self.name or self.name in (".", "..") or "/" in self.name or "\\" in self.name or "\0" in self.name:
            raise bad("name", "names the run and its default directory runs/<name>: use letters, digits, - and _, "
                              "no / or .. (choose the directory with --output)")  # fmt: skip
        from solrl_engine.rewards import parse_reward_spec

        try:
            names = {n for n, _ in parse_reward_spec(self.reward)}
        except ValueError as e:
            raise ConfigError(f"config {self.name!r}: {e}") from None
        from solrl_engine.rewards.remote import parse_reward_urls

        try:
            urls = parse_reward_urls(self.reward_url)
        except ValueError as e:
            raise bad("reward_url", str(e)) from None
        if set(urls) - names:
            raise bad("reward_url", f"names {sorted(set(urls) - names)}, not part of reward {self.reward!r}: map the "
                                    "rewards the run scores to their servers")  # fmt: skip
        from solrl_engine.rewards import COMBINE

        if self.reward_combine not in COMBINE:
            raise bad("reward_combine", f"choose one of {COMBINE}")
        if not self.reward_wait_s >= 0:
            raise bad("reward_wait_s", "must be >= 0 seconds (how long an unreachable reward server is waited for)")
        for key in ("weight_decay", "kl_beta"):
            if getattr(self, key) < 0:
                raise bad(key, "must be >= 0 (0: off)")
        if self.grad_clip <= 0 or self.adv_clip <= 0:
            raise bad("grad_clip" if self.grad_clip <= 0 else "adv_clip", "must be > 0")
        if not 0 < self.timestep_fraction <= 1:
            raise bad("timestep_fraction", "must be in (0, 1]")
        if self.beta <= 0:
            raise bad("beta", "must be > 0 (the loss divides by it)")
        if self.eval_prompt_count < 1:
            raise bad("eval_prompt_count", "must be >= 1: the held-out evaluation is how a run is judged and which "
                                           "adapter is kept as lora_best (raise eval_every to evaluate less often)")
        for name, why in explore:
            raise bad(ExploreSettings.key(name), why)
        if self.explore_attention != "bf16" and not FAMILY_TABLE[self.family].quantized_explore:
            raise bad("explore_attention", f"{self.family} explores with the policy itself, whose attention stays as "
                                           "trained: use family naive_quant or sol_rl, or leave it at bf16")
        if self.resolution is not None and self.resolution < 16:
            raise bad("resolution", "must be a pixel size >= 16 (None: the model's default)")
        from solrl_engine.models import MODELS, model_spec

        step = model_spec(self.model).resolution_step
        if self.resolution is not None and self.resolution % step:
            raise bad("resolution", f"model={self.model} draws at a multiple of {step} pixels: use "
                                    f"{max(step, self.resolution // step * step)}")  # fmt: skip
        video = " or ".join(n for n in MODELS if model_spec(n).video)
        for key in ("frames", "width"):
            if getattr(self, key) is not None and not model_spec(self.model).video:
                raise bad(key, f"applies to video models (model={video}); {self.model!r} draws images: leave it unset")
        if self.frames is not None and (self.frames < 1 or (self.frames - 1) % 4):
            raise bad("frames", "the Wan VAE takes 4k + 1 frames (e.g. 9, 33, 81, 121)")
        if self.width is not None and self.width < 16:
            raise bad("width", "must be a pixel size >= 16 (None: the model's default)")
        if self.reward_frames < 1:
            raise bad("reward_frames", "score at least one frame per clip")
        if self.reward_frame_agg not in ("mean", "min"):
            raise bad("reward_frame_agg", "choose mean (every scored frame counts) or min (a clip is its worst frame)")
        if self.shift is not None and self.shift <= 0:
            raise bad("shift", "must be > 0 (None: the model's own schedule)")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise bad("guidance_scale", "must be >= 0 (1.0: no classifier-free guidance; None: the model's default)")
        for key in (
            "prompts_per_iter",
            "iterations",
            "eval_every",
            "save_every",
            "rollout_batch_size",
            "lora_rank",
            "keep_checkpoints",
            "eval_seeds",
            "decode_batch_size",
            "updates_per_iter",
        ):
            if getattr(self, key) < 1:
                raise bad(key, "must be >= 1")
        if self.train_batch_size != "auto" and (isinstance(self.train_batch_size, bool)
                                                or not isinstance(self.train_batch_size, int)
                                                or self.train_batch_size < 1):  # fmt: skip
            raise bad("train_batch_size", "must be a number of samples >= 1, or auto (sized from the GPU's memory)")
        gc = self.gradient_checkpointing
        if gc != "auto" and not isinstance(gc, bool) and (not isinstance(gc, int) or gc < 0):
            raise bad("gradient_checkpointing", "true (recompute every block), false, a number of blocks to recompute, "
                                                "or auto (as few as the GPU's memory needs)")  # fmt: skip
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad("device", "use auto, cpu, cuda or cuda:N")
        if self.nonfinite_policy not in ("skip", "abort"):
            raise bad("nonfinite_policy", "choose skip (drop the iteration's update) or abort (stop the run)")
        if self.proxy_fallback not in ("warn", "steps", "bf16"):
            raise bad("proxy_fallback", "choose warn, steps (explore at full_steps) or bf16 (explore with the policy)")
        if not -1 <= self.proxy_floor <= 1:
            raise bad("proxy_floor", "a Spearman correlation: between -1 and 1 (-1 turns the guard off)")
        if self.eval_train_prompt_count < 0:
            raise bad("eval_train_prompt_count", "must be >= 0 (0: no training-prompt curve)")
        if self.proxy_window < 1:
            raise bad("proxy_window", "must be >= 1")
        from solrl_engine.store.tracking import TRACKERS

        if any(b not in TRACKERS for b in self.log_with):
            raise bad("log_with", f"choose trackers from {TRACKERS} (comma-separated), or leave it empty")
        if self.train_mode not in TRAIN_MODES:
            raise bad("train_mode", f"choose one of {TRAIN_MODES} (lora: adapters on the frozen base, the default; "
                                    "full: every weight of the transformer, docs/full-fine-tuning.md)")
        from solrl_engine.models.experts import LORA_EXPERTS, boundary_ratio

        def two_experts_only(key: str, what: str, unset: str) -> None:
            """`key` (set) means something only on a two-expert model: refused for a one-transformer family, and for a
            local pipeline whose model_index.json has no transformer_2 (read before any weight loads)."""
            if not model_spec(self.model).two_experts:
                experts = " or ".join(n for n in MODELS if model_spec(n).two_experts)
                raise bad(key, f"{what} (model={experts} over a Wan2.2-A14B pipeline); {self.model!r} has one "
                               f"transformer: {unset}")  # fmt: skip
            if self.model_path and Path(self.model_path).is_dir() and boundary_ratio(self.model_path, {}) is None:
                raise bad(key, f"{self.model_path} holds one transformer (no transformer_2 and boundary_ratio in its "
                               f"model_index.json, the Wan2.2-A14B layout): {unset}")  # fmt: skip

        if self.lora_experts not in LORA_EXPERTS:
            raise bad("lora_experts", f"choose one of {sorted(LORA_EXPERTS)}: which experts of a two-expert model "
                                      "(Wan2.2-A14B) carry the LoRA")  # fmt: skip
        if self.lora_experts != "both":
            two_experts_only("lora_experts", "applies to two-expert models", "leave it at 'both'")
        if self.guidance_scale_2 is not None:
            if self.guidance_scale_2 < 0:
                raise bad("guidance_scale_2", "must be >= 0 (None: the same as guidance_scale)")
            two_experts_only("guidance_scale_2", "is the low-noise expert's guidance of a two-expert model",
                             "leave it unset")
            high = self.guidance_scale if self.guidance_scale is not None else model_spec(self.model).guidance_scale
            if (high == 1.0) != (self.guidance_scale_2 == 1.0):
                raise bad("guidance_scale_2", f"{self.guidance_scale_2} with guidance_scale {high}: both experts use "
                                              "classifier-free guidance (!= 1) or neither does (1.0)")  # fmt: skip
        if self.lora_experts != "both" and self.train_mode != "lora":
            raise bad("lora_experts", "chooses where the LoRA goes; train_mode=full trains every weight: leave it at "
                                      "'both'")  # fmt: skip
        if self.train_mode == "full" and FAMILY_TABLE[self.family].compiled:
            raise bad("family", "the compile family samples the policy through captured graphs, which read fixed "
                                "weight addresses; full fine-tuning swaps whole weight sets, so the policy samples "
                                "eagerly: use naive_scaling (or sol_rl) with train_mode=full")
        if self.train_mode == "full" and not self.merge_lora:
            raise bad("merge_lora", "full fine-tuning refreshes the explore copy with the whole old policy; there is "
                                    "no LoRA branch to keep unmerged: leave merge_lora at true")
        if self.sharding not in SHARDING:
            raise bad("sharding", f"choose one of {SHARDING} (fsdp: sharded over torchrun's ranks; hsdp: within each "
                                  "node, replicated across nodes)")  # fmt: skip
        if self.shard_group_size < 0 or (self.shard_group_size and self.sharding != "hsdp"):
            raise bad("shard_group_size", "it is sharding=hsdp's group of ranks sharing one copy (0: a node's); "
                                          "set sharding=hsdp, or leave it at 0")  # fmt: skip
        if self.explore_sharding not in EXPLORE_SHARDING:
            raise bad("explore_sharding", f"choose one of {EXPLORE_SHARDING} (shard: the explore copy split over the "
                                          "ranks; auto: only where a whole copy does not fit)")  # fmt: skip
        if self.explore_sharding == "shard" and (self.sharding == "none" or not FAMILY_TABLE[self.family].
                                                 quantized_explore):  # fmt: skip
            raise bad("explore_sharding", "splits a quantized explore copy over the ranks of a sharded run: set "
                                          "sharding=fsdp (or hsdp) with sol_rl or naive_quant, or leave it at auto")
        if self.explore_sharding == "shard" and self.explore_precision == "te_nvfp4":
            raise bad("explore_sharding", "Transformer Engine's layers keep their weights their own way: use "
                                          "explore_precision=nvfp4 (the engine's, the same numerics)")  # fmt: skip
        if self.sharding != "none" and FAMILY_TABLE[self.family].compiled:
            raise bad("family", "the compile family samples the policy through captured graphs; a sharded policy "
                                "gathers its weights block by block inside each forward, so it samples eagerly: "
                                f"use sol_rl or naive_scaling with sharding={self.sharding}")
        from solrl_engine.rl.context_parallel import CP_MODES

        if isinstance(self.context_parallel, bool) or self.context_parallel < 1:
            raise bad("context_parallel", "a number of ranks >= 1 that split each forward's sequence (1: none)")
        if self.context_parallel_mode not in CP_MODES:
            raise bad("context_parallel_mode", f"choose one of {CP_MODES} (auto: ulysses where the degree divides the "
                                               "attention heads, else ring)")  # fmt: skip
        if self.context_parallel > 1:
            if FAMILY_TABLE[self.family].compiled or self.compiled_update or self.compiled_sampler:
                raise bad("context_parallel", "a context-parallel forward is a collective in every attention, which "
                                              "the compiled sampler's captured graphs and the compiled update do "
                                              "not hold: use sol_rl, naive_scaling, naive_quant or diffusionnft, "
                                              "and leave compiled_sampler and compiled_update unset")  # fmt: skip
            if self.train_mode != "lora" or self.sharding == "hsdp":
                raise bad("context_parallel", "is built for LoRA runs, whole or with sharding=fsdp: use "
                                              "train_mode=lora and sharding=none or fsdp")  # fmt: skip
        if self.compiled_update and (self.train_mode != "lora" or self.sharding != "none"):
            raise bad("compiled_update", "the compiled update is built for LoRA runs that are not sharded (a sharded "
                                         "block gathers its weights in hooks, full fine-tuning swaps weight sets): "
                                         "leave it unset (those runs update eagerly)")  # fmt: skip
        if self.policy_dtype not in ("auto", "bfloat16", "float32"):
            raise bad("policy_dtype", "use auto, bfloat16 or float32")
        return self


def resolve_policy_dtype(cfg: RLConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """The config's policy dtype on `device`, and why (hw.policy_dtype: auto is BF16 on CUDA and on CPUs
    with BF16 units, FP32 elsewhere)."""
    return policy_dtype(cfg.policy_dtype, device)


def resolve_runtime(cfg: RLConfig) -> tuple[torch.device, torch.dtype]:
    """(device, policy dtype) of a config; a CUDA device that is not there is a ConfigError naming the
    key, before any model loads (hw.pick_device says why)."""
    try:
        dev = pick_device(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config {cfg.name!r}: {e}") from None
    return dev, resolve_policy_dtype(cfg, dev)[0]


def _parse_value(raw: str, tp: object, key: str) -> object:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if int in kinds and raw.strip().lstrip("-").isdigit():  # a number (int | bool: "1" is one, not true)
            return int(raw)
        error: ConfigError | None = None
        for kind in kinds:  # in order: a word that bool or int refuses is the str a union may hold ("auto")
            try:
                return _parse_value(raw, kind, key)
            except ConfigError as e:
                error = e
        raise error  # type: ignore[misc]  (every kind refused it)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: expected true or false")
    if origin is tuple:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected {tp.__name__}") from None
    return raw


def unknown_key_error(key: str, where: str = "") -> ConfigError:
    """A key RLConfig does not have: the nearest one it does, or all of them (`where` prefixes the message)."""
    names = [f.name for f in fields(RLConfig)]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
    return ConfigError(f"{where + ': ' if where else ''}unknown config key {key!r}{hint}")


def apply_overrides(cfg: RLConfig, overrides: list[str]) -> RLConfig:
    """Apply "key=value" strings with the field's type; unknown keys are an error with a suggestion."""
    hints = typing.get_type_hints(RLConfig)
    names = [f.name for f in fields(RLConfig)]
    changes: dict[str, object] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: write key=value")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in names:
            raise unknown_key_error(key)
        changes[key] = _parse_value(raw, hints[key], key)
    return dataclasses.replace(cfg, **changes, **_preset_nvfp4_options(cfg, changes), **_preset_width(cfg, changes))


def _preset_width(cfg: RLConfig, changes: dict[str, object]) -> dict[str, object]:
    """`--set resolution=R` on a video preset that fixes `width` (832 for Wan's 480p): the clip is R x R (the
    model's rule for an unset width), rather than R x 832 with the preset's width kept; set `width` too for
    another shape."""
    if "resolution" not in changes or "width" in changes or cfg.width is None:
        return {}
    log.info(
        "resolution=%s: the preset's width=%s is dropped; the width follows resolution by the model's own rule (the "
        "same as the height, or its default width at its default height): set width too for another shape",
        changes["resolution"], cfg.width)  # fmt: skip
    return {"width": None}


def _preset_nvfp4_options(cfg: RLConfig, changes: dict[str, object]) -> dict[str, object]:
    """A preset's NVFP4 options (explore_rht, explore_four_over_six, ...) that an override of explore_precision
    to a format they do not apply to (fp8, int8, bf16) would make invalid: back to their defaults, said in the
    log, so `--set explore_precision=fp8` works on a preset that tunes NVFP4. Options the user set stay (and are
    refused with the reason)."""
    precision = changes.get("explore_precision")
    if precision is None:
        return {}
    defaults = {f.name: f.default for f in fields(RLConfig)}
    reset = {}
    for name in FORMAT_OPTIONS:
        key = ExploreSettings.key(name)
        if key not in changes and getattr(cfg, key) != defaults[key] and not option_applies(name, str(precision)):
            reset[key] = defaults[key]
    if reset:
        log.info(
            "explore_precision=%s: the preset's %s do not apply to its format and are set back to their defaults",
            precision,
            ", ".join(f"{k}={getattr(cfg, k)!r}" for k in reset))  # fmt: skip
    return reset


def load_config(spec: str, overrides: list[str] | None = None) -> RLConfig:
    """Build the config `path/to/file.py:function` with overrides; a key=value whose key is a
    parameter of the function (e.g. paper_scale) is passed to it, the rest set fields."""
    if ":" not in spec:
        raise ConfigError(
            f"config spec {spec!r}: write configs/<file>.py:<function>, e.g. configs/tiny.py:tiny_sol_rl_shapes"
        )
    path_s, fn_name = spec.rsplit(":", 1)
    path = Path(path_s)
    example = "e.g. configs/tiny.py:tiny_sol_rl_shapes"
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist (run from the repository root, or give its full path)")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: name a .py file in it and a function, {example}")
    mod_spec = importlib.util.spec_from_file_location(f"solrl_config_{path.stem}", path)
    if path.suffix != ".py" or mod_spec is None or mod_spec.loader is None:
        raise ConfigError(f"config file {path} is not a Python file: a config is a .py file and a function, {example}")
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {e.msg}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        found = [n for n, v in vars(mod).items() if callable(v) and not n.startswith("_") and n != "RLConfig"]
        raise ConfigError(f"{path} has no config function {fn_name!r}; it has: {', '.join(found)}")
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    kwargs: dict[str, object] = {}
    rest: list[str] = []
    for item in overrides or []:
        key, _, raw = (s.strip() for s in item.partition("="))
        if key in params:
            kwargs[key] = _parse_value(raw, hints.get(key, str), key)
        else:
            rest.append(item)
    cfg = fn(**kwargs)
    if not isinstance(cfg, RLConfig):
        raise ConfigError(f"{spec} returned {type(cfg).__name__}, not an RLConfig")
    if cfg.name == "run":
        cfg = dataclasses.replace(cfg, name=fn_name)
    return apply_overrides(cfg, rest).validate()
