"""Regenerate hpsv2_golden.safetensors: a TINY random-weight open_clip CLIP (open_clip's own `CLIP` class, the
one HPS v2.1 fine-tunes as ViT-H-14), scored as the official hpsv2 code does (diag of the normalised
image @ text features), so tests/test_rewards_real.py can check that
solrl_engine.rewards.hpsv2.map_open_clip_keys / build_model reproduce open_clip inside transformers'
CLIPModel, in CI, where open_clip cannot be installed.

open_clip imports torchvision, and PyPI's torchvision does not import beside the CPU torch wheel of the
project's environment (its _C.so links libc10_cuda.so), so run this in a throwaway environment:

    python3.11 -m venv /tmp/ocvenv && . /tmp/ocvenv/bin/activate
    pip install torch==2.14.1 torchvision==0.29.1 open_clip_torch safetensors transformers
    python tests/data/make_hpsv2_golden.py

What is stored: `state_dict.<key>` every tensor of the model's state_dict under open_clip's names;
`pixels` [4, 3, 32, 32] already-normalised inputs; `tokens` [4, 77] token ids of a vocabulary of 1000
(start = 998, end = 999 the largest id as in CLIP, zero padding, as open_clip's tokenizer lays them out;
random ids keep the file small, and the map does not depend on which ids they are); `scores` [4]
open_clip's scores; `open_clip_tokens` [P, 77] what open_clip's real tokenizer (`get_tokenizer("ViT-H-14")`)
makes of the prompts in the metadata (`prompts`), for anyone holding the CLIP-H tokenizer to compare with.
With transformers installed, this script also checks that a transformers CLIPTokenizerFast built from
open_clip's own BPE file gives the same ids for those prompts, and prints where it does not.

`python tests/data/make_hpsv2_golden.py --vit-h` (about 12 GB of memory and two minutes on 2 cores) writes
nothing: it runs the whole `hpsv2` reward at full size (built-in ViT-H-14 geometry, float16 checkpoint file,
transformers tokenizer, tensor preprocessing of 384x480 images) against open_clip's ViT-H-14 with the same
random weights, scored as the official hpsv2 code scores.
"""

from __future__ import annotations

import gzip
import html
import json
import tempfile
from pathlib import Path

import open_clip
import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
from safetensors.torch import save_file

OUT = Path(__file__).with_name("hpsv2_golden.safetensors")
GEOMETRY = dict(embed_dim=16, image_size=32, patch_size=8, vision_width=32, vision_layers=2, vision_head_width=16,
                text_width=32, text_heads=2, text_layers=2, vocab_size=1000, context_length=77)  # fmt: skip
PROMPTS = [
    "a photo of an astronaut riding a horse on the moon",
    "A Red Fox, sitting in the SNOW -- digital art, 4k, trending on ArtStation!",
    "café au lait   with  latte-art,\tclose-up",
    "a neon sign that says 'OPEN 24/7' & a rainy street",
    "a bowl of fruit: apples, pears and grapes; oil painting (still life) " * 6,  # > 77 tokens: truncated
]


def bpe_tokenizer():  # noqa: ANN201 - transformers CLIPTokenizerFast
    """transformers' CLIP tokenizer on open_clip's own BPE file (the vocabulary of every OpenAI/LAION CLIP)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe
    from transformers import CLIPTokenizerFast

    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    # transformers 5 takes the vocab and merges themselves (4.x: vocab_file= / merges_file= paths)
    return CLIPTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in merges],
                             model_max_length=77)  # fmt: skip


def tokenizer_check(prompts: list[str], ids: torch.Tensor) -> None:
    """transformers' CLIPTokenizerFast on open_clip's own BPE vs open_clip's tokenizer."""
    try:
        tok = bpe_tokenizer()
    except ImportError:
        print("transformers is not installed: tokenizer check skipped")
        return
    enc = tok(prompts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")["input_ids"]
    eot = tok.eos_token_id
    for i, p in enumerate(prompts):
        a, b = ids[i].tolist(), enc[i].tolist()
        n = a.index(eot) + 1  # open_clip pads with 0, transformers with the end token: compare up to it
        same = a[:n] == b[:n]
        print(f"tokenizer {'same' if same else 'DIFFERENT'}: {p[:60]!r}")
        if not same:
            print("   open_clip   ", a[:n], "\n   transformers", b[:n])
    # what open_clip cleans before BPE that the fast tokenizer's normaliser does not: HTML entities (and ftfy)
    amp = "salt &amp; pepper"
    oc = open_clip.get_tokenizer("ViT-H-14")([amp])[0].tolist()
    hf = tok([amp])["input_ids"][0]
    hf2 = tok([html.unescape(amp)])["input_ids"][0]
    print(f"'&amp;': open_clip {oc[: len(hf2)]}, transformers {hf}, transformers after html.unescape {hf2}")


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
    oc_tokens = open_clip.get_tokenizer("ViT-H-14")(PROMPTS)
    tokenizer_check(PROMPTS, oc_tokens)
    state = {f"state_dict.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors = {**state, "pixels": pixels, "tokens": tokens, "scores": scores, "open_clip_tokens": oc_tokens}
    meta = {"geometry": json.dumps(g), "open_clip": open_clip.__version__, "torch": torch.__version__,
            "prompts": json.dumps(PROMPTS)}  # fmt: skip
    save_file(tensors, OUT, metadata=meta)
    print(f"wrote {OUT}: scores {scores.tolist()}")


def check_vit_h() -> None:
    """The whole `hpsv2` reward at full size against open_clip scoring the HPS way (hpsv2/img_score.py: its
    val transform on float tensors, open_clip's tokenizer, diag of normalised features), with open_clip's
    ViT-H-14 on random weights saved as HPS ships its checkpoint ({"state_dict": ...}, float16)."""
    import sys

    import torchvision.transforms as T

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from solrl_engine.rewards.hpsv2 import HPSv2

    torch.manual_seed(0)
    oc = open_clip.create_model("ViT-H-14").eval()  # the architecture only: no pretrained weights
    sd = {k: v.detach().half() for k, v in oc.state_dict().items()}
    oc.load_state_dict({k: v.float() for k, v in sd.items()})
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    gen = torch.Generator().manual_seed(3)
    low = torch.nn.functional.interpolate(torch.rand(4, 3, 16, 20, generator=gen), size=(384, 480), mode="bilinear")
    images = (low + 0.05 * torch.rand(low.shape, generator=gen)).clamp(0, 1)  # 4:5, larger than 224
    prompts = ["a photo of an astronaut riding a horse", "A Red Fox in the SNOW, digital art", "salt &amp; pepper",
               "a cat"]  # fmt: skip
    val = T.Compose([T.Resize(224, interpolation=T.InterpolationMode.BICUBIC, antialias=True), T.CenterCrop(224),
                     T.Normalize(mean, std)])  # fmt: skip
    with torch.no_grad():
        img = oc.encode_image(torch.stack([val(im) for im in images]), normalize=True)
        txt = oc.encode_text(open_clip.get_tokenizer("ViT-H-14")(prompts), normalize=True)
        want = torch.diagonal(img @ txt.T)
    del oc
    with tempfile.TemporaryDirectory() as d:
        torch.save({"state_dict": sd, "epoch": 1}, f"{d}/hps.pt")
        bpe_tokenizer().save_pretrained(f"{d}/clip-h")  # a CLIP-H processor directory, laion's image settings
        image_cfg = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}, "do_resize": True,
                     "do_center_crop": True, "do_normalize": True, "resample": 3, "image_mean": mean,
                     "image_std": std}  # fmt: skip
        (Path(d) / "clip-h" / "preprocessor_config.json").write_text(json.dumps(image_cfg))
        got = HPSv2(checkpoint=f"{d}/hps.pt", processor=f"{d}/clip-h", device="cpu")(images, prompts)
    print(f"ViT-H-14, open_clip the HPS way: {want.tolist()}")
    print(f"ViT-H-14, our hpsv2 reward:      {got.tolist()}")
    print(f"max |diff| {(got - want).abs().max():.2e}")


if __name__ == "__main__":
    import sys

    check_vit_h() if "--vit-h" in sys.argv else main()
