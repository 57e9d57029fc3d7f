"""What the trainer refuses to trust: non-finite numbers, a resume under another config, and a
quantized proxy that no longer ranks seeds the way full precision does (the drift guard)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from solrl_engine.rl.config import ConfigError, RLConfig

log = logging.getLogger("solrl_engine.rl")

# config keys that do not change which seeds, samples or updates come next: free to change on resume
SAFE_TO_CHANGE_ON_RESUME = {
    "name", "output", "iterations", "device", "eval_every", "save_every", "keep_checkpoints", "log_with",
    "compiled_sampler", "compile_mode", "compile_regional", "compile_cache_dir",
    "rollout_batch_size", "decode_batch_size", "offload_text_encoders", "gradient_checkpointing", "memory_check",
    "train_batch_size", "compiled_update", "context_parallel", "context_parallel_mode",
    "explore_sharding",
    "proxy_floor", "proxy_window", "proxy_fallback", "nonfinite_policy",
}  # fmt: skip


class NonFiniteError(RuntimeError):
    """A NaN or Inf in a latent, velocity, loss, gradient or reward; the message names the stage,
    the prompt and the seed."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"non-finite values in {stage}: {detail}")
        self.stage = stage


def nonfinite_detail(x: torch.Tensor, prompts: list[str], seeds: list[int]) -> str | None:
    """None when every row of x is finite, else which samples are not (rows: prompt-major samples)."""
    bad = ~torch.isfinite(x.detach().float().reshape(len(prompts), -1)).all(dim=1)
    return nonfinite_rows(bad.tolist(), prompts, seeds) if bool(bad.any()) else None


def nonfinite_rows(bad: list[bool], prompts: list[str], seeds: list[int]) -> str:
    """Which samples are not finite, given each row's verdict (read back from the device once, by the caller)."""
    i = bad.index(True)
    return f"{sum(bad)} of {len(prompts)} samples, first: prompt {prompts[i]!r}, seed {seeds[i]}"


def check_finite(stage: str, x: torch.Tensor, prompts: list[str], seeds: list[int], dist: Any = None) -> None:
    """Raise NonFiniteError naming the first bad row's prompt and seed. With `dist` (a Dist) the
    verdict is collective: every rank raises when any rank found one, so no rank waits alone in a
    collective."""
    detail = nonfinite_detail(x, prompts, seeds)
    if dist is not None and dist.world > 1:
        flag = torch.tensor([0.0 if detail is None else 1.0], device=x.device)
        if dist.sum_(flag).item() > 0 and detail is None:
            detail = "on another rank (see its log)"
    if detail is not None:
        raise NonFiniteError(stage, detail)


def raise_collective(problem: tuple[str, str] | None, dist: Any, device: torch.device | str = "cpu") -> None:
    """Raise NonFiniteError(stage, detail) for `problem` found on this rank, or on another rank's
    word: one collective, so ranks whose loops differ in length still meet in it exactly once."""
    if dist is not None and dist.world > 1:
        flag = torch.tensor([0.0 if problem is None else 1.0], device=device)
        if dist.sum_(flag).item() > 0 and problem is None:
            problem = ("a training batch", "on another rank (see its log)")
    if problem is not None:
        raise NonFiniteError(*problem)


def check_resume_config(then: dict[str, Any], now: RLConfig) -> None:
    """Refuse to resume when the config differs from the checkpoint's in a key that decides the future."""
    import dataclasses

    diff = {}
    # a key newer than the checkpoint's version counts as its default (what that version ran with)
    defaults = {f.name: f.default for f in dataclasses.fields(now) if f.default is not dataclasses.MISSING}
    for k, v in dataclasses.asdict(now).items():
        old = then.get(k, defaults.get(k))
        if k in SAFE_TO_CHANGE_ON_RESUME or old == v or (isinstance(old, list) and tuple(old) == v):
            continue
        diff[k] = (old, v)
    if diff:
        raise ConfigError(
            "cannot resume: the config differs from the checkpoint's in "
            + ", ".join(f"{k} (checkpoint {a!r}, now {b!r})" for k, (a, b) in diff.items())
            + "; resume with the run's own config, or start a new run (--overwrite or another --output)"
        )


class ProxyGuard:
    """Watches the quantized previews' rank fidelity (Spearman against the full-precision rewards of
    the selected seeds) over the last `proxy_window` iterations. Below `proxy_floor` it warns once and,
    as `proxy_fallback` says, asks for exploration at full steps ("steps") or with the policy ("bf16")
    until the window mean is back at the floor."""

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.history: list[float] = []
        self.fallback = False
        self.low = False

    @property
    def mode(self) -> str:
        if not self.fallback:
            return "quantized"
        return "full_steps" if self.cfg.proxy_fallback == "steps" else "bf16"

    def update(self, rho: float) -> tuple[float, str | None]:
        """Record this iteration's Spearman; returns the window mean and the event (None, "warn",
        "fallback:<mode>", "recovered")."""
        c = self.cfg
        self.history.append(rho)
        window = self.history[-c.proxy_window :]
        mean = sum(window) / len(window)
        if len(window) < c.proxy_window:
            return mean, None
        if mean < c.proxy_floor and not self.low:
            self.low = True
            log.warning(
                "proxy drift: the quantized previews' mean Spearman over the last %d iterations is %.3f < "
                "proxy_floor %.3f (last: %s)%s", c.proxy_window, mean, c.proxy_floor,
                ", ".join(f"{v:.2f}" for v in window),
                "" if c.proxy_fallback == "warn" else f"; proxy_fallback={c.proxy_fallback} until it recovers",
            )  # fmt: skip
            if c.proxy_fallback == "warn":
                return mean, "warn"
            self.fallback = True
            return mean, f"fallback:{c.proxy_fallback}"
        if mean >= c.proxy_floor and self.low:
            self.low = False
            log.warning("proxy recovered: mean Spearman %.3f >= proxy_floor %.3f", mean, c.proxy_floor)
            self.fallback = False
            return mean, "recovered"
        return mean, None

    def state(self) -> dict[str, Any]:
        return {"history": list(self.history), "fallback": self.fallback, "low": self.low}

    def load_state(self, st: dict[str, Any]) -> None:
        self.history, self.fallback, self.low = list(st["history"]), bool(st["fallback"]), bool(st["low"])
