"""A minimal Flow-GRPO-style trainer with Sol-RL's explorer as its rollout backend.

Per iteration: the explorer previews N seeds per prompt in NVFP4 and keeps the K most contrastive;
this trainer regenerates exactly those seeds from the returned noise with its own SDE sampler
(keeping each step's log-probability), scores them, takes a clipped policy-gradient step on a LoRA,
and calls `explorer.sync_` so the quantized copy follows the policy. Everything but `Explorer` is
the caller's own code, written here against an SD3 pipeline.

    python examples/grpo_loop.py --pipeline /w/sd35-large --iterations 100
"""

import argparse
import math

import torch
from diffusers import StableDiffusion3Pipeline
from peft import LoraConfig

from solrl_engine.explore import Explorer


def redness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))


def velocity(pipe, x, t, emb, pooled):
    return pipe.transformer(hidden_states=x, timestep=t * 1000, encoder_hidden_states=emb, pooled_projections=pooled,
                            return_dict=False)[0]  # fmt: skip


def sde_step(x, v, t, t_next, noise_level=0.7, noise=None):
    """Flow-GRPO's SDE step from t to t_next: the Gaussian's mean and std, and a sample from it."""
    dt = t_next - t
    std = noise_level * math.sqrt(t / (1 - t)) if t < 1 else noise_level
    mean = x + (v + std**2 / (2 * t) * (x + (1 - t) * v)) * dt
    scale = std * math.sqrt(-dt)
    if noise is None:
        noise = torch.randn_like(x)
    return mean, scale, mean + scale * noise


def log_prob(x_next, mean, scale):
    return (-((x_next - mean) ** 2) / (2 * scale**2) - math.log(scale) - 0.5 * math.log(2 * math.pi)).mean((1, 2, 3))


ap = argparse.ArgumentParser()
ap.add_argument("--pipeline", required=True)
ap.add_argument("--resolution", type=int, default=None)
ap.add_argument("--iterations", type=int, default=2)
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()
torch.manual_seed(0)
pipe = StableDiffusion3Pipeline.from_pretrained(args.pipeline, torch_dtype=torch.float32)
pipe.set_progress_bar_config(disable=True)
pipe.transformer.requires_grad_(False)
pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["attn.to_q"]))
params = [p for n, p in pipe.transformer.named_parameters() if "lora" in n]
for p in params:
    p.requires_grad_(True)
opt = torch.optim.AdamW(params, lr=1e-3)
explorer = Explorer(pipe, redness, n=8, k=4, preview_steps=2, explore_precision="nvfp4", resolution=args.resolution)
prompts = ["a red apple on a table", "a sunset over the sea"]
with torch.no_grad():
    emb, _, pooled, _ = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False)
sched = pipe.scheduler
sched.set_timesteps(args.steps)
sig = sched.sigmas.tolist()

for it in range(args.iterations):
    sel = explorer.select(prompts)  # 1. cheap NVFP4 previews -> the K most contrastive seeds
    k = len(sel.seeds[0])
    e, pl = emb.repeat_interleave(k, 0), pooled.repeat_interleave(k, 0)
    x, traj = sel.noise.clone(), []
    with torch.no_grad():  # 2. our own SDE rollout of exactly those seeds, with log-probs
        for i in range(args.steps):
            v = velocity(pipe, x, torch.full((len(x),), sig[i]), e, pl)
            mean, scale, x_next = sde_step(x, v, sig[i], sig[i + 1]) if sig[i + 1] > 0 else (None, None, x - sig[i] * v)
            if mean is not None:
                traj.append((x, x_next, sig[i], sig[i + 1], log_prob(x_next, mean, scale)))
            x = x_next
        z = x / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        images = (pipe.vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
    r = redness(images, sel.flat_prompts).view(len(prompts), k)  # 3. rewards -> group advantages
    adv = ((r - r.mean(1, keepdim=True)) / (r.std() + 1e-4)).flatten()
    opt.zero_grad()
    for x_t, x_next, t, t_next, lp_old in traj:  # 4. clipped policy gradient over the steps
        v = velocity(pipe, x_t, torch.full((len(x_t),), t), e, pl)
        mean, scale, _ = sde_step(x_t, v, t, t_next, noise=torch.zeros_like(x_t))
        ratio = torch.exp(log_prob(x_next, mean, scale) - lp_old)
        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() / len(traj)
        loss.backward()
    opt.step()
    n = explorer.sync_(pipe.transformer)  # 5. the quantized explore copy follows the policy, in place
    print(f"iter {it}: reward {r.mean().item():.4f}, proxy Spearman {sel.fidelity(r)['spearman']:.2f}, "
          f"{n} quantized layers refreshed")
