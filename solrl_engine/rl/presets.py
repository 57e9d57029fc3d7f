"""The paper's presets for the real models, as data: one table of hyper-parameters per model family,
expanded into a config function per (family, reward) by `define_presets`, so configs/sd3.py,
configs/flux1.py and configs/sana.py are each one call and no two presets are copies of each other.

Sol-RL's settings (arXiv 2604.06916, on DiffusionNFT's): 48 prompts per iteration, N = 96 seeds
explored, K = 24 trained on, 6 preview and 10 full steps, LoRA r32 / a64; the share of rollout
timesteps trained on is 0.6 for SD3.5 and SANA and 0.4 for FLUX; SD3.5 clips gradients at 0.002.
"""

from __future__ import annotations

from typing import Any

from solrl_engine.rl.config import FAMILIES, FAMILY_TABLE, RLConfig

REWARD_NAMES = ("imagereward", "clipscore", "pickscore", "hpsv2")

COMMON: dict[str, Any] = dict(
    n=96,
    k=24,
    prompts_per_iter=48,
    preview_steps=6,
    full_steps=10,
    lora_rank=32,
    lora_alpha=64,
    lr=3e-4,
    solver="dpm2",
    train_prompts="sample/train",
    eval_prompts="sample/test",
    eval_prompt_count=16,
    eval_seeds=2,
    eval_every=10,
    save_every=10,
    iterations=300,
    log_with=("tensorboard",),
)

# Per family: the paper's differences, and batch sizes for one 80 GB GPU at the default resolution
# (rollouts are inference: larger batches; the update holds activations for backward: small ones).
PAPER: dict[str, dict[str, Any]] = {
    "sd3": dict(model="sd3", timestep_fraction=0.6, grad_clip=0.002, rollout_batch_size=16, train_batch_size=4),
    "flux": dict(model="flux", timestep_fraction=0.4, grad_clip=1.0, rollout_batch_size=24, train_batch_size=4),
    "sana": dict(model="sana", timestep_fraction=0.6, grad_clip=1.0, rollout_batch_size=32, train_batch_size=8),
}


def paper_config(model: str, family: str, reward: str, **overrides: Any) -> RLConfig:
    """The paper's run of `family` on `model` with `reward`; keyword arguments override fields."""
    if model not in PAPER:
        raise ValueError(f"no paper preset for model {model!r}; choose one of {sorted(PAPER)}")
    kw: dict[str, Any] = {**COMMON, **PAPER[model], "family": family, "reward": reward}
    if FAMILY_TABLE[family].all_rollouts:  # DiffusionNFT trains on every rollout: N = K
        kw["n"] = kw["k"]
    if family == "sol_rl":
        kw["compiled_sampler"] = True
    return RLConfig(**{**kw, **overrides})


def define_presets(namespace: dict[str, Any], model: str, prefix: str) -> list[str]:
    """Write `<prefix>_<family>_<reward>` config functions into `namespace` (a config file's globals)."""
    names = []
    for family in FAMILIES:
        for reward in REWARD_NAMES:
            name = f"{prefix}_{family}_{reward}"

            def preset(_f: str = family, _r: str = reward, _n: str = name, **overrides: Any) -> RLConfig:
                return paper_config(model, _f, _r, name=_n, **overrides)

            preset.__name__ = preset.__qualname__ = name
            preset.__doc__ = f"The paper's {family} run on {model} with the {reward} reward (solrl_engine.rl.presets)."
            namespace[name] = preset
            names.append(name)
    return names


__all__ = ["COMMON", "PAPER", "REWARD_NAMES", "define_presets", "paper_config"]
