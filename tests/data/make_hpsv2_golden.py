"""Regenerate hpsv2_golden.safetensors: a tiny random open_clip CLIP, its scores as HPSv2 computes
them (diag of normalised image @ text features), so tests/test_rewards_real.py can check that
solrl_engine.rewards.hpsv2.map_open_clip_keys reproduces open_clip in transformers' CLIPModel.

open_clip needs torchvision, which does not import beside the CPU torch wheel of the main
environment, so run this in a separate one, e.g.:

    python -m venv /tmp/ocvenv && . /tmp/ocvenv/bin/activate
    pip install torch==2.14.1 torchvision==0.29.1 open_clip_torch safetensors
    python tests/data/make_hpsv2_golden.py
"""

from __future__ import annotations

import json
from pathlib import Path

import open_clip
import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
from safetensors.torch import save_file

OUT = Path(__file__).with_name("hpsv2_golden.safetensors")
GEOMETRY = dict(embed_dim=16, image_size=32, patch_size=8, vision_width=32, vision_layers=2, vision_head_width=16,
                text_width=32, text_heads=2, text_layers=2, vocab_size=1000, context_length=77)  # fmt: skip


def main() -> None:
    g = GEOMETRY
    torch.manual_seed(0)
    model = CLIP(
        embed_dim=g["embed_dim"],
        vision_cfg=CLIPVisionCfg(layers=g["vision_layers"], width=g["vision_width"], head_width=g["vision_head_width"],
                                 patch_size=g["patch_size"], image_size=g["image_size"], mlp_ratio=4.0),
        text_cfg=CLIPTextCfg(context_length=g["context_length"], vocab_size=g["vocab_size"], width=g["text_width"],
                             heads=g["text_heads"], layers=g["text_layers"], mlp_ratio=4.0),
    ).eval()  # fmt: skip
    with torch.no_grad():  # O(1) random weights everywhere, so a wrong map cannot hide behind zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(4, 3, g["image_size"], g["image_size"], generator=gen)  # already normalised
    tokens = torch.zeros(4, g["context_length"], dtype=torch.long)
    for i, n in enumerate((5, 9, 3, 12)):  # start token, n random tokens, end token (the max id), zero padding
        tokens[i, 0] = g["vocab_size"] - 2
        tokens[i, 1 : n + 1] = torch.randint(1, g["vocab_size"] - 2, (n,), generator=gen)
        tokens[i, n + 1] = g["vocab_size"] - 1
    with torch.no_grad():
        img = model.encode_image(pixels, normalize=True)
        txt = model.encode_text(tokens, normalize=True)
        scores = torch.diagonal(img @ txt.T).contiguous()
    state = {f"state_dict.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file({**state, "pixels": pixels, "tokens": tokens, "scores": scores}, OUT,
              metadata={"geometry": json.dumps(g), "open_clip": open_clip.__version__})  # fmt: skip
    print(f"wrote {OUT}: scores {scores.tolist()}")


if __name__ == "__main__":
    main()
