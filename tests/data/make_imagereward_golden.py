"""Regenerate imagereward_golden.safetensors: a TINY random-weight ImageReward built from the
`image-reward` package's own classes, its inputs, its token ids and its own scores, so that CI (which
cannot install the package: it pins timm==0.6.13) can check our transformers-based re-implementation
and key map in solrl_engine/rewards/imagereward.py against the real thing.

Run it in a throwaway environment, never the project's:

    python3.11 -m venv /tmp/irvenv && . /tmp/irvenv/bin/activate
    pip install torch==2.13.0 && pip install image-reward numpy      # pulls torch 2.14.1, torchvision 0.29.1
    pip install transformers==4.36.2 datasets==2.21.0 diffusers==0.31.0  # med.py needs transformers 4.x
    python tests/data/make_imagereward_golden.py

`import ImageReward` also imports openai's `clip` (a GitHub-only package) for its CLIPScore and
Aesthetic scorers; the ImageReward scoring path never touches it, so it is stubbed here.
bert-base-uncased cannot be downloaded either: the package's own `init_tokenizer` runs unchanged, but
`BertTokenizer.from_pretrained` is pointed at a tiny WordPiece vocab written below (and stored in the
golden file's metadata, for the test to rebuild the same tokenizer).

What is stored: `sd.<key>` every tensor of the package model's state_dict, under the package's own key
names; `image<i>` the uint8 [3, H, W] images; `crop<i>` (for images not already 224x224) the uint8
[3, 224, 224] image the package's PIL preprocessing (Resize(224, bicubic) + CenterCrop(224)) made of it; `input_ids` and
`attention_mask` from the package's tokenizer; `score` the package's `ImageReward.score(prompt, image)`
for each pair; and in the metadata the prompts, the vocab, the tiny sizes and the versions used.
Nothing of the package is committed: only its outputs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
OUT = HERE / "imagereward_golden.safetensors"

TINY = {
    "vision_width": 32,
    "vision_layers": 2,
    "vision_heads": 2,
    "patch_size": 16,
    "image_size": 224,
    "text_width": 32,
    "text_layers": 2,
    "text_heads": 2,
    "text_intermediate": 64,
    "max_positions": 64,
}

PROMPTS = [
    "a photo of a red cat sitting on the blue sofa",
    "An astronaut riding a horse, oil painting at sunset!",
    # long enough to be cut at max_length=35 tokens (most words split into WordPiece pieces)
    "a very detailed painting of the old lighthouse on a cliff above the stormy sea, with seagulls, "
    "waves, dramatic clouds and warm golden light, trending on artstation",
]

WORDS = (
    "a an the of on in at with and photo painting red blue green cat dog sitting sofa astronaut riding horse "
    "oil sunset very old sea light cloud ##s ##ing ##ed ##er"
).split()


def _vocab() -> list[str]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    digits = [str(d) for d in range(10)]
    punct = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = letters + digits + punct + ["##" + c for c in letters + digits]
    return special + pieces + [w for w in WORDS if w not in pieces]


def _stub_clip() -> None:
    try:
        import clip  # noqa: F401
    except ImportError:
        sys.modules["clip"] = types.ModuleType("clip")


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Give every tensor a random, O(1)-scale value so that each key of the map matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # LayerNorm scales
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("cls_token", "pos_embed")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)


def _images(gen: torch.Generator) -> list[np.ndarray]:
    """HWC uint8: white noise at 224x224, a smooth non-square image (exercises resize + crop), and a
    smooth 224x224 one."""
    noise = torch.randint(0, 256, (224, 224, 3), generator=gen, dtype=torch.uint8)

    def smooth(h: int, w: int) -> torch.Tensor:
        low = torch.rand(1, 3, 6, 8, generator=gen)
        up = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)[0]
        up = up + 0.08 * torch.rand(3, h, w, generator=gen)
        return (up.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)

    return [noise.numpy(), smooth(96, 136).numpy(), smooth(224, 224).numpy()]


def main() -> None:
    _stub_clip()
    import importlib

    import ImageReward as RM  # noqa: N814
    import timm
    import torchvision
    import transformers
    from ImageReward.models.BLIP import blip, blip_pretrain
    from ImageReward.models.BLIP.vit import VisionTransformer

    ir_mod = importlib.import_module("ImageReward.ImageReward")  # the module, not the class

    tok_dir = Path(tempfile.mkdtemp())
    vocab = _vocab()
    (tok_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")

    class LocalBertTokenizer(blip.BertTokenizer):
        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):  # noqa: ANN001, ANN206
            assert name == "bert-base-uncased", name
            return super().from_pretrained(str(tok_dir), *args, do_lower_case=True, **kwargs)

    def tiny_vit(vit, image_size, *args, **kwargs):  # noqa: ANN001, ANN202
        assert vit == "large" and image_size == TINY["image_size"]
        enc = VisionTransformer(
            img_size=image_size,
            patch_size=TINY["patch_size"],
            embed_dim=TINY["vision_width"],
            depth=TINY["vision_layers"],
            num_heads=TINY["vision_heads"],
        )
        return enc, TINY["vision_width"]

    blip.BertTokenizer = LocalBertTokenizer
    blip_pretrain.create_vit = tiny_vit
    orig_mlp = ir_mod.MLP
    ir_mod.MLP = lambda _input_size: orig_mlp(TINY["text_width"])  # the package hard-codes MLP(768)

    n_vocab = len(vocab) + 2  # init_tokenizer adds [DEC] and [ENC]
    med = {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": TINY["text_width"],
        "initializer_range": 0.02,
        "intermediate_size": TINY["text_intermediate"],
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": TINY["max_positions"],
        "model_type": "bert",
        "num_attention_heads": TINY["text_heads"],
        "num_hidden_layers": TINY["text_layers"],
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": n_vocab,
        "encoder_width": 768,  # overwritten with the vision width by BLIP_Pretrain, as in the real model
        "add_cross_attention": True,
    }
    med_path = tok_dir / "med_config.json"
    med_path.write_text(json.dumps(med))

    torch.manual_seed(0)
    model = RM.ImageReward(med_config=str(med_path), device="cpu")
    assert len(model.blip.tokenizer) == n_vocab, len(model.blip.tokenizer)
    gen = torch.Generator().manual_seed(1234)
    _randomize(model, gen)
    model.eval()

    images = _images(gen)
    out: dict[str, torch.Tensor] = {}
    scores = []
    for i, (arr, prompt) in enumerate(zip(images, PROMPTS, strict=True)):
        pil = Image.fromarray(arr)
        with torch.no_grad():
            scores.append(model.score(prompt, pil))
        cropped = model.preprocess.transforms[1](model.preprocess.transforms[0](pil))  # Resize, CenterCrop
        out[f"image{i}"] = torch.from_numpy(arr).permute(2, 0, 1).contiguous()
        if cropped.size == pil.size:  # 224x224 in: the package's Resize and CenterCrop leave it as is
            assert np.array_equal(np.asarray(cropped), arr)
        else:
            out[f"crop{i}"] = torch.from_numpy(np.asarray(cropped).copy()).permute(2, 0, 1).contiguous()

    tok = model.blip.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    # the batched differentiable path (ReFL's) must agree with the per-image one
    pix = torch.stack([model.preprocess(Image.fromarray(a)) for a in images])
    with torch.no_grad():
        batched = model.score_gard(tok.input_ids, tok.attention_mask, pix).flatten()
    assert torch.allclose(batched, torch.tensor(scores), atol=1e-5), (batched, scores)

    for k, v in model.state_dict().items():
        out[f"sd.{k}"] = v.detach().clone().contiguous()
    out["input_ids"] = tok.input_ids
    out["attention_mask"] = tok.attention_mask
    out["score"] = torch.tensor(scores, dtype=torch.float64)

    import importlib.metadata as md

    meta = {
        "prompts": json.dumps(PROMPTS),
        "vocab": "\n".join(vocab),
        "tiny": json.dumps(TINY),
        "special_tokens": json.dumps(
            {"bos": model.blip.tokenizer.bos_token_id, "enc": model.blip.tokenizer.enc_token_id}
        ),
        "mean_std": json.dumps([model.mean, model.std]),
        "versions": json.dumps(
            {
                "image-reward": md.version("image-reward"),
                "torch": torch.__version__,
                "torchvision": torchvision.__version__,
                "timm": timm.__version__,
                "transformers": transformers.__version__,
            }
        ),
    }
    save_file(out, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")
    print("scores:", scores)
    print("input_ids[0]:", tok.input_ids[0].tolist())
    print("versions:", meta["versions"])


if __name__ == "__main__":
    main()
