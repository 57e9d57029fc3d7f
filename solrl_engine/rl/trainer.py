"""The one RL trainer for every model and family.

Each iteration reads top to bottom as the method does: explore N seeds per prompt (quantized
previews for sol_rl), select the top K/2 and bottom K/2, regenerate those seeds in BF16, score them,
update the policy with the DiffusionNFT loss, refresh the explore copy. Families differ only in
which precision and step count explore uses and whether selection or regeneration happens.

No process-global state: prompts, seeds and noise come from generators owned by the trainer and
saved in its checkpoints, so prompts can later be sharded across ranks (all N seeds of a prompt on
one rank; pass the gathered rewards to `group_advantages` for the global std).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from solrl_engine.data import load_prompts
from solrl_engine.models import load_model
from solrl_engine.models.base import Conditioning
from solrl_engine.rewards import load_reward
from solrl_engine.rl import checkpoint
from solrl_engine.rl.adapters import OLD, TRAIN, LoraAdapters
from solrl_engine.rl.config import RLConfig, autocast_for, resolve_runtime
from solrl_engine.rl.explore import ExploreCopy, resolve_explore_recipe
from solrl_engine.rl.loss import nft_loss
from solrl_engine.rl.ranking import group_advantages, kendall, select_contrastive, spearman
from solrl_engine.sampling import GraphedSampler, sigma_schedule
from solrl_engine.viz import image_grid, line_plot

log = logging.getLogger("solrl_engine.rl")


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


def _repeat(cond: Conditioning, n: int) -> Conditioning:
    return Conditioning(cond.hidden.repeat_interleave(n, 0), cond.pooled.repeat_interleave(n, 0))


class Trainer:
    def __init__(self, cfg: RLConfig, progress: bool = True) -> None:
        self.cfg = cfg.validate()
        self.out = Path(cfg.output or f"runs/{cfg.name}")
        self.progress = progress
        self.device, self.dtype = resolve_runtime(cfg)
        self.model = load_model(cfg.model, cfg.model_path, self.device, self.dtype)
        self.model.requires_grad_(False)
        self.reward = load_reward(cfg.reward)
        self.train_prompts = load_prompts(cfg.train_prompts)
        self.eval_prompts = load_prompts(cfg.eval_prompts)[: cfg.eval_prompt_count]
        self.reward(torch.zeros(1, 3, 8, 8), self.train_prompts[:1])  # fail early on prompts the reward rejects
        self.explore: ExploreCopy | None = None
        if cfg.family in ("naive_quant", "sol_rl"):
            recipe = resolve_explore_recipe(cfg.explore_precision, self.device)
            self.explore = ExploreCopy(self.model.transformer, recipe, cfg.explore_skip, cfg.explore_skip_max_dim)
        with torch.random.fork_rng(devices=[]):  # the LoRA init depends on cfg.seed only
            torch.manual_seed(cfg.seed)
            self.adapters = LoraAdapters(self.model.transformer, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        for p in self.adapters.params(TRAIN) + self.adapters.params(OLD):
            p.data = p.data.float()  # LoRA and its optimizer state in FP32; the base stays in policy dtype
        self.adapters.ema = [e.float() for e in self.adapters.ema]
        if self.explore is not None:
            self.explore.attach(self.adapters, merge=cfg.merge_lora)
        # `compile` (and sol_rl by default) sample through torch.compile + one CUDA graph per batch
        # shape; the graphs read the weights in place, so updates need no re-capture.
        graphed = cfg.family == "compile" or cfg.compiled_sampler
        if graphed and self.device.type != "cuda":
            log.info("compiled sampler: needs a CUDA device; sampling eagerly on %s.", self.device.type)
        self.sampler = GraphedSampler(self.model, enabled=graphed and self.device.type == "cuda")
        self.opt = torch.optim.AdamW(self.adapters.params(TRAIN), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.prompt_sampler = PromptSampler(self.train_prompts, cfg.seed)
        self.seed_rng = random.Random(cfg.seed + 1)
        self.gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.iteration = 0
        self.evals: list[tuple[int, float]] = []

    # --- rollouts ----------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        return autocast_for(self.device)

    def _sample(
        self, cond: Conditioning, seeds: list[int], steps: int, transformer: Any = None, tag: str = OLD
    ) -> torch.Tensor:
        """Rollouts of the policy (`tag` = its active adapter) or of the explore copy."""
        c = self.cfg
        with self._autocast():
            return self.sampler.sample(
                cond,
                seeds,
                steps,
                shift=c.shift,
                solver=c.solver,
                batch_size=c.rollout_batch_size,
                dtype=self.dtype,
                transformer=transformer,
                tag=tag,
            )

    def _score(self, x0: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.reward(self.model.decode(x0), prompts).float().to(self.device)

    # --- one iteration -----------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        c = self.cfg
        t0 = time.perf_counter()
        prompts = self.prompt_sampler.next(c.prompts_per_iter)
        seeds = [[self.seed_rng.randrange(2**31) for _ in range(c.n)] for _ in prompts]
        with torch.no_grad():
            cond = self.model.encode_prompts(prompts)
        flat_prompts = [p for p in prompts for _ in range(c.n)]

        # 1. explore: N seeds per prompt, quantized previews (sol_rl, naive_quant) or the BF16 policy
        if self.explore is not None:
            steps = c.preview_steps if c.family == "sol_rl" else c.full_steps
            x_all = self._sample(_repeat(cond, c.n), sum(seeds, []), steps, self.explore.transformer, tag="explore")
        else:
            with self.adapters.using(OLD):
                x_all = self._sample(_repeat(cond, c.n), sum(seeds, []), c.full_steps)
        r_all = self._score(x_all, flat_prompts).view(len(prompts), c.n)
        t1 = time.perf_counter()

        # 2. select the top K/2 and bottom K/2 seeds by (proxy) reward
        idx = select_contrastive(r_all, c.k)
        sel_seeds = [[s[i] for i in row] for s, row in zip(seeds, idx.tolist(), strict=True)]
        sel_prompts = [p for p in prompts for _ in range(c.k)]
        sel_cond = _repeat(cond, c.k)
        proxy = r_all.gather(1, idx)

        # 3. regenerate the selected seeds in BF16 at the full step budget (sol_rl only)
        if c.family == "sol_rl":
            with self.adapters.using(OLD):
                x0 = self._sample(sel_cond, sum(sel_seeds, []), c.full_steps)
            rewards = self._score(x0, sel_prompts).view(len(prompts), c.k)
        else:
            rows = torch.arange(len(prompts), device=idx.device)[:, None]
            x0 = x_all.view(len(prompts), c.n, *x_all.shape[1:])[rows, idx].flatten(0, 1)
            rewards = proxy
        t2 = time.perf_counter()

        # 4. update the policy on the selected samples, advantages from their (BF16) rewards
        adv = group_advantages(rewards, c.adv_clip).flatten()
        stats = self._update(x0, sel_cond, adv)

        # 5. refresh the explore copy with the new "old" policy, in place
        if self.explore is not None:
            self.explore.refresh(self.adapters)
        t3 = time.perf_counter()

        self.iteration += 1
        m: dict[str, Any] = {
            "iter": self.iteration,
            "family": c.family,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "explore_reward_mean": r_all.mean().item(),
            "proxy_reward_mean": proxy.mean().item() if self.explore is not None else None,
            "proxy_spearman": spearman(proxy, rewards).mean().item() if c.family == "sol_rl" else None,
            "proxy_kendall": kendall(proxy, rewards).mean().item() if c.family == "sol_rl" else None,
            "time_explore_s": t1 - t0,
            "time_regen_s": t2 - t1,
            "time_train_s": t3 - t2,
            "time_total_s": t3 - t0,
            **stats,
        }
        return m

    def _update(self, x0: torch.Tensor, cond: Conditioning, adv: torch.Tensor) -> dict[str, float]:
        """One optimizer step over all samples x the chosen rollout timesteps (gradient accumulation)."""
        c = self.cfg
        sig = sigma_schedule(c.full_steps, c.shift)[:-1]  # the rollout times, t in (0, 1]
        n_t = max(1, int(c.full_steps * c.timestep_fraction))
        b = x0.shape[0]
        perms = torch.stack([torch.randperm(c.full_steps, generator=self.gen)[:n_t] for _ in range(b)])
        micro = list(range(0, b, c.train_batch_size))
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0}
        self.opt.zero_grad(set_to_none=True)
        for j in range(n_t):
            for s in micro:
                sl = slice(s, s + c.train_batch_size)
                xb, cb, ab = x0[sl], cond[sl], adv[sl]
                t = sig[perms[sl, j]].to(self.device)
                noise = torch.randn(xb.shape, generator=self.gen).to(self.device, xb.dtype)
                tb = t.view(-1, *([1] * (xb.dim() - 1))).to(xb.dtype)
                xt = (1 - tb) * xb + tb * noise
                with torch.no_grad(), self._autocast():
                    with self.adapters.using(OLD):
                        v_old = self.model.velocity(xt, t, cb).float()
                    with self.adapters.using("ref"):
                        v_ref = self.model.velocity(xt, t, cb).float() if c.kl_beta > 0 else None
                with self._autocast():
                    v = self.model.velocity(xt, t, cb).float()
                loss, st = nft_loss(v, v_old, v_ref, xb.float(), xt.float(), t, ab, c.beta, c.kl_beta, c.adv_clip)
                (loss / (n_t * len(micro))).backward()
                for k in totals:
                    totals[k] += st[k] / (n_t * len(micro))
        gn = torch.nn.utils.clip_grad_norm_(self.adapters.params(TRAIN), c.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.adapters.update_ema(self.iteration, c.ema_decay_max)
        d = self.adapters.update_old(self.iteration + 1, c.old_decay_rate, c.old_decay_max)
        return {**totals, "grad_norm": float(gn), "old_decay": d}

    # --- evaluation, checkpoints, the loop ---------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean reward on the held-out prompts with the EMA adapter; writes an image grid."""
        c = self.cfg
        ps = [p for p in self.eval_prompts for _ in range(c.eval_seeds)]
        seeds = [j for _ in self.eval_prompts for j in range(c.eval_seeds)]
        with self.adapters.ema_weights():
            x0 = self._sample(self.model.encode_prompts(ps), seeds, c.full_steps, tag=TRAIN)
        images = self.model.decode(x0)
        r = self.reward(images, ps).float()
        pick = list(range(0, len(ps), c.eval_seeds))[:16]
        head = f"iter {self.iteration}: held-out reward {r.mean().item():.3f} (EMA adapter)"
        image_grid(images[pick], [f"{v:.2f}" for v in r[pick].tolist()], ncol=8, header=head).save(
            self.out / f"eval_{self.iteration:05d}.png"
        )
        self.evals.append((self.iteration, r.mean().item()))
        return r.mean().item()

    def _state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "adapters": self.adapters.state_dict(),
            "opt": self.opt.state_dict(),
            "prompts": self.prompt_sampler.state(),
            "seed_rng": self.seed_rng.getstate(),
            "gen": self.gen.get_state(),
            "evals": list(self.evals),
            "config": dataclasses.asdict(self.cfg),
        }

    def _restore(self, st: dict[str, Any]) -> None:
        self.iteration = st["iteration"]
        self.adapters.load_state_dict(st["adapters"])
        self.opt.load_state_dict(st["opt"])
        self.prompt_sampler.load_state(st["prompts"])
        self.seed_rng.setstate(st["seed_rng"])
        self.gen.set_state(st["gen"])
        self.evals = [tuple(e) for e in st["evals"]]
        if self.explore is not None:
            self.explore.refresh(self.adapters)

    def _plot(self, history: list[dict[str, Any]]) -> None:
        series = {"train reward (BF16 samples)": ([h["iter"] for h in history], [h["reward_mean"] for h in history])}
        if self.evals:
            series["held-out reward (EMA)"] = ([i for i, _ in self.evals], [v for _, v in self.evals])
        line_plot(self.out / "reward.png", series, f"{self.cfg.name}", "iteration", f"{self.cfg.reward} reward")

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Train for cfg.iterations; with `resume`, continue from the newest complete checkpoint."""
        c = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        metrics_path = self.out / "metrics.jsonl"
        history: list[dict[str, Any]] = []
        ck = checkpoint.latest(self.out / "checkpoints") if resume else None
        if ck is not None:
            self._restore(checkpoint.load(ck))
            if metrics_path.exists():  # drop records written after the checkpoint
                lines = metrics_path.read_text().splitlines()
                history = [json.loads(x) for x in lines if json.loads(x)["iter"] <= self.iteration]
                metrics_path.write_text("".join(json.dumps(h) + "\n" for h in history))
            log.info("resumed from %s at iteration %d", ck, self.iteration)
        else:
            metrics_path.write_text("")
            (self.out / "config.json").write_text(json.dumps(dataclasses.asdict(c), indent=2))
            self.evaluate()
        bar = tqdm(total=c.iterations, initial=self.iteration, disable=not self.progress, desc=c.name)
        while self.iteration < c.iterations:
            m = self.step()
            if self.iteration % c.eval_every == 0 or self.iteration == c.iterations:
                m["heldout_reward"] = self.evaluate()
            history.append(m)
            with metrics_path.open("a") as f:
                f.write(json.dumps(m) + "\n")
            self._plot(history)
            if self.iteration % c.save_every == 0 or self.iteration == c.iterations:
                checkpoint.save(self.out / "checkpoints", self.iteration, self._state(), c.keep_checkpoints)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", heldout=f"{self.evals[-1][1]:.3f}")
        bar.close()
        summary = {
            "name": c.name,
            "family": c.family,
            "iterations": self.iteration,
            "heldout_reward_start": self.evals[0][1] if self.evals and self.evals[0][0] == 0 else None,
            "heldout_reward_final": self.evals[-1][1] if self.evals else None,
            "explore_recipe": self.explore.recipe if self.explore else "bf16",
            "mean_time_total_s": sum(h["time_total_s"] for h in history) / max(1, len(history)),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
