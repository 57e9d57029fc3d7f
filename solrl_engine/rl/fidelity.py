"""`solrl fidelity`: how faithfully cheap previews rank seeds, against the BF16 full-step oracle.

For P prompts x N seeds: proxy rewards (explore precision, preview steps) and BF16 rewards (full
steps), then per prompt Spearman, Kendall, and the overlap of the proxy's top-K/2 / bottom-K/2 with
the oracle's. Replicates the paper's rank-fidelity table (Spearman 0.927, Kendall 0.798) on any model.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from solrl_engine.data import load_prompts
from solrl_engine.rl.config import RLConfig
from solrl_engine.rl.ranking import kendall, overlap, spearman
from solrl_engine.rollout import Rollouts


@torch.no_grad()
def fidelity(cfg: RLConfig, prompts: int = 32, n: int = 96, k: int = 24, progress: bool = True) -> dict[str, Any]:
    if k > n or k % 2:
        raise ValueError(f"need an even k <= n; got n={n}, k={k}")
    ro = Rollouts(cfg, explore=True)
    assert ro.explore is not None
    dev = ro.device
    recipe = ro.explore.recipe
    pool = load_prompts(cfg.train_prompts)
    chosen = random.Random(cfg.seed).sample(pool, min(prompts, len(pool)))
    proxy_r, full_r = [], []
    t_proxy = t_full = 0.0

    def timed(cond: Any, seeds: list[int], steps: int, transformer: Any = None) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        x = ro.sample(cond, seeds, steps, transformer=transformer, tag="explore" if transformer is not None else "")
        return x, time.perf_counter() - t0

    for i, p in enumerate(tqdm(chosen, disable=not progress, desc="fidelity")):
        seeds = [1000 * i + j for j in range(n)]
        cond = ro.encode([p] * n)
        xp, dt_proxy = timed(cond, seeds, cfg.preview_steps, ro.explore.transformer)
        xf, dt_full = timed(cond, seeds, cfg.full_steps)
        t_proxy += dt_proxy
        t_full += dt_full
        proxy_r.append(ro.score(xp, [p] * n).rewards.cpu())
        full_r.append(ro.score(xf, [p] * n).rewards.cpu())
    pr, fr = torch.stack(proxy_r), torch.stack(full_r)
    top, bottom = overlap(pr, fr, k)
    return {
        "config": cfg.name,
        "model": cfg.model,
        "explore_recipe": recipe,
        "quantized_layers": len(ro.explore.report.quantized),
        "solver": cfg.solver,
        "preview_steps": cfg.preview_steps,
        "full_steps": cfg.full_steps,
        "prompts": len(chosen),
        "n": n,
        "k": k,
        "spearman_mean": spearman(pr, fr).mean().item(),
        "kendall_mean": kendall(pr, fr).mean().item(),
        "top_overlap_mean": top.mean().item(),
        "bottom_overlap_mean": bottom.mean().item(),
        "proxy_reward_mean": pr.mean().item(),
        "full_reward_mean": fr.mean().item(),
        "time_proxy_s": t_proxy,
        "time_full_s": t_full,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "per_prompt": [
            {"prompt": p, "spearman": s, "kendall": kd}
            for p, s, kd in zip(chosen, spearman(pr, fr).tolist(), kendall(pr, fr).tolist(), strict=True)
        ],
    }


def write_report(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
