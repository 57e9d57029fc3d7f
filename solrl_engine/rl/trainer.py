"""The one RL trainer for every model and family.

Each iteration reads top to bottom as the method does: explore N seeds per prompt (quantized
previews for sol_rl), select the top K/2 and bottom K/2, regenerate those seeds in BF16 (with the objective's
sampler: Flow-GRPO's SDE for flow_grpo), score them, update the policy with the run's objective (DiffusionNFT's
loss by default), refresh the explore copy. Families differ only in which precision and step count explore uses
and whether selection or regeneration happens; objectives only in the rollouts they need and their update.

No process-global state: prompts, seeds and noise come from generators owned by the trainer and
saved in its checkpoints, so prompts can later be sharded across ranks (all N seeds of a prompt on
one rank; pass the gathered rewards to `group_advantages` for the global std).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from solrl_engine.data import check_conditioning, load_prompts
from solrl_engine.explore.choice import POLICY, ExploreChoice
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.explore.explorer import Selection
from solrl_engine.explore.plan import ExploreSpec
from solrl_engine.hw import cpu_compile_available, host_memory_available_gib
from solrl_engine.models import MODELS, model_spec
from solrl_engine.models.base import Conditioning
from solrl_engine.rl import sizing
from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters
from solrl_engine.rl.config import FAMILY_TABLE, ConfigError, RLConfig
from solrl_engine.rl.context_parallel import resolve_mode, split_context
from solrl_engine.rl.distributed import Dist, local
from solrl_engine.rl.export import save_trained
from solrl_engine.rl.full import REF, FullWeights, TrainedWeights
from solrl_engine.rl.guards import NonFiniteError, ProxyGuard, check_finite, check_resume_config
from solrl_engine.rl.heldout import HeldOut
from solrl_engine.rl.memplan import host_shortfall
from solrl_engine.rl.objectives import objective, preview_coupling, rollout_window
from solrl_engine.rl.ranking import group_advantages, kendall, spearman
from solrl_engine.rl.runtime import Target, build_rollouts, explorer_for, resolve, staged
from solrl_engine.rl.sharding import ShardedCopy, settle_, shard_policy, sharded_bytes
from solrl_engine.rl.update import UpdateBatch, fixed_predictions
from solrl_engine.sampling.compile import Census, CompiledBlocks, census_backend, repeated_blocks
from solrl_engine.sampling.rollouts import Pending, Scored
from solrl_engine.sampling.sde import Coupling
from solrl_engine.store import checkpoint, rundir
from solrl_engine.store.checkpoint import EXPORT_DIRS
from solrl_engine.store.safe import json_text, open_append, write_atomic
from solrl_engine.store.tracking import Tracker

log = logging.getLogger("solrl_engine.rl")


@dataclasses.dataclass
class Explored:
    """What the explore scored: the previews' rewards (weighted sums, [P, N]) and components, its reward seconds, and
    the seconds it spent starting regenerations (`Trainer._explore_in_halves`), which are the regeneration's time."""

    totals: torch.Tensor
    components: dict[str, torch.Tensor]
    reward_time: dict[str, float]
    regen_s: float = 0.0


@dataclasses.dataclass
class Regen:
    """A regeneration sampled, its scores possibly in flight; `states`: an SDE objective's window states."""

    pending: Pending
    states: list[torch.Tensor]


class PromptSampler:
    """Epochs over a prompt list in shuffled order; its state is part of every checkpoint."""

    def __init__(self, prompts: list[str], seed: int) -> None:
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def next(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if not self.order:
                self.order = self.rng.sample(range(len(self.prompts)), len(self.prompts))
            out.append(self.prompts[self.order.pop()])
        return out

    def state(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state(self, st: dict[str, Any]) -> None:
        self.rng.setstate(st["rng"])
        self.order = list(st["order"])


class Trainer:
    def __init__(self, cfg: RLConfig, progress: bool = True) -> None:
        self.cfg = cfg.validate()
        self.rule = FAMILY_TABLE[cfg.family]
        self.out = Path(cfg.output or f"runs/{cfg.name}")
        self.train_prompts = load_prompts(cfg.train_prompts)
        self.eval_prompts = load_prompts(cfg.eval_prompts)[: cfg.eval_prompt_count]
        family_spec = model_spec(cfg.model)
        conditioned = family_spec.conditioned
        takers = tuple(n for n in MODELS if model_spec(n).conditioned)
        for key, spec, prompts in (("train_prompts", cfg.train_prompts, self.train_prompts),
                                   ("eval_prompts", cfg.eval_prompts, self.eval_prompts)):  # fmt: skip
            try:
                check_conditioning(prompts, conditioned, cfg.model, key, spec, takers, family_spec.images_per_prompt)
            except ValueError as e:
                raise ConfigError(f"config {cfg.name!r}: {e}") from None
        k_train = min(cfg.eval_train_prompt_count, len(self.train_prompts))  # a fixed sample, by the run's seed
        self.eval_train_prompts = random.Random(cfg.seed + 3).sample(self.train_prompts, k_train)
        on_gpu = cfg.device != "cpu" and torch.cuda.is_available()
        self.dist = Dist.from_env("cuda" if on_gpu else "cpu")
        if on_gpu and self.dist.world > 1:
            torch.cuda.set_device(self.dist.local_rank)  # "cuda" is this rank's GPU from here on
        if self.dist.world % cfg.context_parallel:
            raise ConfigError(f"config {cfg.name!r}: context_parallel = {cfg.context_parallel} does not divide the "
                              f"{self.dist.world} ranks into groups: start a multiple of it (torchrun "
                              "--nproc_per_node)")  # fmt: skip
        self.dist.cp = cfg.context_parallel
        # a context-parallel forward is a collective, as a sharded one is: every rank runs as many (rl/distributed.py)
        self.dist.sharded = cfg.context_parallel > 1
        if cfg.prompts_per_iter % self.dist.dp_world:
            groups = f" ({self.dist.dp_world} groups of {cfg.context_parallel})" if cfg.context_parallel > 1 else ""
            raise ConfigError(
                f"config {cfg.name!r}: prompts_per_iter = {cfg.prompts_per_iter} does not split over {self.dist.world} "
                f"ranks{groups}: make it a multiple of the number of processes divided by context_parallel (it is the "
                "global number of prompts)"
            )
        if cfg.sharding != "none" and self.dist.world == 1:
            log.warning("sharding=%s in one process: there is nothing to shard over (start it under torchrun, e.g. "
                        "`torchrun --nproc_per_node 8 --no-python solrl train ...`); every weight stays whole here",
                        cfg.sharding)  # fmt: skip
        self.progress = progress and self.dist.main
        # the run resolved once for this machine before any weight loads (rl/runtime.resolve): the update's micro-batch
        # and recompute from this device's memory (auto), the explore pass as it can resolve, the memory plan checked;
        # config.json and checkpoints record the resolved values
        self.plan = resolve(cfg, Target.here(cfg, self.dist.world))
        self.cfg = cfg = self.plan.cfg
        log.info("update sizes: train_batch_size %s, gradient_checkpointing %s (%s)", cfg.train_batch_size,
                 cfg.gradient_checkpointing, self.plan.sizes.reason)  # fmt: skip
        self.plan.check()
        if self.plan.memory is not None and staged(cfg, self.dist.world):  # before any rank loads the base
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world))
            if (short := host_shortfall(self.plan.memory, ranks_here, host_memory_available_gib())) is not None:
                log.warning("host memory: %s", short)
        self.rollouts = build_rollouts(cfg, self.plan)
        self.model, self.device, self.dtype = self.rollouts.model, self.rollouts.device, self.rollouts.dtype
        # like-for-like: with merge_lora, full-precision rollouts run the "old" LoRA merged into a copy of the
        # policy at its own precision, as the quantized copy has it (not PEFT's unmerged branches)
        # (full fine-tuning: the policy samples with its old weights swapped in, already merged)
        # (sharding=fsdp: the policy samples itself, its LoRA unmerged: a merged copy would be a whole second copy)
        lora, sharded = cfg.train_mode == "lora", cfg.sharding != "none"
        merged = cfg.merge_lora and lora and not sharded
        self.policy_copy = ExploreCopy(self.model.transformer, POLICY, borrow=True) if merged else None
        self._explore_as(None)  # the explore pass planned (auto: timed, rank 0's answer) and its copy built
        if cfg.context_parallel > 1:  # every forward's tokens split over groups of ranks, on the policy and its copies
            copies = [c.transformer for c in (self.policy_copy, self.explore) if c is not None]
            try:
                mode = resolve_mode(self.model.transformer, cfg.context_parallel, cfg.context_parallel_mode,
                                    self.device, getattr(self.model, "tokens_per_sample", None))  # fmt: skip
            except ValueError as e:
                raise ConfigError(f"config {cfg.name!r}: {e}") from None
            split_context([self.model.transformer, *copies], self.dist, cfg.context_parallel, mode, self.device)
        self.reward = self.rollouts.reward
        # fail early: every training and held-out prompt the reward could reject, and the reward itself on one image
        if (check := getattr(self.reward, "check_prompts", None)) is not None:
            check(self.train_prompts + self.eval_prompts + self.eval_train_prompts)
        self.reward(torch.zeros(1, 3, 8, 8), self.train_prompts[:1])
        self.adapters = self._trained_weights()  # LoRA adapters, or every weight (train_mode=full)
        # full fine-tuning swaps the policy's weight sets (rl/full.py): its own rollouts are never captured
        # (sharding=fsdp: its forwards gather weights block by block, which a captured graph cannot hold)
        self.rollouts.sampler.eager_policy = cfg.train_mode == "full" or sharded
        # sharded full fine-tuning gathers FP32 weights block by block: no cached BF16 casts of them (hw.autocast_for)
        self.rollouts.autocast_cache = not (sharded and not lora)
        sizing.recompute_blocks(self.model.transformer, self.rollouts.spec.repeated_blocks, cfg.gradient_checkpointing)
        self.update_census: Census | None = None  # the compiled update's graphs (compiled_update)
        self.compiled_update = self._compiled_update()
        staging = staged(cfg, self.dist.world)  # the base on the CPU until sharding moves it (rl/runtime.staged)
        if not staging and (lora or not sharded):  # (sharded full fine-tuning and a staged start-up follow below)
            self._follow_explore()
        if sharded:  # after the explore copy is built from the whole base weights (attached to them unless staged)
            # LoRA: the base sharded, the adapters left whole; full fine-tuning: every (FP32 trained) weight sharded
            keep = self.adapters.params(TRAIN) + self.adapters.params(OLD) if lora else []
            group = (cfg.shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world))
                     if cfg.sharding == "hsdp" else 0)  # fmt: skip
            blocks = shard_policy(self.model.transformer, self.rollouts.spec.repeated_blocks, keep, self.dist,
                                  self.device, upcast=not lora, group=group)  # fmt: skip
            if staging:  # the base was loaded on the CPU: FSDP2 moved the blocks it sharded
                held = [c.transformer for c in (self.explore, self.policy_copy) if c is not None]
                ema = list(self.adapters.ema)  # (the LoRA matrices it left out, their EMA, and any stray buffer)
                moved = settle_([self.model.transformer, *held], self.device, ema)
                self.adapters.ema[:] = ema
                log.info("staged start-up: the base loaded on the CPU and moved to %s a block at a time as it was "
                         "sharded; %d tensors left out of FSDP2 moved after", self.device, moved)  # fmt: skip
            if cfg.explore_sharding == "shard" and self.explore is not None and self.dist.world > 1:
                split = ShardedCopy(self.explore.transformer, self.rollouts.spec.repeated_blocks, self.dist)
                self.explore.whole_blocks = split.whole  # (its refresh gathers the blocks it rewrites)
                log.info("explore_sharding=shard: the explore copy's %d blocks over %d ranks; this rank holds %.1f of "
                         "%.1f MiB of them", len(split.blocks), self.dist.world, split.local_bytes / 2**20,
                         split.whole_bytes / 2**20)  # fmt: skip
            if not lora:
                self.adapters.shard()  # its weight sets made as this rank's shards
            if staging or not lora:  # the copies refreshed from the sharded policy, gathered a weight at a time on
                self._follow_explore()  # the device (a staged LoRA run's first merge would otherwise run on the CPU)
            local, full = sharded_bytes(self.model.transformer)
            over = f"groups of {group} of the {self.dist.world} ranks" if group else f"{self.dist.world} ranks"
            log.info("sharding=%s: %d blocks over %s; this rank holds %.1f of %.1f MiB of %s weights", cfg.sharding,
                     blocks, over, local / 2**20, full / 2**20, "base" if lora else "trained")  # fmt: skip
        self.opt = torch.optim.AdamW(self.adapters.params(TRAIN), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.objective = objective(cfg.objective)  # the loss the update optimizes (rl/objectives/)
        self.update_settings = self.plan.update  # what its update reads of the config
        self.prompt_sampler = PromptSampler(self.train_prompts, cfg.seed)
        self.seed_rng = random.Random(cfg.seed + 1)
        self.gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.iteration = 0
        self.heldout = HeldOut(self.out, self.rollouts, self.adapters, self.dist, self.eval_prompts,
                               self.eval_train_prompts, cfg.eval_seeds)  # fmt: skip
        self.tracker: Tracker | None = None
        self.nonfinite = 0  # iterations whose update was skipped for non-finite values
        self.guard = ProxyGuard(cfg)
        self.signals = rundir.StopSignals()  # installed while `run` runs

    def _trained_weights(self) -> TrainedWeights:
        """What the update trains: LoRA adapters on the frozen base (in FP32; the base stays in the policy
        dtype), or with train_mode=full every transformer weight (rl.full.FullWeights, FP32 too)."""
        cfg = self.cfg
        if cfg.train_mode == "full":
            if hasattr(self.model.transformer, "split_lora"):
                raise ConfigError(f"config {cfg.name!r}: train_mode=full on a two-expert model ({cfg.model_path}: "
                                  "Wan2.2-A14B's experts) is not wired (its export would be two transformers): train "
                                  "LoRA on them (train_mode=lora, lora_experts=both|high|low)")  # fmt: skip
            return FullWeights(self.model.transformer, sharded=cfg.sharding != "none")
        spec = self.rollouts.spec
        targets = spec.lora_targets if cfg.lora_targets is None else cfg.lora_targets
        with torch.random.fork_rng(devices=[]):  # the LoRA init depends on cfg.seed only
            torch.manual_seed(cfg.seed)
            adapters = LoraAdapters(self.model.transformer, cfg.lora_rank, cfg.lora_alpha, targets)
        for p in adapters.params(TRAIN) + adapters.params(OLD):
            p.data = p.data.float()  # LoRA and its optimizer state in FP32; the base stays in policy dtype
        adapters.ema = [e.float() for e in adapters.ema]
        return adapters

    def _compiled_update(self) -> CompiledBlocks | None:
        """The policy's repeated blocks compiled for the update's gradient micro-batches (compiled_update; None: on
        with CUDA for LoRA runs that are not sharded), else None: the update runs eagerly."""
        cfg, on_gpu = self.cfg, self.device.type == "cuda"
        eligible = cfg.train_mode == "lora" and cfg.sharding == "none" and cfg.context_parallel == 1
        if not (cfg.compiled_update if cfg.compiled_update is not None else on_gpu and eligible):
            return None
        if not on_gpu and not (ok := cpu_compile_available())[0]:
            log.warning("compiled_update: %s; the update runs eagerly", ok[1])
            return None
        blocks = repeated_blocks(self.model.transformer, self.rollouts.spec.repeated_blocks)
        if not blocks:
            return None
        self.update_census = Census()
        log.info("compiled update: %d repeated blocks (%s), forward and backward", len(blocks),
                 ", ".join(sorted({type(b).__name__ for b in blocks})))  # fmt: skip
        return CompiledBlocks(blocks, census_backend(self.update_census, cfg.compile_mode))

    def _explore_as(self, choice: ExploreChoice | None) -> None:
        """Plan the explore pass (auto: timed, rank 0's answer; `choice`: a checkpoint's instead) and build
        the explorer over its copy, else over the policy (rl.runtime.explorer_for)."""
        self.explorer = explorer_for(self.cfg, self.rollouts, agree=self.dist.broadcast_object, choice=choice)
        self.explore_spec: ExploreSpec | None = self.explorer.spec
        self.explore: ExploreCopy | None = self.explorer.copy

    def _follow_explore(self) -> None:
        """Attach the explore copy (if any) and the merged policy copy (merge_lora) to the policy's
        adapters, and point the explorer at the explore copy, else at the merged policy copy."""
        if self.explore is not None:
            self.explore.attach(self.adapters, merge=self.cfg.merge_lora)
        if self.policy_copy is not None:
            self.policy_copy.attach(self.adapters)
        if self.explore is None and self.policy_copy is not None:  # the policy explores: as a merged copy
            self.explorer.transformer, self.explorer.tag = self.policy_copy.transformer, "old-merged"

    @property
    def rollout_form(self) -> str:
        """How the "old" adapter is applied where the policy samples at full precision: "merged" (a copy
        with the LoRA merged, as the quantized copy has it), "unmerged" (PEFT's LoRA branches) or "full" (full
        fine-tuning: the old weights swapped in)."""
        if self.cfg.train_mode == "full":
            return "full"  # the old weights themselves, swapped in
        return "merged" if self.policy_copy is not None else "unmerged"

    # --- rollouts ----------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        return self.rollouts.autocast()

    def _sample(
        self, cond: Conditioning, seeds: list[int], steps: int, transformer: Any = None, tag: str = OLD,
        couple: Coupling | None = None,
    ) -> torch.Tensor:
        """Rollouts of the policy (`tag` = its active adapter) or of the explore copy."""
        return self.rollouts.sample(cond, seeds, steps, transformer=transformer, tag=tag, couple=couple)

    def _policy_rollout(self) -> tuple[Any, str]:
        """(transformer, tag) of the policy's full-precision rollouts: the merged copy, else the policy."""
        return (self.policy_copy.transformer, "old-merged") if self.policy_copy is not None else (None, OLD)

    def _refresh_copies(self) -> None:
        for copy in (self.explore, self.policy_copy):
            if copy is not None:
                copy.refresh(self.adapters)

    def _score(self, x0: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        scored = self.rollouts.score(x0, prompts)
        return scored.rewards, scored.components

    # --- one iteration -----------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        """One iteration; non-finite values skip its update (nonfinite_policy=skip) or raise."""
        t0 = time.perf_counter()
        try:
            return self._step()
        except NonFiniteError as e:
            self.opt.zero_grad(set_to_none=True)
            if self.cfg.nonfinite_policy == "abort":
                raise
            self.iteration += 1
            self.nonfinite += 1
            log.warning("iteration %d: %s; its update is skipped (nonfinite_policy=skip)", self.iteration, e)
            return {"iter": self.iteration, "family": self.cfg.family, "skipped": str(e),
                    "nonfinite_skipped": self.nonfinite, "time_total_s": time.perf_counter() - t0}  # fmt: skip

    def _step(self) -> dict[str, Any]:
        c, rule, dist = self.cfg, self.rule, self.dist
        st = self.rollouts.sampler.stats  # one-off compile/capture seconds, kept out of the phase times
        t0, o0 = time.perf_counter(), st.overhead_s
        # every rank draws the global prompts and seeds (the run depends on `seed`, not the world
        # size) and takes its contiguous share: all N seeds of a prompt stay on one rank
        all_prompts = self.prompt_sampler.next(c.prompts_per_iter)
        all_seeds = [[self.seed_rng.randrange(2**31) for _ in range(c.n)] for _ in all_prompts]
        mine = dist.shard(len(all_prompts))
        prompts, seeds = all_prompts[mine], all_seeds[mine]
        cond = self.rollouts.encode(prompts)
        # an SDE objective (Flow-GRPO) trains on its own SDE's states: the steps it runs on, drawn for this iteration
        window = rollout_window(c, self.gen)

        # 1. explore: N seeds per prompt, quantized previews (sol_rl, naive_quant) or the BF16 policy,
        # 2. and select the top K/2 and bottom K/2 seeds by (proxy) reward: the public Explorer's path
        # (with a served reward, sol_rl runs 1-3 in two halves of the prompts: `_explore_in_halves`)
        with self.adapters.using(OLD):  # the policy explores with its "old" adapter when it explores
            # (a family that trains on what it explored explores with the objective's sampler)
            sel, explored, regens = self._explore(prompts, seeds, cond, window)
        r_all, idx, proxy = sel.all_rewards, sel.index, sel.proxy_rewards
        totals_all = explored.totals  # the weighted sums (what the metrics report; r_all ranks)
        flat_all = [p for p in prompts for _ in range(c.n)]
        check_finite("explore rewards", r_all.flatten(), flat_all, [x for row in seeds for x in row], dist)
        comps = {k: v.gather(1, idx.cpu()).to(self.device) for k, v in explored.components.items()}
        sel_cond = cond.repeat_interleave(c.k)
        reward_time = explored.reward_time  # the previews' reward seconds, hidden and exposed
        t1, o1 = time.perf_counter(), st.overhead_s

        # 3. regenerate the selected seeds in BF16 at the full step budget (sol_rl only), with the objective's sampler
        trace = sel.trace  # an SDE objective's rollout states (the explored ones, where the family trains on them)
        if rule.regenerate:
            with self.adapters.using(OLD):  # scored batch by batch while the next is sampled, where scoring overlaps
                regens = regens or [self._start_regen(sel, sel_cond, window)]
                done = [(*r.pending.result(), r.states) for r in regens]
            x0, scored = torch.cat([d[0] for d in done]), Scored.join([d[1] for d in done])
            trace = torch.cat([t for d in done for t in d[2]]) if window is not None else None
            for r in regens:
                reward_time = {k: v + r.pending.reward_time[k] for k, v in reward_time.items()}
            check_finite("regenerated latents", x0, sel.flat_prompts, sel.flat_seeds, dist)
            rewards, comps = scored.rewards, scored.components
            check_finite("rewards of the regenerated samples", rewards, sel.flat_prompts, sel.flat_seeds, dist)
            comps = {k: v.view(len(prompts), c.k).to(self.device) for k, v in comps.items()}
            value = getattr(self.rollouts.reward, "group_value", None)  # reward_combine: ranks and trains on this
            totals = rewards.view(len(prompts), c.k)
            rewards = value(totals, comps).to(totals.device) if value is not None else totals
        else:
            x0, rewards, totals = sel.samples, proxy, totals_all.gather(1, idx.to(totals_all.device))
            check_finite("explored latents", x0, sel.flat_prompts, sel.flat_seeds, dist)
        t2, o2 = time.perf_counter(), st.overhead_s

        # 4. update the policy on the selected samples, advantages from the (BF16) rewards of every
        #    rank: grouped by prompt text, divided by the global std
        g_rewards, g_proxy = dist.gather_rows(rewards), dist.gather_rows(proxy)
        proxy_stats = rule.regenerate  # previews (quantized, or the policy's own at preview_steps) vs regenerations
        guard = self._guard(g_proxy, g_rewards, sel, cond, window) if proxy_stats else {}  # before the copy moves on
        adv = group_advantages(g_rewards, c.adv_clip, prompts=all_prompts)[mine].flatten()
        batch = UpdateBatch(x0, sel_cond, adv, self.rollouts.training_sigmas(), self.gen, len(all_prompts) * c.k,
                            mine.start * c.k, self.iteration, sel, trace, window, self.rollouts.uncond(),
                            self.rollouts.cfg_guidance)  # fmt: skip
        # the old and reference policies' predictions first, in large no-grad batches as the rollouts run them
        old_copy = self.policy_copy.transformer if self.policy_copy is not None else None
        predict = fixed_predictions(self.rollouts, self.adapters, old_copy)
        blocks = self.compiled_update.active if self.compiled_update is not None else None  # compiled, or eager
        stats = self.objective.update(self.model, self.adapters, self.opt, batch, self.update_settings, dist,
                                      self._autocast, predict, blocks)  # fmt: skip

        # 5. refresh the explore copy (and the merged policy copy) with the new "old" policy, in place
        self._refresh_copies()
        t3, o3 = time.perf_counter(), st.overhead_s

        self.iteration += 1
        g_r_all, g_totals = dist.gather_rows(totals_all.to(self.device)), dist.gather_rows(totals.to(self.device))
        g_comps = {k: dist.gather_rows(v) for k, v in comps.items()}
        g_sel = dist.gather_rows(torch.tensor(sel.seeds, dtype=torch.int64, device=self.device))
        m: dict[str, Any] = {
            "iter": self.iteration,
            "family": c.family,
            "objective": c.objective,
            "reward_mean": g_totals.mean().item(),
            "reward_std": g_totals.std().item(),
            **({f"reward_{k}_mean": v.mean().item() for k, v in g_comps.items()} if len(g_comps) > 1 else {}),
            "explore_reward_mean": g_r_all.mean().item(),
            "proxy_reward_mean": g_proxy.mean().item() if rule.quantized_explore else None,
            "proxy_spearman": spearman(g_proxy, g_rewards).mean().item() if proxy_stats else None,
            "proxy_kendall": kendall(g_proxy, g_rewards).mean().item() if proxy_stats else None,
            "selection_digest": hashlib.sha1(g_sel.cpu().numpy().tobytes()).hexdigest()[:16],
            "nonfinite_skipped": self.nonfinite,
            **guard,
            "world_size": dist.world,
            # without compilation / graph capture, which time_compile_s reports in the iterations that had any
            "time_explore_s": t1 - t0 - (o1 - o0) - explored.regen_s,
            "time_regen_s": t2 - t1 - (o2 - o1) + explored.regen_s,
            "time_train_s": t3 - t2 - (o3 - o2),
            "time_total_s": t3 - t0 - (o3 - o0),
            # reward seconds of the explore and the regeneration: scored while the next batch was sampled (a
            # reward server), and waited for after the sampling
            "time_reward_hidden_s": reward_time["hidden_s"],
            "time_reward_exposed_s": reward_time["exposed_s"],
            **({"time_compile_s": o3 - o0} if o3 > o0 else {}),
            **stats,
        }
        return m

    def _explore(self, prompts: list[str], seeds: list[list[int]], cond: Conditioning, window: tuple[int, int] | None
                 ) -> tuple[Selection, Explored, list[Regen]]:  # fmt: skip
        """The explore and the selection: the Selection, what it scored, and the regenerations already started
        (`_explore_in_halves`; none here)."""
        rule = self.rule
        if rule.regenerate and self.rollouts.overlaps and len(prompts) > 1:
            return self._explore_in_halves(prompts, seeds, cond, window)
        sel = self.explorer.select(prompts, seeds, cond=cond, keep_samples=not rule.regenerate, nonfinite="defer",
                                   window=None if rule.regenerate else window,
                                   couple=preview_coupling(self.cfg, window))  # fmt: skip
        ex = self.explorer
        return sel, Explored(ex.last_totals, ex.last_components, dict(self.rollouts.reward_time)), []

    def _explore_in_halves(self, prompts: list[str], seeds: list[list[int]], cond: Conditioning,
                           window: tuple[int, int] | None) -> tuple[Selection, Explored, list[Regen]]:  # fmt: skip
        """With a served reward, Sol-RL's explore and regeneration in two halves of the prompts, so that every
        phase's last scores arrive while something else is sampled: the second half's previews hide the first's
        last scores, the first half's regeneration the second's, the second half's regeneration the first's. Each
        prompt's selection and rollouts are its own, so the samples and rewards are those of the whole-batch order
        (a batch of fewer rows computes each row as a full one does: tested)."""
        h = (len(prompts) + 1) // 2
        first, second = slice(0, h), slice(h, len(prompts))
        kw: dict[str, Any] = dict(keep_samples=False, nonfinite="defer", couple=preview_coupling(self.cfg, window))
        ex = self.explorer
        a = ex.start(prompts[first], seeds[first], cond=cond[first], **kw)
        b = ex.start(prompts[second], seeds[second], cond=cond[second], **kw)  # hides a's last scores
        sel_a = a.finish()
        totals, comps = [ex.last_totals], [ex.last_components]  # each finish() overwrites them
        st = self.rollouts.sampler.stats  # (compile seconds stay out of phase times: `_step`)
        t, o = time.perf_counter(), st.overhead_s
        regens = [self._start_regen(sel_a, cond[first].repeat_interleave(self.cfg.k), window)]  # hides b's
        regen_s = time.perf_counter() - t - (st.overhead_s - o)
        sel_b = b.finish()
        totals.append(ex.last_totals)
        comps.append(ex.last_components)
        t, o = time.perf_counter(), st.overhead_s
        regens.append(self._start_regen(sel_b, cond[second].repeat_interleave(self.cfg.k), window))  # hides a's
        regen_s += time.perf_counter() - t - (st.overhead_s - o)
        reward_time = {k: a.pending.reward_time[k] + b.pending.reward_time[k] for k in ("hidden_s", "exposed_s")}
        explored = Explored(torch.cat(totals), {k: torch.cat([c[k] for c in comps]) for k in comps[0]}, reward_time,
                            regen_s)  # fmt: skip
        return Selection.join([sel_a, sel_b]), explored, regens

    def _start_regen(self, sel: Selection, sel_cond: Conditioning, window: tuple[int, int] | None) -> Regen:
        """Sample `sel`'s seeds with the policy at the full step budget (the objective's sampler); scores may be
        in flight (Rollouts.start_scored)."""
        states: list[torch.Tensor] | None = [] if window is not None else None
        pending = self.rollouts.start_scored(sel_cond, sel.flat_prompts, sel.flat_seeds, self.cfg.full_steps,
                                             *self._policy_rollout(), window, states)  # fmt: skip
        return Regen(pending, states or [])

    def _guard(self, g_proxy: torch.Tensor, g_rewards: torch.Tensor, sel: Any, cond: Conditioning,
               window: tuple[int, int] | None) -> dict[str, Any]:  # fmt: skip
        """The proxy-drift guard's view of this iteration (guards.ProxyGuard). While it has exploration
        in full precision, the quantized proxy is still measured on the selected seeds (as the previews sample them:
        `window` couples SDE previews), so it can recover."""
        c = self.cfg
        if self.guard.fallback:
            copy, tag = (self.explore.transformer, "explore") if self.explore is not None else self._policy_rollout()
            with torch.no_grad():
                x = self._sample(cond.repeat_interleave(c.k), sel.flat_seeds, c.preview_steps, copy, tag,
                                 preview_coupling(c, window))  # fmt: skip
                g_proxy = self.dist.gather_rows(self._score(x, sel.flat_prompts)[0].view(len(sel.prompts), c.k))
        rho = spearman(g_proxy, g_rewards).mean().item()
        mean, event = self.guard.update(rho)
        if event in ("recovered",) or (event or "").startswith("fallback"):
            self._set_fallback(self.guard.fallback)
        return {"proxy_spearman": rho, "proxy_window_mean": mean, "explore_mode": self.guard.mode, "proxy_guard": event}

    def _set_fallback(self, on: bool) -> None:
        """Point the explorer at full steps or at the policy (on), or back at the family's own explore."""
        c, quantized = self.cfg, self.explore is not None
        bf16 = on and c.proxy_fallback == "bf16"
        self.explorer.steps = c.full_steps if on or not self.rule.preview else c.preview_steps
        if quantized and not bf16:
            self.explorer.transformer, self.explorer.tag = self.explore.transformer, "explore"
        else:
            self.explorer.transformer, self.explorer.tag = self._policy_rollout()

    # --- evaluation, checkpoints, the loop ---------------------------------------------------------

    def evaluate(self) -> float:
        """The held-out evaluation of the EMA adapter now (rl.heldout.HeldOut.evaluate)."""
        return self.heldout.evaluate(self.iteration, self.tracker)

    # the held-out curves, read by benches and tests
    evals = property(lambda self: self.heldout.evals)
    train_evals = property(lambda self: self.heldout.train_evals)
    eval_base = property(lambda self: self.heldout.eval_base)
    gains = property(lambda self: self.heldout.gains)
    best = property(lambda self: self.heldout.best)

    def _state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            # a sharded full fine-tuning run's weight sets and AdamW state: torch.distributed.checkpoint's files
            **({"sharded": "dcp", "sharded_opt": bool(self.opt.state)} if self.adapters.collective_io else
               {"adapters": self.adapters.state_dict(), "opt": self.opt.state_dict()}),
            "prompts": self.prompt_sampler.state(),
            "seed_rng": self.seed_rng.getstate(),
            "gen": self.gen.get_state(),
            **self.heldout.state(),  # evals, train_evals, eval_base, gains, best
            "config": dataclasses.asdict(self.cfg),
            "world_size": self.dist.world,
            "nonfinite": self.nonfinite,
            "proxy_guard": self.guard.state(),
            # explore_precision=auto is timed at start: a resumed run keeps the choice it was made with
            "explore_precision": self.explore_spec.precision if self.explore_spec is not None else None,
        }

    def _restore(self, st: dict[str, Any], path: Path | None = None) -> None:
        """Continue from a checkpoint; a config that would change what comes next is refused, naming
        what differs. A different world size is fine: the run does not depend on it."""
        then_cfg = dict(st.get("config", {}))
        if then_cfg.get("explore_precision") == "auto" and self.cfg.explore_precision == st.get("explore_precision"):
            then_cfg["explore_precision"] = self.cfg.explore_precision  # auto's recorded choice, now set explicitly
        check_resume_config(then_cfg, self.cfg)
        changed = {k: (then_cfg[k], getattr(self.cfg, k)) for k in ("train_batch_size", "gradient_checkpointing")
                   if k in then_cfg and then_cfg[k] != getattr(self.cfg, k)}  # fmt: skip
        if changed:  # re-resolved for this device: memory and speed change, not the result
            now, then = (", ".join(f"{k}={v[i]}" for k, v in changed.items()) for i in (1, 0))
            log.info("resuming with %s (the checkpoint ran with %s)", now, then)
        self.iteration = st["iteration"]
        if st.get("sharded") == "dcp":  # every rank reads its shards (any rank count: DCP reshards)
            sd = self.adapters.sharded_state(self.opt, with_opt=st.get("sharded_opt", True))
            checkpoint.load_shards(path, sd, self.dist)
            self.adapters.load_sharded_state(self.opt, sd)
        else:
            self.adapters.load_state_dict(st["adapters"])
            self.opt.load_state_dict(st["opt"])
        self.prompt_sampler.load_state(st["prompts"])
        self.seed_rng.setstate(st["seed_rng"])
        self.gen.set_state(st["gen"])
        self.heldout.load_state(st)
        self.nonfinite = st.get("nonfinite", 0)
        self.guard.load_state(st["proxy_guard"])
        then, now = st.get("explore_precision"), self.explore_spec
        if then is not None and now is not None and then != now.precision:
            # the copy was built from the whole base, before sharding (or before the context-parallel split)
            if (self.dist.sharded and self.dist.world > 1) or self.cfg.context_parallel > 1:
                raise ConfigError(f"cannot resume: the checkpoint explored in {then}, this start's "
                                  f"explore_precision=auto chose {now.precision}, and a sharded or context-parallel "
                                  f"run cannot rebuild its explore copy: resume with --set explore_precision={then}")
            log.info("resuming with the checkpoint's explore precision %s (this start chose %s)", then, now.precision)
            why = "the checkpoint's (explore_precision=auto, timed at its start)"
            # built from the base as loaded (full fine-tuning: not its FP32 trained set), then refreshed below
            with self.adapters.using(REF) if self.cfg.train_mode == "full" else contextlib.nullcontext():
                self._explore_as(ExploreChoice(then, why))
            self._follow_explore()
        if self.guard.fallback:
            self._set_fallback(True)
        self._refresh_copies()

    def _checkpoint_bytes(self) -> int:
        """About the size of one checkpoint: the trained weights, their EMA and old copies and AdamW's two
        moments, in FP32 (sharded full fine-tuning: every rank's shards)."""
        trained = sum(local(p).numel() for p in self.adapters.params(TRAIN))
        return 5 * 4 * trained * (self.dist.world if self.adapters.collective_io else 1) + 2**20

    def _checkpoint(self, main: bool) -> None:
        """Write a checkpoint and the exported adapters; never from a poisoned (non-finite) state."""
        bad = not all(bool(torch.isfinite(local(p)).all()) for p in self.adapters.params(TRAIN) + self.adapters.ema)
        if self.dist.sharded:  # each rank sees its shards only: all agree before any collective below
            bad = bool(self.dist.sum_(torch.tensor([float(bad)], device=self.device)).item())
        if bad:
            last = checkpoint.latest(self.out / "checkpoints")
            kept = f"the last good checkpoint, {last}, stays" if last else "no checkpoint of this run was written yet"
            raise NonFiniteError("the adapters", f"refusing to checkpoint them; {kept} (lr is {self.cfg.lr})")
        root = self.out / "checkpoints"
        if self.adapters.collective_io:  # sharded full fine-tuning: every rank writes its shards, rank 0 the rest
            shards = self.adapters.sharded_state(self.opt, with_opt=bool(self.opt.state))
            checkpoint.save_sharded(root, self.iteration, self._state() if main else {}, self.cfg.keep_checkpoints,
                                    self.dist, shards)  # fmt: skip
        elif main:
            checkpoint.save(root, self.iteration, self._state(), self.cfg.keep_checkpoints)
        self.export()
        self.dist.barrier()

    def export(self) -> None:
        """The trained weights and their EMA as the stock pipeline loads them: diffusers LoRA directories
        OUT/lora and OUT/lora_ema, or (train_mode=full) whole transformers OUT/transformer, OUT/transformer_ema.
        Every rank may call it: rank 0 writes, and the others take part only where saving gathers (collective_io)."""
        if not (self.dist.main or self.adapters.collective_io):
            return
        pipeline, (trained, ema, _) = self.rollouts.spec.pipeline, EXPORT_DIRS[self.cfg.train_mode]
        write = self.dist.main
        save_trained(self.adapters, self.out / trained, pipeline, write=write)
        save_trained(self.adapters, self.out / ema, pipeline, ema=True, write=write)

    def run(self, resume: bool = False, overwrite: bool = False, auto_resume: bool = False) -> dict[str, Any]:
        """Train for cfg.iterations. `resume`: from the newest checkpoint that verifies (none: NothingToResume,
        nothing changed); `overwrite`: a new run, the old one moved aside once the start is validated;
        `auto_resume`: whichever applies. Rank 0 holds OUT's lock throughout (rundir.hold). SIGINT, SIGTERM
        and SIGHUP stop after the current iteration with a checkpoint (summary["stopped_by"])."""
        mode = rundir.start_mode(resume, overwrite, auto_resume)
        lock, verdict = contextlib.ExitStack(), None
        if self.dist.main:  # rank 0 takes the lock and checks the start; every rank learns the outcome
            try:
                lock.enter_context(rundir.hold(self.out))
                verdict = ("start", rundir.check_start(self.out, mode))
                # room for this run's checkpoints (a new run: two of them) before the first write, not hours in
                rundir.check_room(self.out, (1 if verdict[1] == "resume" else 2) * self._checkpoint_bytes())
            except Exception as e:  # raised on every rank below, so none waits for a collective that never comes
                verdict = ("refused", e)
        verdict = self.dist.broadcast_object(verdict)
        if verdict[0] == "refused":
            lock.close()
            raise verdict[1]
        with lock, self.signals:
            return self._run(verdict[1])

    def _run(self, mode: str) -> dict[str, Any]:
        c, main = self.cfg, self.dist.main  # rank 0 alone writes; every rank computes
        metrics_path = self.out / "metrics.jsonl"
        history: list[dict[str, Any]] = []
        # the newest checkpoint that verifies (damaged ones are named and skipped), the same on every rank,
        # restored (its config checked) before anything in OUT is written
        ck = checkpoint.resume_point(self.out / "checkpoints", self.dist) if mode == "resume" else None
        if ck is not None:
            self._restore(checkpoint.load(ck), ck)
            history, cut = rundir.read_log(metrics_path, self.iteration, keep_aside=main)  # later records go
            self.dist.barrier()  # every rank has read it before rank 0 rewrites it
            damaged = rundir.damaged_exports(self.out)  # exports are made from the checkpoint's state
            self.dist.barrier()  # every rank has looked before rank 0 writes them again
            if main:
                rundir.mark(self.out)  # a run made before the marker gets it
                if cut:
                    log.warning("%s: cut back to iteration %d, the checkpoint's: dropped %s", metrics_path,
                                self.iteration, cut)  # fmt: skip
                write_atomic(metrics_path, "".join(json.dumps(h) + "\n" for h in history))
            if damaged:
                self.export()
            log.info("resumed from %s at iteration %d", ck, self.iteration)
        elif main:
            if mode == "overwrite":
                rundir.move_aside(self.out)
            rundir.mark(self.out)
            write_atomic(metrics_path, "")
            write_atomic(self.out / "config.json", json.dumps(dataclasses.asdict(c), indent=2))
        if main and self.explore is not None:  # why each layer of the explore copy was or was not quantized
            fused = self.explore.producers.summary() if self.explore.producers is not None else ""
            text = str(self.explore.report) + (f"\n{fused}" if fused else "")
            write_atomic(self.out / "quantization.txt", text + "\n")
        self.dist.barrier()
        self.tracker = Tracker(self.out, c.log_with if main else (), c.name, dataclasses.asdict(c),
                               purge_step=self.iteration + 1 if ck is not None else None)  # fmt: skip
        if ck is None:
            self.evaluate()
        bar = tqdm(total=c.iterations, initial=self.iteration, disable=not self.progress, desc=c.name)
        while self.iteration < c.iterations:
            self.signals.iteration = self.iteration  # what a second Ctrl-C reports
            m = self.step()
            if self.iteration % c.eval_every == 0 or self.iteration == c.iterations:
                m["heldout_reward"] = self.evaluate()
                m.update(self.heldout.last())
            history.append(m)
            if main:
                with os.fdopen(open_append(metrics_path), "a") as f:  # a link there is refused, never followed
                    f.write(json.dumps(m) + "\n")
                self.tracker.log(m, self.iteration)
                self.heldout.plot(history, c.name, c.reward)
            stop = self.signals.requested(self.dist, self.device)
            if self.iteration % c.save_every == 0 or self.iteration == c.iterations or stop:
                self._checkpoint(main)
            bar.update(1)
            if "reward_mean" in m:
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", heldout=f"{self.evals[-1][1]:.3f}")
            if stop:
                log.warning("stopped at iteration %d; `--resume` continues from here", self.iteration)
                break
        bar.close()
        trained, ema, _ = EXPORT_DIRS[c.train_mode]
        missing = not (self.out / trained).exists()  # e.g. resumed at the end: still exported
        self.dist.barrier()
        if missing:
            self.export()
        if self.dist.sharded:  # a late signal may have reached some ranks only: they agree before the picture
            self.signals.requested(self.dist, self.device)
        compare, stopped = None, self.signals.name
        # the before/after picture; a stopped run leaves at once (sharded: every rank samples it, rank 0 draws it)
        if (main or self.dist.sharded) and not stopped:
            compare = self.heldout.compare(c.name, self.iteration, self.tracker)
        self.tracker.close()
        summary = {
            "name": c.name,
            "family": c.family,
            "iterations": self.iteration,
            **self.heldout.summary(),  # the held-out curve's start, end and paired gain; the training prompts'
            "train_mode": c.train_mode,
            trained: str(self.out / trained),  # "lora" and "lora_ema", or "transformer" and "transformer_ema"
            ema: str(self.out / ema),
            "compare_png": None if compare is None else str(compare),  # base vs EMA adapter, side by side
            **self.heldout.best_summary(),  # the EMA adapter of the best held-out evaluation, OUT/lora_best
            "explore_recipe": self.explorer.recipe_label,
            "rollout_form": self.rollout_form,  # the "old" LoRA merged into a copy, or PEFT's branches
            "mean_time_total_s": sum(h["time_total_s"] for h in history) / max(1, len(history)),
            # one-off sampler compilation (CPU: inductor) or graph capture (GPU), out of the times above
            "time_compile_s": self.rollouts.sampler.stats.overhead_s,
            # what the compiled graphs compute their GEMMs with (quantized layers traced, or opaque ops)
            "compile_census": self.rollouts.sampler.stats.census.to_dict(),
            "nonfinite_skipped": self.nonfinite,
            "stopped_early": self.iteration < c.iterations,
            "stopped_by": stopped,  # the signal that stopped the run (None: it ran to the end)
        }
        if main:
            write_atomic(self.out / "summary.json", json_text(summary))  # strict JSON: a NaN is null
        self.dist.barrier()
        return summary
