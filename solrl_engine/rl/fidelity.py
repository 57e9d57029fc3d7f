"""`solrl fidelity`: how faithfully cheap previews rank seeds, against the BF16 full-step oracle.

For P prompts x N seeds: proxy rewards (explore precision, preview steps) and BF16 rewards (full
steps), then per prompt Spearman, Kendall, and the overlap of the proxy's top-K/2 / bottom-K/2 with
the oracle's. Replicates the paper's rank-fidelity table (Spearman 0.927, Kendall 0.798) on any model.

The oracle's rewards do not depend on the explore recipe, so `oracle_cache` keeps them on disk
(keyed by everything they depend on, the policy weights included): comparing recipes then costs
the previews only. `search` picks the layers to quantize: the set with the largest 4-bit share of
the linear FLOPs whose previews still rank at a target Spearman.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from solrl_engine.data import load_prompts
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.explore.ranking import kendall, nk_problem, overlap, spearman
from solrl_engine.nn.fast_path import fast_path
from solrl_engine.nn.flops import group_name
from solrl_engine.nn.quantize import plan_quantization
from solrl_engine.rl.config import OBJECTIVES, RLConfig
from solrl_engine.rl.objectives import preview_coupling, rollout_window
from solrl_engine.rl.runtime import build_rollouts, plan_explore
from solrl_engine.sampling.rollouts import Rollouts
from solrl_engine.sampling.sde import Coupling

log = logging.getLogger("solrl_engine.fidelity")


# --- the oracle, cached ----------------------------------------------------------------------------


def _fingerprint(module: nn.Module) -> str:
    """A cheap digest of a module's weights (names, shapes, dtypes, float64 sums and a strided sample):
    a cached oracle is only reused for the same weights."""
    h = hashlib.sha1()
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            f = t.detach().flatten()
            f = f.float() if f.is_floating_point() else f.to(torch.float64)
            sample = f[:: max(1, f.numel() // 64)][:64].double()
            h.update(f"{name}{tuple(t.shape)}{t.dtype}{f.double().sum().item():.17g}".encode())
            h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()


def _oracle_key(c: RLConfig, ro: Rollouts) -> str:
    parts = [c.model, str(c.model_path), c.resolution, c.full_steps, c.solver, c.shift, c.guidance_scale, c.reward,
             c.reward_args, str(ro.dtype), _fingerprint(ro.model.transformer)]  # fmt: skip
    if OBJECTIVES[c.objective].rollout == "sde":  # finals sampled by the objective's SDE: its settings decide them too
        parts += [c.objective, c.sde_noise_level, c.sde_window, c.sde_window_range, c.seed]
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()


class OracleCache:
    """Full-step full-precision rewards per (prompt, seeds), in a JSON file; a file written for other
    weights or settings is set aside (its key differs), never mixed in."""

    def __init__(self, path: str | Path | None, key: str) -> None:
        self.path = Path(path) if path else None
        self.key = key
        self.entries: dict[str, list[float]] = {}
        if self.path and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"oracle cache {self.path} is unreadable ({e}); delete it to rebuild") from e
            if data.get("key") == key:
                self.entries = data.get("entries", {})
            else:
                log.warning("oracle cache %s was written for other weights or settings; rebuilding it", self.path)

    @staticmethod
    def _entry(prompt: str, seeds: list[int]) -> str:
        return f"{prompt}|{seeds[0]}|{len(seeds)}"

    def get(self, prompt: str, seeds: list[int]) -> torch.Tensor | None:
        v = self.entries.get(self._entry(prompt, seeds))
        return None if v is None else torch.tensor(v)

    def put(self, prompt: str, seeds: list[int], rewards: torch.Tensor) -> None:
        self.entries[self._entry(prompt, seeds)] = rewards.float().cpu().tolist()
        if self.path:  # written as it grows (atomically): an interrupted run keeps what it computed
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps({"key": self.key, "entries": self.entries}))
            tmp.replace(self.path)


# --- the measurement -------------------------------------------------------------------------------


@dataclass
class _Setup:
    ro: Rollouts
    copy: ExploreCopy  # the config's explore copy
    preview_steps: int
    prompts: list[str]
    seeds: list[list[int]]
    oracle: torch.Tensor  # [P, N] full-step rewards
    time_full_s: float
    couples: list[Coupling | None]  # per prompt: SDE previews' coupling to its final's noise (preview_coupling)


def _setup(cfg: RLConfig, prompts: int, n: int, oracle_cache: str | Path | None, progress: bool) -> _Setup:
    ro = build_rollouts(cfg)
    # explore_precision=auto by the tensor-core table, not timed: a fidelity study measures a quantized proxy
    # wherever it is slow (the hardware plan's format; NVFP4 on a CPU)
    spec = plan_explore(cfg, ro, measure=False)  # untimed, auto is always a format here (never POLICY)
    copy = ExploreCopy.from_spec(ro.model.transformer, spec)
    assert copy is not None  # measure=False never resolves to POLICY
    pool = load_prompts(cfg.train_prompts)
    chosen = random.Random(cfg.seed).sample(pool, min(prompts, len(pool)))
    seeds = [[1000 * i + j for j in range(n)] for i in range(len(chosen))]
    cache = OracleCache(oracle_cache, _oracle_key(cfg, ro))
    # the finals as the trainer regenerates them: with the objective's sampler (Flow-GRPO: its SDE on its window)
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, t_full, couples = [], 0.0, []
    for p, s in zip(tqdm(chosen, disable=not progress, desc="oracle (full steps)"), seeds, strict=True):
        window = rollout_window(cfg, gen)  # drawn for every prompt, cached or not: the same windows either way
        couples.append(preview_coupling(cfg, window))
        r = cache.get(p, s)
        if r is None:
            t0 = time.perf_counter()
            with torch.no_grad():
                x = ro.sample(ro.encode([p] * n), s, cfg.full_steps, window=window)
                r = ro.score(x, [p] * n).rewards.cpu()
            t_full += time.perf_counter() - t0
            cache.put(p, s, r)
        rewards.append(r)
    return _Setup(ro, copy, cfg.preview_steps, chosen, seeds, torch.stack(rewards), t_full, couples)


@torch.no_grad()
def _proxy(st: _Setup, transformer: nn.Module | None, progress: bool, desc: str = "previews", tag: str = "explore"
           ) -> tuple[torch.Tensor, float]:  # fmt: skip
    """Preview rewards [P, N]; `tag` names the copy for the compiled sampler's graph cache (a copy
    built later may reuse a freed one's id, never its tag)."""
    ro, n = st.ro, len(st.seeds[0])
    out, t = [], 0.0
    for p, s, couple in zip(tqdm(st.prompts, disable=not progress, desc=desc), st.seeds, st.couples, strict=True):
        t0 = time.perf_counter()
        x = ro.sample(ro.encode([p] * n), s, st.preview_steps, transformer=transformer,
                      tag=tag if transformer is not None else "", couple=couple)  # fmt: skip
        t += time.perf_counter() - t0
        out.append(ro.score(x, [p] * n).rewards.cpu())
    return torch.stack(out), t


def _rank_metrics(pr: torch.Tensor, fr: torch.Tensor, k: int) -> dict[str, float]:
    top, bottom = overlap(pr, fr, k)
    return {
        "spearman_mean": spearman(pr, fr).mean().item(),
        "kendall_mean": kendall(pr, fr).mean().item(),
        "top_overlap_mean": top.mean().item(),
        "bottom_overlap_mean": bottom.mean().item(),
    }


def _check_nk(n: int, k: int) -> None:
    if (why := nk_problem(n, k)) is not None:
        raise ValueError(f"n={n}, k={k}: {why}")


@torch.no_grad()
def fidelity(
    cfg: RLConfig,
    prompts: int = 32,
    n: int = 96,
    k: int = 24,
    progress: bool = True,
    oracle_cache: str | Path | None = None,
) -> dict[str, Any]:
    """Rank fidelity of the config's explore copy (see the module docstring), with the share of the
    linear FLOPs it runs quantized (`quantized_flop_share`) and what its quantized layers ran (`fast_path`)."""
    _check_nk(n, k)
    st = _setup(cfg, prompts, n, oracle_cache, progress)
    ro, copy = st.ro, st.copy
    pr, t_proxy = _proxy(st, copy.transformer, progress)
    record = fast_path(copy.transformer)  # what the previews' quantized layers ran
    fr = st.oracle
    flops = ro.linear_flops(copy.transformer)
    dev = ro.device
    return {
        "config": cfg.name,
        "model": cfg.model,
        "explore_recipe": copy.recipe,
        "explore_attention": copy.attention,
        "attention_ran": copy.attention_ran(),  # its kernel, its reference, or emulated (None: the policy's)
        "quantized_layers": len(copy.report.quantized),
        "quantized_flop_share": flops.quantized_share(),
        "fast_path": record.summary(),
        "solver": cfg.solver,
        "previews_coupled": any(c is not None for c in st.couples),  # SDE previews on their finals' noise path
        "preview_steps": cfg.preview_steps,
        "full_steps": cfg.full_steps,
        "prompts": len(st.prompts),
        "n": n,
        "k": k,
        **_rank_metrics(pr, fr, k),
        "proxy_reward_mean": pr.mean().item(),
        "full_reward_mean": fr.mean().item(),
        "time_proxy_s": t_proxy,
        "time_full_s": st.time_full_s,
        "oracle_cached": st.time_full_s == 0.0,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "per_prompt": [
            {"prompt": p, "spearman": s, "kendall": kd}
            for p, s, kd in zip(st.prompts, spearman(pr, fr).tolist(), kendall(pr, fr).tolist(), strict=True)
        ],
    }


# --- the layer search ------------------------------------------------------------------------------


def _copy_with(st: _Setup, include: tuple[str, ...]) -> ExploreCopy:
    """An explore copy of the policy with the config's recipe restricted to the `include` groups."""
    if not include:  # an empty include means "every layer" to a recipe
        raise ValueError("a searched rule names at least one layer group")
    copy = ExploreCopy(st.ro.model.transformer, st.copy.quant_recipe.with_(include=include, skip_max_dim=0))
    copy.set_attention(st.copy.attention)
    return copy


def candidate_groups(ro: Rollouts, copy: ExploreCopy) -> dict[str, int]:
    """Layer groups (the same layer of every block) `copy`'s recipe could quantize, with their FLOPs per
    step: every layer the recipe's own skip patterns and size rules allow, whatever the family's
    include rule says."""
    everything = copy.quant_recipe.with_(include=(), skip_max_dim=0)
    eligible = {d.name for d in plan_quantization(ro.model.transformer, everything).layers if d.quantized}
    flops = ro.linear_flops(ro.model.transformer)
    groups: dict[str, int] = {}
    for name, f in flops.layers.items():
        if name in eligible:
            groups[group_name(name)] = groups.get(group_name(name), 0) + f
    for g in groups:  # a group's pattern must name its own layers and no other (fnmatch's * spans dots)
        hit = {n for n in flops.layers if fnmatch.fnmatchcase(n, g)}
        own = {n for n in flops.layers if group_name(n) == g}
        if hit != own:
            raise RuntimeError(f"layer group {g!r} would also match {sorted(hit - own)[:3]}; cannot search this model")
    return groups


@torch.no_grad()
def _sensitivity(st: _Setup, groups: list[str], probe_prompts: int, probe_seeds: int, progress: bool
                 ) -> dict[str, float]:  # fmt: skip
    """Each group's damage alone: the relative error of previews with only that group quantized
    against unquantized previews of the same seeds (cheap, low-noise, and what ranking errors come from)."""
    ro = st.ro
    probes = [(p, s[:probe_seeds]) for p, s in zip(st.prompts[:probe_prompts], st.seeds, strict=False)]
    conds = [ro.encode([p] * len(s)) for p, s in probes]
    ref = [ro.sample(c, s, st.preview_steps) for c, (_, s) in zip(conds, probes, strict=True)]
    out = {}
    for g in tqdm(groups, disable=not progress, desc="sensitivity per layer group"):
        copy = _copy_with(st, (g,))
        err = [
            ((ro.sample(c, s, st.preview_steps, transformer=copy.transformer, tag=f"g:{g}") - x).float().norm()
             / x.float().norm().clamp_min(1e-12)).item()
            for c, (_, s), x in zip(conds, probes, ref, strict=True)
        ]  # fmt: skip
        out[g] = sum(err) / len(err)
        del copy
    return out


@torch.no_grad()
def search(
    cfg: RLConfig,
    target: float | None = 0.93,
    prompts: int = 32,
    n: int = 96,
    k: int = 24,
    progress: bool = True,
    oracle_cache: str | Path | None = None,
    probe_prompts: int = 4,
    probe_seeds: int = 16,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    tolerance: float | None = None,
) -> dict[str, Any]:
    """The layer groups to quantize: the largest FLOP share in the explore format whose previews keep `target`
    Spearman, or, with `tolerance`, stay within `tolerance` of the Spearman of previews at the policy's own
    precision (measured first on the same prompts, seeds and oracle: the rule per format, judged against BF16
    previews rather than a fixed number). Where no group qualifies the chosen rule is empty: the policy's
    precision explores (explore_precision=bf16), and the result says so.

    1. Candidates: every group of same-named layers (one per block) the recipe can quantize.
    2. Sensitivity: each group quantized alone on a small probe (relative preview error).
    3. Order: least damage per FLOP first; the candidate rules are the prefixes of that order.
    4. Measure: rank fidelity of prefixes on the full prompt set (oracle computed once), by bisection
       for the longest prefix at or above `target` (the all-groups rule is measured too, as a bound).
    Returns every measured point (a Pareto table), the chosen include patterns and a config snippet.
    """
    _check_nk(n, k)
    if tolerance is not None and not 0 <= tolerance <= 2:
        raise ValueError(f"tolerance is a Spearman difference in [0, 2]; got {tolerance}")
    if tolerance is None and (target is None or not -1 <= target <= 1):
        raise ValueError(f"target Spearman must be in [-1, 1]; got {target}")
    st = _setup(cfg, prompts, n, oracle_cache, progress)
    ro = st.ro
    policy: dict[str, Any] = {}
    if tolerance is not None:  # the policy's own previews: what the quantized rule must stay close to
        pr, t = _proxy(st, None, progress, desc="previews at the policy's precision")
        policy = {**_rank_metrics(pr, st.oracle, k), "time_proxy_s": t}
        target = policy["spearman_mean"] - tolerance
    assert target is not None
    groups = candidate_groups(ro, st.copy)
    if not groups:
        raise ValueError(f"the explore recipe can quantize no layer of {cfg.model}; nothing to search")
    total = sum(ro.linear_flops(ro.model.transformer).layers.values())
    sens = _sensitivity(st, list(groups), probe_prompts, probe_seeds, progress)
    order = sorted(groups, key=lambda g: sens[g] / (groups[g] / total))
    points: dict[int, dict[str, Any]] = {}

    def measure(m: int) -> dict[str, Any]:
        if m not in points:
            include = tuple(order[:m])
            copy = _copy_with(st, include)
            desc = f"previews, {m} of {len(order)} groups"
            pr, t = _proxy(st, copy.transformer, progress, desc=desc, tag=f"search:{m}")
            points[m] = {
                "groups": m,
                "include": list(include),
                "quantized_flop_share": ro.linear_flops(copy.transformer).quantized_share(),
                **_rank_metrics(pr, st.oracle, k),
                "time_proxy_s": t,
            }
            if on_point:
                on_point(points[m])
            del copy
        return points[m]

    lo, hi = 0, len(order)  # invariant: prefix lo meets the target (the empty rule trivially), hi is unknown
    if measure(hi)["spearman_mean"] >= target:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid)["spearman_mean"] >= target:
            lo = mid
        else:
            hi = mid
    chosen = order[:lo]
    table = sorted(points.values(), key=lambda p: p["quantized_flop_share"])
    # the format searched (auto resolved to it; the config's format options stay set where they were)
    precision = cfg.explore_precision if cfg.explore_precision != "auto" else st.copy.quant_recipe.name.split("+")[0]
    if chosen:
        set_arg = f"--set explore_precision={precision} --set explore_layers=" + ",".join(chosen)
        verdict = f"{len(chosen)} layer group(s) in {st.copy.recipe} keep Spearman >= {target:.4f}"
    else:
        set_arg = "--set explore_precision=bf16"
        verdict = (f"no layer group in {st.copy.recipe} keeps Spearman >= {target:.4f}: the policy's precision "
                   "explores (explore_precision=bf16)")  # fmt: skip
    return {
        "config": cfg.name,
        "model": cfg.model,
        "explore_recipe": st.copy.recipe,
        "target_spearman": target,
        "tolerance": tolerance,
        "policy_previews": policy,
        "verdict": verdict,
        "prompts": len(st.prompts),
        "n": n,
        "k": k,
        "groups": [{"group": g, "flop_share": groups[g] / total, "sensitivity": sens[g]} for g in order],
        "points": table,
        "chosen": {"include": chosen, **({kk: v for kk, v in points[lo].items() if kk != "include"} if lo else {})},
        "config_snippet": (f"explore_precision={precision!r}\nexplore_layers={tuple(chosen)!r}" if chosen
                           else "explore_precision='bf16'"),
        "set_arg": set_arg,
        "time_full_s": st.time_full_s,
    }


def write_report(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
