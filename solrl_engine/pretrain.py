"""`solrl pretrain-tiny`: train the bundled tiny model by rectified flow on the procedural shapes world.

Logit-normal t, velocity target (noise - x0), prompt dropout for optional guidance, AdamW with
warm-up and cosine decay, an EMA of the weights (the EMA is what ships). Checkpoints
(OUT/checkpoints/iter_<step>: safetensors + JSON + a checksum manifest, never a pickle; see
solrl_engine.store.checkpoint) are written atomically every `save_every` steps and `resume=True`
continues from the newest one that verifies, so a crash loses at most that many steps. An old
OUT/checkpoint.pt still resumes when it holds only tensors and plain values. Writes a loss curve
PNG, sample grids and a metrics file as it goes.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from solrl_engine.data import shapes as world
from solrl_engine.evaluation import evaluate, generate
from solrl_engine.models.tiny.model import TinyConfig, TinyT2I
from solrl_engine.rewards import load_reward
from solrl_engine.store import checkpoint
from solrl_engine.viz import image_grid, line_plot, save_image


@dataclass
class PretrainConfig:
    steps: int = 6000
    batch_size: int = 32
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup: int = 200
    seed: int = 0
    cond_dropout: float = 0.1
    ema_decay: float = 0.999
    log_every: int = 50
    save_every: int = 250
    sample_every: int = 1000
    eval_seeds: int = 4  # per held-out prompt, for the final reward
    threads: int = 0  # torch threads; 0 = leave as is

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError("cond_dropout must be in [0, 1)")


def _lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


LEGACY_CHECKPOINT = "checkpoint.pt"  # the pickled checkpoint of earlier versions


def _resume_state(out: Path) -> dict | None:
    """The newest checkpoint that verifies (damaged ones are named and skipped), else an old
    checkpoint.pt read with weights_only=True; None when there is neither."""
    found = checkpoint.pick(out / "checkpoints")
    if found is not None:
        return checkpoint.load(found)
    legacy = out / LEGACY_CHECKPOINT
    return checkpoint.load_legacy(legacy) if legacy.exists() else None


def _sample_grid(model: TinyT2I, path: Path, header: str) -> None:
    prompts = world.prompts("heldout")[:8] + world.prompts("train")[::97][:8]
    images = generate(model, prompts, list(range(len(prompts))), steps=10)
    rewards = load_reward("shapes")(images, prompts)
    save_image(image_grid(images, [f"{r:.2f}" for r in rewards.tolist()], ncol=8, header=header), path)


def pretrain_tiny(
    output: str | Path,
    cfg: PretrainConfig | None = None,
    model_config: TinyConfig | None = None,
    resume: bool = False,
    device: str | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Train from scratch (or resume) into `output`; returns the final metrics."""
    cfg = cfg or PretrainConfig()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    model = TinyT2I(model_config).to(dev)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    losses: list[tuple[int, float]] = []
    start = 0
    st = _resume_state(out) if resume else None
    if st is not None:
        model.load_state_dict(st["model"])
        ema.load_state_dict(st["ema"])
        opt.load_state_dict(st["opt"])
        rng.setstate(st["rng"])
        gen.set_state(st["gen"])
        losses, start = [tuple(x) for x in st["losses"]], st["step"]
    elif resume:
        print(f"no checkpoint in {out}; starting from scratch")
    (out / "pretrain_config.json").write_text(json.dumps({"pretrain": asdict(cfg), "model": asdict(model.config)}))
    train_prompts = world.prompts("train")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="pretrain-tiny")
    t0 = time.time()
    running = None
    for step in bar:
        prompts = [rng.choice(train_prompts) for _ in range(cfg.batch_size)]
        x0 = model.encode_images(world.render_batch(prompts, rng.randrange(2**31))).to(dev)
        prompts = ["" if rng.random() < cfg.cond_dropout else p for p in prompts]
        t = torch.sigmoid(torch.randn(cfg.batch_size, generator=gen)).to(dev)
        noise = torch.randn(x0.shape, generator=gen).to(dev)
        tb = t.view(-1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * noise
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        v = model.velocity(xt, t, model.encode_prompts(prompts))
        loss = torch.nn.functional.mse_loss(v.float(), (noise - x0).float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            d = min(cfg.ema_decay, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - d)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        bar.set_postfix(loss=f"{running:.4f}", lr=f"{_lr_at(step, cfg):.1e}")
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            losses.append((done, running))
            line_plot(
                out / "loss.png",
                {"loss (EMA 0.98)": ([s for s, _ in losses], [v for _, v in losses])},
                "tiny model pretraining",
                "step",
                "rectified-flow loss",
            )
        if done % cfg.save_every == 0 or done == cfg.steps:
            checkpoint.save(
                out / "checkpoints",
                done,
                {
                    "model": model.state_dict(),
                    "ema": ema.state_dict(),
                    "opt": opt.state_dict(),
                    "rng": rng.getstate(),
                    "gen": gen.get_state(),
                    "losses": losses,
                    "step": done,
                },
            )
        if done % cfg.sample_every == 0 and done < cfg.steps:
            _sample_grid(ema, out / f"samples_{done:06d}.png", f"step {done} (EMA), held-out then train prompts")
            ema.save(out / f"ema_{done:06d}")  # milestones, to compare or fall back to
    ema.save(out)
    _sample_grid(ema, out / "samples_final.png", f"final (step {cfg.steps}), held-out then train prompts")
    reward = load_reward("shapes")
    held = evaluate(ema, reward, world.prompts("heldout"), seeds_per_prompt=cfg.eval_seeds, steps=10)
    train_sub = world.prompts("train")[::11][:64]
    tr = evaluate(ema, reward, train_sub, seeds_per_prompt=cfg.eval_seeds, steps=10)
    metrics = {
        "steps": cfg.steps,
        "final_loss": losses[-1][1] if losses else float("nan"),
        "heldout_reward_mean": held["reward_mean"],
        "heldout_reward_std": held["reward_std"],
        "train_reward_mean": tr["reward_mean"],
        "eval_images": held["n"],
        "wall_s_this_run": time.time() - t0,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
