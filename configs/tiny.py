"""Sol-RL on the bundled tiny model with the analytic `shapes` reward.

CPU-sized defaults (2 cores, about 5 minutes for the quickstart), tuned by a recorded sweep
(docs/benchmarks-and-quickstart-tuning.md, "Tuning the quickstart";
bench/results/*-cpu-tiny-quickstart-sweep-round*.json):
8 prompts per iteration, N = 32 seeds explored per prompt, K = 8 trained on (the wider the
exploration, the more contrastive the kept seeds), 3 of the 10 rollout times per sample
(timestep_fraction 0.3: more prompts instead of more timesteps of the same samples), no KL term
(at 1e-4 it changed nothing measurable and cost a forward per sample), LoRA rank 32 with lr 1e-3
(2e-3 diverged), 20 iterations; the EMA adapter evaluated every 5 iterations on all 64 held-out
prompts x 2 seeds, and on 16 training prompts x 2 seeds. lr 1e-3 is tuned for these 20 iterations:
run past about 40 without a KL term it degrades (measured to 80 iterations: the same page, "Longer
runs"), so for a longer run set kl_beta=0.1 (or lr=3e-4). `paper_scale=true` switches to the
paper's N = 96, K = 24 with 16 prompts per iteration (meant for a GPU):

    solrl train configs/tiny.py:tiny_sol_rl_shapes
    solrl train configs/tiny.py:tiny_sol_rl_shapes --set paper_scale=true --set iterations=200
"""

from __future__ import annotations

from solrl_engine.rl.config import ConfigError, RLConfig
from solrl_engine.rl.presets import OBJECTIVE_PRESETS


def _tiny(family: str, paper_scale: bool, objective: str = "nft", **kw: object) -> RLConfig:
    if objective not in OBJECTIVE_PRESETS:
        raise ConfigError(f"objective = {objective!r}: choose one of {tuple(OBJECTIVE_PRESETS)}")
    cfg = RLConfig(
        family=family,
        model="tiny",
        reward="shapes",
        n=32,
        k=8,
        prompts_per_iter=8,
        preview_steps=6,
        full_steps=10,
        solver="dpm2",
        iterations=20,
        eval_every=5,
        eval_prompt_count=64,
        eval_seeds=2,
        eval_train_prompt_count=16,
        save_every=5,
        lora_rank=32,
        lora_alpha=64,
        lr=1e-3,
        kl_beta=0.0,
        timestep_fraction=0.3,
        rollout_batch_size=64,
        train_batch_size=32,
        # the best NVFP4 explore recipe measured on this model (docs/nvfp4-recipes-and-fidelity.md,
        # "NVFP4 recipes beyond the paper"; bench/results/2026-11-24-cpu-tiny-recipes.json): a 128-point
        # Hadamard rotation along K and 4-over-6 block scales, Spearman 0.906 against 0.877 for the TE
        # recipe, +4.9% of the 4-bit FLOPs.
        # Where emulated NVFP4 is slower than the policy (CPUs), explore_precision=auto explores with
        # the policy itself and these apply only when NVFP4 is set explicitly.
        explore_rht=128,
        explore_four_over_six=True,
    )
    if paper_scale:
        cfg = RLConfig(
            **{
                **cfg.__dict__,
                "n": 96,
                "k": 24,
                "prompts_per_iter": 16,
                "lr": 3e-4,
                "timestep_fraction": 0.6,
                "kl_beta": 1e-4,
                "eval_every": 10,
                "save_every": 10,
                "rollout_batch_size": 384,
                "eval_prompt_count": 64,
                "eval_seeds": 4,
                "iterations": 200,
            }
        )
    # another objective takes its published settings (solrl_engine/rl/presets.py, OBJECTIVE_PRESETS): on this model
    # Flow-GRPO's (lr 3e-4, KL 0.04, two optimizer steps per iteration) learned where the quickstart's NFT settings
    # (lr 1e-3, no KL, one step) lost reward (docs/training-and-configs.md, "Flow-GRPO on the bundled model")
    named = {} if objective == "nft" else {"name": f"tiny_{family}_shapes_{objective}"}  # a run directory of its own
    return RLConfig(**{**cfg.__dict__, "objective": objective, **OBJECTIVE_PRESETS[objective], **named, **kw})


# Which layers the explore copy quantizes is the model's rule (solrl_engine/models/tiny, SD3's:
# the image-stream MLPs, Sol-RL's choice on SD3.5-L). Measured on this model (docs/nvfp4-recipes-and-fidelity.md,
# bench/results/2026-11-22-cpu-tiny-fidelity-layer-rule.json): rank fidelity 0.876 with the rule
# against 0.761 with every layer quantized (`--set explore_layers=`), the same held-out reward after
# 60 iterations.


def tiny_sol_rl_shapes(paper_scale: bool = False, objective: str = "nft") -> RLConfig:
    """N previews in the explore precision (6 steps), top/bottom K/2 regenerated in BF16 (10 steps).
    On a GPU both go through the compiled, graph-captured sampler, as `compile` does (compiled_sampler
    defaults to on with CUDA; `--set compiled_sampler=true` compiles on a CPU too)."""
    return _tiny("sol_rl", paper_scale, objective)


def tiny_naive_scaling_shapes(paper_scale: bool = False, objective: str = "nft") -> RLConfig:
    """N BF16 rollouts at the full step count, top/bottom K/2 trained on."""
    return _tiny("naive_scaling", paper_scale, objective)


def tiny_compile_shapes(paper_scale: bool = False, objective: str = "nft") -> RLConfig:
    """As naive_scaling, through the compiled sampler (eager where compile is unavailable)."""
    return _tiny("compile", paper_scale, objective)


def tiny_naive_quant_shapes(paper_scale: bool = False, objective: str = "nft") -> RLConfig:
    """N rollouts in the explore precision at the full step count, trained on directly."""
    return _tiny("naive_quant", paper_scale, objective)


def tiny_diffusionnft_shapes(paper_scale: bool = False, objective: str = "nft") -> RLConfig:
    """Plain DiffusionNFT: K BF16 rollouts per prompt, all trained on (N = K)."""
    cfg = _tiny("diffusionnft", paper_scale, objective)
    return RLConfig(**{**cfg.__dict__, "n": cfg.k})
