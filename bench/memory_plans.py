"""The memory plans the docs quote (docs/scale.md, docs/video.md), recorded in one run: `solrl plan` of the
FLUX.1-dev, Qwen-Image, SANA-Video and Wan2.1-14B Sol-RL presets, LoRA and full fine-tuning, replicated and
FSDP2-sharded, on 80 GB GPUs. Fake tensors from the published configs: nothing is loaded or downloaded, and every
number is an estimate that no GPU's measured peak has checked.

    python bench/memory_plans.py     # prints one line per plan, writes bench/results/<date>-memory-plans.json
    python bench/memory_plans.py --only sana_video,wan14b,wan_i2v14b,wan22_a14b   # <date>-memory-plans-video.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch

from solrl_engine.rl.config import load_config
from solrl_engine.rl.memplan import PHASES, memory_plan

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"flux1": "configs/flux1.py:flux1_sol_rl_pickscore",
           "qwenimage": "configs/qwenimage.py:qwenimage_sol_rl_pickscore",
           "qwenimage_edit": "configs/qwenimage_edit.py:qwenimage_edit_sol_rl_edit",
           "sana_video": "configs/sana_video.py:sana_video_sol_rl_clipscore",
           "wan14b": "configs/wan.py:wan14b_sol_rl_clipscore",
           "wan_i2v14b": "configs/wan.py:wan_i2v14b_sol_rl_clipscore",
           "wan22_a14b": "configs/wan.py:wan22_a14b_sol_rl_clipscore"}
# (name, preset, --set overrides, GPUs)
PLANS = [
    ("flux1-lora-1gpu", "flux1", {}, 1),
    ("flux1-lora-1gpu-1024px-batch1", "flux1", {"resolution": "1024", "train_batch_size": "1"}, 1),
    ("flux1-lora-8gpu-fsdp", "flux1", {"sharding": "fsdp"}, 8),
    ("flux1-full-8gpu-none", "flux1", {"train_mode": "full"}, 8),
    ("flux1-full-8gpu-fsdp", "flux1", {"train_mode": "full", "sharding": "fsdp"}, 8),
    ("flux1-full-16gpu-fsdp", "flux1", {"train_mode": "full", "sharding": "fsdp"}, 16),
    ("qwenimage-lora-1gpu", "qwenimage", {}, 1),
    ("qwenimage-lora-1gpu-unmerged", "qwenimage", {"merge_lora": "false"}, 1),
    ("qwenimage-lora-8gpu-fsdp", "qwenimage", {"sharding": "fsdp"}, 8),
    ("qwenimage-full-8gpu-none", "qwenimage", {"train_mode": "full"}, 8),
    ("qwenimage-full-8gpu-fsdp", "qwenimage", {"train_mode": "full", "sharding": "fsdp"}, 8),
    ("qwenimage-full-16gpu-fsdp", "qwenimage", {"train_mode": "full", "sharding": "fsdp"}, 16),
    ("qwenimage-full-32gpu-fsdp", "qwenimage", {"train_mode": "full", "sharding": "fsdp"}, 32),
    # the explore copy split over the GPUs too (explore_sharding=shard; auto picks it where a whole copy does not fit)
    ("qwenimage-full-16gpu-fsdp-explore-sharded", "qwenimage", {"train_mode": "full", "sharding": "fsdp",
                                                                "explore_sharding": "shard"}, 16),
    # Qwen-Image-Edit: each edit's source tokens beside the latent's (twice Qwen-Image's image tokens at 1024 px)
    ("qwenimage_edit-lora-1gpu", "qwenimage_edit", {}, 1),
    ("qwenimage_edit-lora-8gpu-fsdp", "qwenimage_edit", {"sharding": "fsdp"}, 8),
    ("qwenimage_edit-full-32gpu-fsdp", "qwenimage_edit", {"train_mode": "full", "sharding": "fsdp"}, 32),
    # the video presets at their published 480 x 832, 81 frames (32,760 tokens a clip), whole clips on each GPU
    ("sana_video-lora-1gpu", "sana_video", {}, 1),
    ("sana_video-lora-8gpu-fsdp", "sana_video", {"sharding": "fsdp"}, 8),
    ("sana_video-full-8gpu-fsdp", "sana_video", {"train_mode": "full", "sharding": "fsdp"}, 8),
    ("wan14b-lora-1gpu", "wan14b", {}, 1),
    ("wan14b-lora-8gpu-fsdp", "wan14b", {"sharding": "fsdp"}, 8),
    ("wan_i2v14b-lora-8gpu-fsdp", "wan_i2v14b", {"sharding": "fsdp"}, 8),
    # Wan2.2-T2V-A14B: two 14B experts, both on every GPU (LoRA on both, or on the high-noise one alone)
    ("wan22_a14b-lora-1gpu", "wan22_a14b", {}, 1),
    ("wan22_a14b-lora-8gpu-fsdp", "wan22_a14b", {"sharding": "fsdp"}, 8),
    ("wan22_a14b-lora-high-8gpu-fsdp", "wan22_a14b", {"sharding": "fsdp", "lora_experts": "high"}, 8),
    ("wan22_a14b-lora-8gpu-fsdp-explore-sharded", "wan22_a14b", {"sharding": "fsdp", "explore_sharding": "shard"}, 8),
    # context parallelism: each clip's 32,760 tokens over 4 ranks (2 groups of 4 on 8 GPUs)
    ("wan14b-lora-8gpu-fsdp-cp4", "wan14b", {"sharding": "fsdp", "context_parallel": "4"}, 8),
    ("wan22_a14b-lora-8gpu-fsdp-cp4", "wan22_a14b", {"sharding": "fsdp", "context_parallel": "4"}, 8),
    # 720p (720 x 1280, 81 frames: 75,600 tokens a clip), the other size the A14B models are published for
    ("wan14b-lora-8gpu-fsdp-cp4-720p", "wan14b", {"sharding": "fsdp", "context_parallel": "4", "resolution": "720",
                                                  "width": "1280"}, 8),
    ("wan22_a14b-lora-8gpu-fsdp-cp4-720p", "wan22_a14b", {"sharding": "fsdp", "context_parallel": "4",
                                                          "resolution": "720", "width": "1280"}, 8),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated presets among {', '.join(PRESETS)}")
    only = [p for p in ap.parse_args(argv).only.split(",") if p]
    unknown = sorted(set(only) - set(PRESETS))
    if unknown:
        raise SystemExit(f"--only: unknown preset(s) {unknown}; choose among {', '.join(PRESETS)}")
    rows = {}
    for name, preset, sets, gpus in PLANS:
        if only and preset not in only:
            continue
        cfg = load_config(str(ROOT / PRESETS[preset]), [f"{k}={v}" for k, v in sets.items()])
        plan = memory_plan(cfg, gpus=gpus, gpu_gib=80.0)
        d = plan.to_dict()
        d["command"] = " ".join([f"solrl plan {PRESETS[preset]}", *(f"--set {k}={v}" for k, v in sets.items()),
                                 f"--gpus {gpus} --gpu-memory 80 --json plan.json"])  # fmt: skip
        d["phases_gib"] = {w: plan.total(w) for w in PHASES}
        rows[name] = d
        print(f"{name:32s} peak {plan.peak_gib:6.1f} GiB ({plan.peak_phase}); "
              + ", ".join(f"{w} {plan.total(w):.1f}" for w in PHASES) + ("" if plan.fits else "  DOES NOT FIT"))
    video = bool(only) and all(PRESETS[p].startswith(("configs/sana_video", "configs/wan")) for p in only)
    tail = "-video" if video else "-" + "-".join(only) if only else ""
    out = ROOT / "bench" / "results" / f"{dt.date.today().isoformat()}-memory-plans{tail}.json"
    out.write_text(json.dumps({
        "what": f"per-GPU memory plans (solrl plan) of the {', '.join(only or PRESETS)} Sol-RL presets on 80 GB GPUs, "
                "LoRA and full fine-tuning, replicated and FSDP2-sharded (sharding=fsdp; start-up staged on the "
                "CPU), the explore copy whole or split (explore_sharding); fake tensors from the published configs, "
                "nothing loaded; estimates, never compared with a GPU's measured peak",
        "date": dt.date.today().isoformat(), "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
