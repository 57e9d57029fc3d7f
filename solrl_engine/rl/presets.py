"""The paper's presets for the real models, kept as data: one table of hyper-parameters shared by every
run and one per model, expanded by `define_presets` into a config function per (family, reward). So
configs/sd3.py, configs/flux1.py and configs/sana.py are each one call, no two presets can drift
apart, and a change of the paper's numbers is one edit here.

Sources: Sol-RL (arXiv 2604.06916) and its official configs (NVlabs/Sana, configs/sol_rl/{base,sd3,
flux1,sana}.py, on DiffusionNFT's), cited per value below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from solrl_engine.rl.config import FAMILIES, FAMILY_TABLE, ConfigError, RLConfig, unknown_key_error

REWARDS = ("imagereward", "clipscore", "pickscore", "hpsv2", "hpsv3", "ocr", "vlm")
# a reward with prompt sets of its own (train, eval): text rendering's prompts quote the text to render
REWARD_PROMPTS = {"ocr": ("ocr/train", "ocr/test")}
# a reward's default reward_args: the VLM judge as `vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8001` serves it
# (--set reward_args=... replaces them whole)
REWARD_ARGS = {"vlm": ("vlm.url=http://127.0.0.1:8001", "vlm.model=Qwen/Qwen2.5-VL-7B-Instruct")}
# an editing model's presets (a conditioned model: its prompts carry source images) take these rewards; "edit" is
# the instruction's CLIP direction against how much of the source is kept (rewards/edit.py), the server-free pair
EDIT_REWARDS = ("edit", "clip_direction", "vlm")
REWARD_SPECS = {"edit": "clip_direction:1.0,preserve:0.5"}  # a preset's reward name -> the `reward` it runs
# an image-to-video model's presets: the image rewards on frames (text rendering has its own prompts, not clips
# started from an image)
I2V_REWARDS = tuple(r for r in REWARDS if r not in REWARD_PROMPTS)

# What every paper run shares (official configs/sol_rl/base.py and the per-model _set_bon_combo):
# 48 prompt groups per iteration, N = 96 explored ("num_image_per_prompt"), K = 24 trained on
# ("best_of_n", top 12 + bottom 12), 6 preview and 10 full steps, LoRA r32 / a64 on the attention
# projections, AdamW lr 3e-4, weight decay 1e-4, DiffusionNFT beta 1, KL 1e-4, advantages clipped at 5,
# the "old" adapter's decay_type 1 (rate 0.001, at most 0.5). Checkpoints every 5 iterations and an
# evaluation every 20 (base.py save_freq, eval_freq). The official runs have no iteration count (they
# run until stopped); 300 is this project's choice.
COMMON: dict[str, Any] = dict(
    n=96,
    k=24,
    prompts_per_iter=48,
    preview_steps=6,
    full_steps=10,
    lora_rank=32,
    lora_alpha=64,
    lr=3e-4,
    weight_decay=1e-4,
    beta=1.0,
    kl_beta=1e-4,
    adv_clip=5.0,
    old_decay_rate=0.001,
    old_decay_max=0.5,
    model_path=None,  # the model's default weights (its hub id)
    resolution=None,  # the model's default, the paper's: SD3.5-L 1024, FLUX.1 512, SANA 1024
    train_prompts="sample/train",  # the paper's: DiffusionNFT's dataset/pickscore (train.txt, test.txt)
    eval_prompts="sample/test",
    eval_prompt_count=16,  # the bundled test split; a larger set is cut to this many prompts
    eval_seeds=2,
    eval_every=20,
    save_every=5,
    iterations=300,
)

# Per model. Timestep fraction 0.4 for FLUX (flux1.py), 0.6 else (base.py); gradient clip 0.002 from
# base.py for SD3.5, 1.0 set by flux1.py and sana.py. The official sampler is the DPM-Solver-2 ODE for
# SD3.5 and FLUX (sample.solver "dpm2") and deterministic Euler for SANA (solver "flow", eta 0). FLUX's
# LoRA targets are to_q/k/v/out.0 only (no context-stream add_* projections); SD3.5's and SANA's are
# the models' defaults, as are resolution and sigma schedule.
# Guidance and shift stay the models' (None), so the trainer samples as `Explorer` on the same
# pipeline does. The official runs are CFG-free (guidance 1.0 for rollouts, the update and
# evaluation): the SD3.5 and SANA defaults are 1.0, but FLUX.1-dev's distilled-guidance default here is
# 3.5 where the official value is 1.0 (pass guidance_scale=1.0 to match), and the official SANA sampler
# uses the unshifted linspace(1, 0, steps + 1) schedule (shift=1.0) on its Linear-FFN SANA.
#
# Batch sizes (the official ones are per GPU of 8 B200s, 180 GB: rollouts 24, updates SD3.5 4, FLUX 12 with
# gradient checkpointing, SANA 16). All are micro-batches (the update accumulates gradients into one optimizer
# step), so they change memory and speed, never the result. The update's micro-batch and recompute are left at
# auto: sized at start from the GPU's memory plan (rl/sizing.py), the largest micro-batch that fits without
# recompute, so an H200 runs larger ones than an H100 (the fixed 80 GB estimates the presets used to set, e.g.
# FLUX 12 with every block recomputed, are the GPU session's forwards-stage settings, bench/session_train.py).
# Rollouts are inference without CFG, a few hundred MB of activations per image: 24 for all (the official size,
# already compute-bound at 1024-4096 image tokens). VAE decodes at 1024 px take a few GB per image: 4 at a time
# for SD3.5 and SANA, 8 for FLUX at 512 px (estimates: no real weights have run yet).
PAPER: dict[str, dict[str, Any]] = {
    "sd3": dict(
        model="sd3",
        solver="dpm2",
        guidance_scale=None,
        shift=None,
        timestep_fraction=0.6,
        grad_clip=0.002,
        rollout_batch_size=24,
        decode_batch_size=4,
    ),
    "flux": dict(
        model="flux",
        solver="dpm2",
        guidance_scale=None,
        shift=None,
        timestep_fraction=0.4,
        grad_clip=1.0,
        lora_targets=("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
        rollout_batch_size=24,
        decode_batch_size=8,
    ),
    "sana": dict(
        model="sana",
        solver="euler",
        guidance_scale=None,
        shift=None,
        timestep_fraction=0.6,
        grad_clip=1.0,
        rollout_batch_size=24,
        decode_batch_size=4,
    ),
}

# Wan (text-to-video; model="wan", configs/wan.py): the published inference settings of each model, from the
# WanPipeline docstring and the official configs (diffusers' conversion script): 480 x 832 and 81 frames for
# Wan2.1 (shift 3.0 at 480p; 5.0 at 720p), 704 x 1280 and 121 frames for Wan2.2-TI2V-5B (shift 5.0), 50 UniPC
# steps, guidance 5.0 against the empty prompt. No Sol-RL paper exists for video: the explore / select / train
# settings are the image presets' (N = 96, K = 24, 48 prompts, LoRA r32 on the attention projections), and the
# preview runs 30 of the 50 steps (the paper's 6 of 10). One iteration is then thousands of clip-forwards: on one
# GPU lower prompts_per_iter and the steps (e.g. --set full_steps=20 --set preview_steps=12); docs/video.md prices
# it. Batches for one 80 GB GPU (estimates, no real weights have run): a 480p 81-frame clip is 32,760 tokens, so
# rollouts 4 at a time (1.3B; 2 for 5B and 14B), the VAE one clip at a time; the update is sized at start (auto:
# one sample with as many blocks recomputed as its memory needs, rl/sizing.py). Wan2.1-14B's weights alone are
# 28 GB in BF16: with its explore copy and rollouts it wants an H200 or sharding across GPUs.
_WAN = dict(model="wan", solver="unipc", guidance_scale=5.0, full_steps=50, preview_steps=30, timestep_fraction=0.6,
            grad_clip=1.0, decode_batch_size=1)  # fmt: skip
PAPER["wan2.1-1.3b"] = dict(_WAN, model_path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", resolution=480, width=832, frames=81,
                            shift=3.0, rollout_batch_size=4)  # fmt: skip
PAPER["wan2.1-14b"] = dict(_WAN, model_path="Wan-AI/Wan2.1-T2V-14B-Diffusers", resolution=480, width=832, frames=81,
                           shift=3.0, rollout_batch_size=2)  # fmt: skip
# Wan2.1-I2V-14B (model="wan_i2v", configs/wan.py:wan_i2v14b_*): the T2V 14B's settings at 480 x 832, 81 frames and
# shift 3.0 (the 480P checkpoint's), each clip started from its prompt's image: the bundled image-to-video set
# (i2v/train, i2v/test: motions from images the project draws; a real run brings its own JSONL)
PAPER["wan2.1-i2v-14b"] = dict(_WAN, model="wan_i2v", model_path="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                               resolution=480, width=832, frames=81, shift=3.0, rollout_batch_size=2,
                               train_prompts="i2v/train", eval_prompts="i2v/test")  # fmt: skip
# Wan2.2-T2V-A14B (configs/wan.py:wan22_a14b_*): two 14B experts switched at boundary_ratio 0.875 (models/experts.py),
# with the official t2v_A14B config's 40 steps and shift 12.0 at 480 x 832, 81 frames, and its guidance per expert:
# 4.0 for the high-noise expert, 3.0 for the low-noise one (guidance_scale_2, as WanPipeline takes them). The preview
# runs 24 of the 40 steps.
PAPER["wan2.2-a14b"] = dict(_WAN, model_path="Wan-AI/Wan2.2-T2V-A14B-Diffusers", resolution=480, width=832, frames=81,
                            shift=12.0, guidance_scale=4.0, guidance_scale_2=3.0, full_steps=40, preview_steps=24,
                            rollout_batch_size=2)  # fmt: skip
PAPER["wan2.2-5b"] = dict(_WAN, model_path="Wan-AI/Wan2.2-TI2V-5B-Diffusers", resolution=704, width=1280, frames=121,
                          shift=5.0, rollout_batch_size=2)  # fmt: skip

# Qwen-Image (model="qwenimage", configs/qwenimage.py): the model card's inference settings, as its quick-start
# calls QwenImagePipeline: 1328 x 1328 (its 1:1 size; the pipeline's own default is 1024), 50 steps, true_cfg_scale
# 4.0 against a negative prompt. The engine's guidance is plain CFG against the empty prompt, without the
# pipeline's rescale of the guided velocity to the conditional one's norm (solrl_engine/models/qwenimage.py), so
# at 4.0 its images are close to, not equal to, the stock pipeline's. No Sol-RL paper exists for Qwen-Image: the
# explore / select / train settings are the image presets' (N = 96, K = 24, 48 prompts, LoRA r32 on the attention
# projections of both streams), the preview runs 30 of the 50 steps (Wan's choice; the paper's 6 of 10), the
# update's timestep fraction 0.6 and gradient clip 1.0 as SANA's. Each image is 6,889 tokens through a 20B
# transformer, twice per step with CFG: one sol_rl iteration at these settings is about 390k image forwards (48
# prompts x (96 x 30 preview + 24 x 50 regeneration steps) x 2), so on one GPU lower prompts_per_iter and the
# steps. Batches for one 80 GB GPU are estimates (no real weights have run): the BF16 transformer alone is 38 GiB
# and its NVFP4 explore copy 7 GiB more (13.6B of the 20.4B parameters at 4.5 bits), so rollouts 4 at a time, the
# VAE one image at a time; the update is sized at start from the GPU (auto); an H200 leaves room for more.
PAPER["qwenimage"] = dict(model="qwenimage", solver="euler", guidance_scale=4.0, shift=None, full_steps=50,
                          preview_steps=30, resolution=1328, timestep_fraction=0.6, grad_clip=1.0,
                          rollout_batch_size=4, decode_batch_size=1)  # fmt: skip

# Z-Image (model="z_image", configs/z_image.py): the model card's call of Tongyi-MAI/Z-Image (the base model), 50
# steps, guidance_scale 4 against the empty negative prompt, cfg_normalization off; its example draws 1280 x 720,
# the presets 1024 x 1024 (the pipeline's default size, within the card's 512-2048 range). The pipeline's guidance
# g is classifier-free guidance at g + 1 in the engine's convention (solrl_engine/models/z_image.py): 5.0 here. The
# scheduler's own static shift (shift None). Explore / select / train settings as Qwen-Image's: the image presets'
# N, K and LoRA (rank 32 on the attention projections of the main layers and both refiners), the preview 30 of 50
# steps. A 6B transformer over 4,096 image tokens and the prompt's: rollouts 8 at a time on one 80 GB GPU, the VAE
# 4 images at a time (estimates: no real weights have run).
PAPER["z-image"] = dict(model="z_image", solver="euler", guidance_scale=5.0, shift=None, full_steps=50,
                        preview_steps=30, resolution=1024, timestep_fraction=0.6, grad_clip=1.0, rollout_batch_size=8,
                        decode_batch_size=4)  # fmt: skip

# FLUX.2 [klein] base 4B (model="flux2", configs/flux2.py): the Flux2KleinPipeline docstring's call of the base
# (undistilled) model, 50 steps at guidance 4.0 against the empty prompt, at the pipeline's default 1024 x 1024;
# the scheduler's own dynamic shift (shift None; the pipeline's empirical mu of tokens and steps). Explore / select /
# train settings as Qwen-Image's: the image presets' N, K and LoRA (rank 32 on both streams' attention projections
# and the single blocks' fused qkv-MLP projection), the preview 30 of 50 steps, timestep fraction 0.6. A 3.9B
# transformer over 4,096 image and 512 text tokens: rollouts 8 at a time on one 80 GB GPU, the VAE 4 at a time
# (estimates: no real weights have run).
PAPER["flux2-klein"] = dict(model="flux2", solver="euler", guidance_scale=4.0, shift=None, full_steps=50,
                            preview_steps=30, resolution=1024, timestep_fraction=0.6, grad_clip=1.0,
                            rollout_batch_size=8, decode_batch_size=4)  # fmt: skip

# FLUX.1 Kontext [dev] (model="flux_kontext", configs/flux_kontext.py): image editing, the pipeline's call, 28 steps
# at its distilled guidance 2.5 (FluxKontextPipeline.__call__'s defaults), Euler on the pipeline's sigmas, edits at
# 1024 x 1024 with each source resized to that size (solrl_engine/models/flux_kontext.py). Prompts: the bundled
# editing set (edit/train, edit/test: instructions on images the project draws; a real run brings its own JSONL).
# No Sol-RL paper exists for editing: N, K, LoRA and the update are FLUX.1's presets' (timestep fraction 0.4, clip
# 1.0), the preview runs 16 of the 28 steps (the 30-of-50 share of the video and Qwen-Image presets). Each edit is
# 4,096 latent and 4,096 source tokens, twice FLUX.1's at 1024 px: rollouts 12 at a time, decodes 4 (estimates).
PAPER["flux-kontext"] = dict(model="flux_kontext", solver="euler", guidance_scale=None, shift=None, full_steps=28,
                             preview_steps=16, resolution=1024, timestep_fraction=0.4, grad_clip=1.0,
                             rollout_batch_size=12, decode_batch_size=4, train_prompts="edit/train",
                             eval_prompts="edit/test")  # fmt: skip

# Qwen-Image-Edit (model="qwenimage_edit", configs/qwenimage_edit.py): the model card's call of Qwen/Qwen-Image-Edit,
# 50 steps, true_cfg_scale 4.0 against negative_prompt " " (encoded with the source, as the pipeline encodes it);
# the engine guides as Qwen-Image's, without the pipeline's norm rescale (solrl_engine/models/qwenimage_edit.py).
# Edits at 1024 x 1024 (the pipeline's source area), each source resized to that size. Prompts: the bundled editing
# set. The explore / select / train settings are Qwen-Image's presets' (the preview 30 of 50 steps, timestep fraction
# 0.6, clip 1.0). Each edit is 4,096 latent and 4,096 source tokens plus about 1,300 text-and-vision tokens through
# the 20B transformer, twice per step with CFG: rollouts 2 at a time, the VAE one image at a time (estimates).
PAPER["qwen-image-edit"] = dict(model="qwenimage_edit", solver="euler", guidance_scale=4.0, shift=None,
                                full_steps=50, preview_steps=30, resolution=1024, timestep_fraction=0.6,
                                grad_clip=1.0, rollout_batch_size=2, decode_batch_size=1, train_prompts="edit/train",
                                eval_prompts="edit/test")  # fmt: skip

# Qwen-Image-Edit-2509 (model="qwenimage_edit_plus", configs/qwenimage_edit.py): its model card's call of
# QwenImageEditPlusPipeline, 40 steps, true_cfg_scale 4.0 against " "; one or several sources a prompt. The rest as
# Qwen-Image-Edit's presets, the preview at 24 of the 40 steps (the 30-of-50 share). Each source adds 4,096 tokens.
PAPER["qwen-image-edit-2509"] = dict(PAPER["qwen-image-edit"], model="qwenimage_edit_plus", full_steps=40,
                                     preview_steps=24)  # fmt: skip

# SANA-Video 2B (model="sana_video", configs/sana_video.py): the published inference settings, from the
# SanaVideoPipeline docstring and diffusers' conversion of the official checkpoint: 480 x 832, 81 frames, 50
# DPM-Solver++ 2M steps on flow sigmas with shift 8 (the scheduler's own: shift None), guidance 6.0. The pipeline's
# example uses a long negative prompt and appends " motion score: 30." to every prompt; the engine guides against
# the empty prompt (as the pipeline does by default) and takes prompts as the prompt set writes them. The explore /
# select / train settings are Wan's (the image presets' N, K and LoRA; the preview 30 of 50 steps). A clip is
# 32,760 tokens through a 2B linear-attention transformer: rollouts 4 at a time, the VAE one clip at a time, as
# Wan2.1-1.3B's (estimates: no real weights have run).
PAPER["sana-video"] = dict(model="sana_video", solver="dpm2", guidance_scale=6.0, shift=None, full_steps=50,
                           preview_steps=30, resolution=480, width=832, frames=81, timestep_fraction=0.6,
                           grad_clip=1.0, rollout_batch_size=4, decode_batch_size=1)  # fmt: skip

# Per objective (rl/objectives/; `--set objective=NAME` on any preset passes it to the preset function, which takes
# these settings, then the other --sets apply): nft is COMMON's. Flow-GRPO's from the official flow_grpo configs
# (config/base.py: SDE noise_level 0.7, learning rate 3e-4, clip_range 1e-4, advantages clipped at 5; config/grpo.py:
# the KL weight beta 0.04 for its ocr and geneval runs, 0.01 for pickscore, and gradient accumulation over half the
# sampled batches, two optimizer steps per epoch). Flow-GRPO-Fast: the same, the SDE on a window of 2 steps placed
# at random in the first half (its sd3_pipeline_with_logprob_fast, sde_window_size 2, sde_window_range (0,
# num_steps // 2)). AWM: COMMON's, with a KL weight of 0.1 (Flow-Factory's recommended weight for AWM, there toward
# an EMA policy, here toward the reference). The explore / select / step budget stay the paper's for every
# objective; Flow-GRPO's own runs sample with CFG 4.5, these keep the model's guidance (the Sol-RL presets').
OBJECTIVE_PRESETS: dict[str, dict[str, Any]] = {
    "nft": {},
    "flow_grpo": dict(sde_noise_level=0.7, lr=3e-4, clip_range=1e-4, adv_clip=5.0, kl_beta=0.04, updates_per_iter=2),
    "flow_grpo_fast": dict(sde_noise_level=0.7, lr=3e-4, clip_range=1e-4, adv_clip=5.0, kl_beta=0.04,
                           updates_per_iter=2, sde_window=2, sde_window_range=None),  # fmt: skip
    "awm": dict(kl_beta=0.1),
}
OBJECTIVE_REWARD_KL = {("flow_grpo", "pickscore"): 0.01, ("flow_grpo_fast", "pickscore"): 0.01}

MODEL_NAMES = {"sd3": "SD3.5-Large", "flux": "FLUX.1-dev", "sana": "SANA-1.6B", "wan2.1-1.3b": "Wan2.1-T2V-1.3B",
               "wan2.1-14b": "Wan2.1-T2V-14B", "wan2.2-5b": "Wan2.2-TI2V-5B", "qwenimage": "Qwen-Image",
               "sana-video": "SANA-Video-2B", "z-image": "Z-Image", "flux2-klein": "FLUX.2-klein-base-4B",
               "flux-kontext": "FLUX.1-Kontext-dev", "qwen-image-edit": "Qwen-Image-Edit",
               "qwen-image-edit-2509": "Qwen-Image-Edit-2509",
               "wan2.1-i2v-14b": "Wan2.1-I2V-14B",
               "wan2.2-a14b": "Wan2.2-T2V-A14B"}  # fmt: skip
FAMILY_SUMMARY = {
    "diffusionnft": "DiffusionNFT: K BF16 rollouts per prompt, all trained on (N = K)",
    "naive_scaling": "naive scaling: N BF16 rollouts per prompt at the full step count, top/bottom K/2 trained on",
    "compile": "naive scaling through the compiled, graph-captured sampler",
    "naive_quant": "naive quantization: N rollouts in the explore precision (NVFP4 / FP8) at the full step "
    "count, top/bottom K/2 trained on directly",
    "sol_rl": "Sol-RL: N previews in the explore precision at preview_steps, the top/bottom K/2 seeds "
    "regenerated in BF16 at full_steps and trained on",
}


def _check_overrides(overrides: dict[str, Any], where: str) -> None:
    names = {f.name for f in dataclasses.fields(RLConfig)}
    for key in overrides:
        if key not in names:
            raise unknown_key_error(key, where)


def paper_config(model: str, family: str, reward: str, objective: str = "nft", **overrides: Any) -> RLConfig:
    """The paper's run of `family` on `model` with `reward`, trained with `objective` and its published settings
    (OBJECTIVE_PRESETS; keyword arguments override RLConfig fields), not validated: load_config validates after the
    --set overrides."""
    for what, value, known in (("model", model, tuple(PAPER)), ("family", family, FAMILIES),
                               ("objective", objective, tuple(OBJECTIVE_PRESETS))):  # fmt: skip
        if value not in known:
            raise ConfigError(f"no paper preset for {what} {value!r}; choose one of {known}")
    _check_overrides(overrides, f"{model}/{family}/{reward} preset")
    kw: dict[str, Any] = {**COMMON, **PAPER[model], "family": family, "reward": REWARD_SPECS.get(reward, reward),
                          "objective": objective, **OBJECTIVE_PRESETS[objective]}  # fmt: skip
    if (objective, reward) in OBJECTIVE_REWARD_KL:
        kw["kl_beta"] = OBJECTIVE_REWARD_KL[objective, reward]
    if reward in REWARD_PROMPTS:
        kw["train_prompts"], kw["eval_prompts"] = REWARD_PROMPTS[reward]
    if reward in REWARD_ARGS:
        kw["reward_args"] = REWARD_ARGS[reward]
    if FAMILY_TABLE[family].all_rollouts:  # DiffusionNFT trains on every rollout: N = K
        kw["n"] = kw["k"]
    # naive_quant and sol_rl quantize the model's default layers: explore_layers / explore_skip /
    # explore_skip_max_dim stay None (solrl_engine/models/, the official nvfp4_skip_modules / min_dim)
    return RLConfig(**{**kw, **overrides})


def _preset(model: str, family: str, reward: str, name: str) -> Callable[..., RLConfig]:
    def preset(objective: str = "nft", **overrides: Any) -> RLConfig:
        run = name if objective == "nft" else f"{name}_{objective}"  # its own run directory, runs/<name>
        return paper_config(model, family, reward, objective, **{"name": run, **overrides})

    preset.__name__ = preset.__qualname__ = name
    preset.__doc__ = (
        f"{FAMILY_SUMMARY[family]}; {MODEL_NAMES[model]} with the {reward} reward and the paper's "
        f"hyper-parameters (solrl_engine/rl/presets.py); `objective` (nft, flow_grpo, flow_grpo_fast, awm) takes "
        f"that objective's published settings. Keyword arguments override RLConfig fields."
    )
    return preset


def define_presets(namespace: dict[str, Any], model: str, prefix: str,
                   rewards: tuple[str, ...] = REWARDS) -> list[str]:  # fmt: skip
    """Write one config function `<prefix>_<family>_<reward>` per family and reward (`rewards`: an editing model's
    EDIT_REWARDS) into `namespace` (a config file's globals(), so `solrl train configs/<file>.py:<name>` finds
    them); returns the names."""
    if model not in PAPER:
        raise ValueError(f"no paper presets for model {model!r}; choose one of {tuple(PAPER)}")
    names = []
    for family in FAMILIES:
        for reward in rewards:
            name = f"{prefix}_{family}_{reward}"
            namespace[name] = _preset(model, family, reward, name)
            names.append(name)
    return names


__all__ = ["COMMON", "EDIT_REWARDS", "I2V_REWARDS", "OBJECTIVE_PRESETS", "PAPER", "REWARDS", "REWARD_ARGS",
           "REWARD_PROMPTS", "REWARD_SPECS", "define_presets", "paper_config"]
