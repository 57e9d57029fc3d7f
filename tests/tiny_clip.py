"""Test support: a tiny random-weight transformers CLIPModel with a CLIP tokenizer and image
processor built offline (byte-level BPE over the 256 bytes and their </w> forms), saved with
save_pretrained: what `clipscore`, `pickscore` and `hpsv2` load a real model from."""

from __future__ import annotations

from pathlib import Path

import torch


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's printable stand-in for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def clip_tokenizer(max_length: int = 77):  # noqa: ANN201 - transformers CLIPTokenizer
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    merges = [("r", "e"), ("a", "p"), ("e", "d</w>"), ("o", "n</w>")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for t in ("<|startoftext|>", "<|endoftext|>"):
        vocab[t] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


# CLIP ViT-H/14 as PickScore and HPSv2 use it (open_clip's ViT-H-14: laion/CLIP-ViT-H-14-laion2B-s32B-b79K), for a
# reward of the published architecture and size with random weights (the GPU session's trainer stage)
VIT_H_14 = {"text": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
            "vision": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                           patch_size=14),
            "projection_dim": 1024, "image_size": 224, "vocab_size": 49408}  # fmt: skip


def clip_config(vocab_size: int, image_size: int = 32, eos_token_id: int = 2, projection_dim: int = 16,
                text: dict | None = None, vision: dict | None = None):  # noqa: ANN201
    """A tiny CLIPConfig (GELU, eps 1e-5 as open_clip ViT-H-14); eos_token_id=2 selects argmax
    pooling of the end token, as open_clip does. `text` / `vision` override the towers' sizes."""
    from transformers import CLIPConfig

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
                eos_token_id=eos_token_id) | (text or {})  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=8, hidden_act="gelu",
                  layer_norm_eps=1e-5) | (vision or {})  # fmt: skip
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)


def build_clip_reward(path: str | Path, image_size: int = 32, seed: int = 0, published: dict | None = None,
                      device: str = "cpu") -> Path:  # fmt: skip
    """save_pretrained a tiny CLIPModel + tokenizer + CLIPImageProcessor into `path`; `published` (VIT_H_14) builds
    that architecture at its size instead, its vocabulary included (the stand-in tokenizer uses the first ids), on
    `device` (a GPU initialises a billion weights in seconds) and saved in FP16."""
    from transformers import CLIPImageProcessor, CLIPModel

    path = Path(path)
    tok = clip_tokenizer()
    torch.manual_seed(seed)
    if published is not None:
        image_size = published["image_size"]
        config = clip_config(published["vocab_size"], image_size, tok.eos_token_id, published["projection_dim"],
                             published["text"], published["vision"])  # fmt: skip
    else:
        config = clip_config(len(tok), image_size, eos_token_id=tok.eos_token_id)
    with torch.device(device):
        model = CLIPModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    (model.half() if published is not None else model).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
                       ).save_pretrained(path)  # fmt: skip
    return path
