"""`imagereward`: the ImageReward v1.0 human-preference reward (Xu et al., 2023), without its package.

The `image-reward` package pins timm==0.6.13 and fairscale==0.4.13, which clash with open_clip's
timm>=1.0, so it cannot live in our environment. Its model is small enough to rebuild: a BLIP
ViT-L/16 at 224 px (a timm-style ViT), BLIP's "med" BERT-base whose layers cross-attend to the image
tokens, and an MLP on the [CLS] state. transformers ships both BLIP halves (`BlipVisionModel`,
`BlipTextModel`), so we load the package's checkpoint (`ImageReward.pt` in the hub repo
THUDM/ImageReward) into those through a key map (`map_checkpoint_keys`) and reproduce its scoring:

- text: bert-base-uncased WordPiece plus the two tokens BLIP adds ([DEC] as bos, [ENC]),
  padding="max_length", truncation, max_length=35. ImageReward keeps [CLS] as the first token: unlike
  BLIP's ITM head it does not swap in [ENC] (ImageReward.score / inference_rank / score_gard).
- image: Resize(224, bicubic) of the shorter side, CenterCrop(224), CLIP mean/std. The package does
  this on PIL images; we do it on tensors (bicubic with antialias, PIL's kernel, clamped to [0, 1]).
  224x224 inputs are left as they are by both; other sizes differ by PIL's uint8 rounding.
- text encoder run bidirectionally (is_decoder=False) with the image tokens as cross-attention states,
  the [CLS] hidden state through the head 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (Linear layers with
  dropout and no activations, as in the package), in float32, then (r - 0.16717362830052426) /
  1.0333394966054072, the package's constants.

Parity with the package was checked in a separate environment (image-reward 1.5, timm 0.6.13,
transformers 4.36.2) on tiny random weights: tests/data/make_imagereward_golden.py stores the package's
state_dict, token ids and scores; tests/test_imagereward.py loads it through our key map and matches
the scores (max abs diff 5.4e-7 in float32; token ids identical; a 96x136 image through our tensor
resize vs the package's PIL one: pixels within 1.5/255, score within 1.1e-3). The real v1.0 checkpoint
could not be downloaded here: its key names are the ones the package's classes define (the golden uses
those classes), but it was never loaded in this repository.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HUB_REPO = "THUDM/ImageReward"
CHECKPOINT = "ImageReward.pt"
TOKENIZER = "bert-base-uncased"
MAX_LENGTH = 35
REWARD_MEAN = 0.16717362830052426  # ImageReward.mean
REWARD_STD = 1.0333394966054072  # ImageReward.std
PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the package's Normalize (CLIP's)
PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageRewardConfig:
    """Sizes of the model; the defaults are ImageReward v1.0's (BLIP ViT-L/16 at 224, med BERT-base).
    Tests build tiny ones."""

    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vision_mlp_ratio: float = 4.0
    vision_eps: float = 1e-6  # timm ViT's LayerNorm eps in BLIP
    vocab_size: int = 30524  # bert-base-uncased + [DEC] + [ENC]
    text_width: int = 768
    text_layers: int = 12
    text_heads: int = 12
    text_intermediate: int = 3072
    max_positions: int = 512
    text_eps: float = 1e-12
    head_dims: tuple[int, int, int, int] = (1024, 128, 64, 16)
    max_length: int = MAX_LENGTH
    mean: float = REWARD_MEAN
    std: float = REWARD_STD


class _Head(nn.Module):
    """ImageReward's MLP, laid out as the package's nn.Sequential so its keys (`mlp.layers.{0,2,4,6,7}`)
    map one to one. No activations between the Linear layers: the package comments them out."""

    def __init__(self, width: int, dims: tuple[int, int, int, int]) -> None:
        super().__init__()
        d0, d1, d2, d3 = dims
        self.layers = nn.Sequential(
            nn.Linear(width, d0),
            nn.Dropout(0.2),
            nn.Linear(d0, d1),
            nn.Dropout(0.2),
            nn.Linear(d1, d2),
            nn.Dropout(0.1),
            nn.Linear(d2, d3),
            nn.Linear(d3, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ImageRewardModel(nn.Module):
    """BLIP vision tower + cross-attending text encoder + MLP head; `forward` gives normalised rewards."""

    def __init__(self, config: ImageRewardConfig | None = None) -> None:
        super().__init__()
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        c = config or ImageRewardConfig()
        self.config = c
        vision = BlipVisionConfig(
            hidden_size=c.vision_width,
            intermediate_size=int(c.vision_width * c.vision_mlp_ratio),
            num_hidden_layers=c.vision_layers,
            num_attention_heads=c.vision_heads,
            image_size=c.image_size,
            patch_size=c.patch_size,
            hidden_act="gelu",
            layer_norm_eps=c.vision_eps,
            attention_dropout=0.0,
        )
        text = BlipTextConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.text_width,
            encoder_hidden_size=c.vision_width,
            intermediate_size=c.text_intermediate,
            num_hidden_layers=c.text_layers,
            num_attention_heads=c.text_heads,
            max_position_embeddings=c.max_positions,
            hidden_act="gelu",
            layer_norm_eps=c.text_eps,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            is_decoder=True,  # builds the cross-attention layers; forward still runs bidirectionally
            use_cache=False,
            bos_token_id=None,  # generation-only ids; the defaults name BERT-base's vocab, not a tiny one
            eos_token_id=None,
            sep_token_id=None,
        )
        self.vision = BlipVisionModel(vision)
        self.text = BlipTextModel(text, add_pooling_layer=False)
        self.head = _Head(c.text_width, c.head_dims)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Rewards [B] from normalised 224 px pixels [B, 3, 224, 224] and token ids [B, L]."""
        dtype = self.vision.embeddings.patch_embedding.weight.dtype
        image_embeds = self.vision(pixel_values=pixels.to(dtype)).last_hidden_state
        hidden = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            is_decoder=False,
        ).last_hidden_state
        r = self.head(hidden[:, 0].float()).squeeze(-1)
        return (r - self.config.mean) / self.config.std


# ImageReward checkpoint key -> ImageRewardModel key. The vision tower is a timm-style ViT; the text
# encoder is BLIP's med BERT, whose names transformers' BlipTextModel kept; the head keeps its layout.
_VIT = r"^blip\.visual_encoder\."
_BLOCK = _VIT + r"blocks\.(\d+)\."
_LAYER = r"vision.encoder.layers.\1."
_WB = r"\.(weight|bias)$"
_KEY_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(pattern), target)
    for pattern, target in [
        (_VIT + r"cls_token$", "vision.embeddings.class_embedding"),
        (_VIT + r"pos_embed$", "vision.embeddings.position_embedding"),
        (_VIT + r"patch_embed\.proj" + _WB, r"vision.embeddings.patch_embedding.\1"),
        (_BLOCK + r"norm1" + _WB, _LAYER + r"layer_norm1.\2"),
        (_BLOCK + r"attn\.qkv" + _WB, _LAYER + r"self_attn.qkv.\2"),  # both fuse q, k, v in this order
        (_BLOCK + r"attn\.proj" + _WB, _LAYER + r"self_attn.projection.\2"),
        (_BLOCK + r"norm2" + _WB, _LAYER + r"layer_norm2.\2"),
        (_BLOCK + r"mlp\.(fc[12])" + _WB, _LAYER + r"mlp.\2.\3"),
        (_VIT + r"norm" + _WB, r"vision.post_layernorm.\1"),
        (r"^blip\.text_encoder\.embeddings\.position_ids$", ""),  # a buffer, rebuilt
        (r"^blip\.text_encoder\.((?:embeddings|encoder)\..+)$", r"text.\1"),
        (r"^mlp\.layers\.(\d+)" + _WB, r"head.layers.\1.\2"),
    ]
]


def map_checkpoint_keys(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename an ImageReward state_dict to ImageRewardModel's keys; returns (mapped, ignored keys).

    Ignored: what scoring never uses (BLIP's vision_proj / text_proj, position_ids), and anything else
    the package itself would drop when it loads with strict=False."""
    mapped: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, value in state_dict.items():
        for pattern, target in _KEY_RULES:
            if pattern.match(key):
                new = pattern.sub(target, key)
                if new:
                    mapped[new] = value
                else:
                    ignored.append(key)
                break
        else:
            ignored.append(key)
    return mapped, ignored


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def _is_local(name: str) -> bool:
    p = Path(name).expanduser()
    return p.is_absolute() or name.startswith((".", "~")) or p.exists() or name.count("/") > 1


def _resolve(name: str, filename: str, what: str, how: str) -> str | None:
    """Local path of `filename` in the local directory `name` (or `name` itself, when it is that file) or
    in the hub repo `name`'s cache; None for a hub file still to download. FileNotFoundError naming the
    exact file and `how` to get it when it is missing (for a hub file: offline and not cached)."""
    if _is_local(name):
        p = Path(name).expanduser()
        f = p if p.is_file() else p / filename
        if not f.is_file():
            raise FileNotFoundError(f"{what}: {str(f)!r} does not exist. {how}")
        return str(f)
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, filename)
        if not isinstance(cached, str):
            raise FileNotFoundError(
                f"{what}: {filename!r} of the hub repo {name!r} is not in the local Hugging Face cache and "
                f"HF_HUB_OFFLINE is set. {how}"
            )
        return cached
    return None


_GET_CHECKPOINT = (
    f"Get the ImageReward v1.0 checkpoint with `hf download {HUB_REPO} {CHECKPOINT}` "
    f"(add `--local-dir DIR` and pass model=DIR), or pass checkpoint=/path/to/{CHECKPOINT}."
)
_GET_TOKENIZER = (
    f"Get the BERT tokenizer with `hf download {TOKENIZER} vocab.txt tokenizer_config.json` "
    "(add `--local-dir DIR` and pass tokenizer=DIR)."
)


def check_weights(
    model: str = HUB_REPO, checkpoint: str | None = None, tokenizer: str = TOKENIZER
) -> dict[str, str | None]:
    """Fail before any loading when a file ImageRewardScorer needs is missing, naming it and the fix.

    `model` is the hub repo (THUDM/ImageReward) or a local directory; `checkpoint` the file in it
    (ImageReward.pt) or a path to the file itself; `tokenizer` bert-base-uncased or a local directory with
    its vocab.txt. Returns {"checkpoint", "vocab"}: each file's local path, or None for one that will be
    downloaded (online, not cached yet)."""
    ckpt = checkpoint or CHECKPOINT
    cp = Path(ckpt).expanduser()
    if cp.is_file():
        ckpt_path: str | None = str(cp)
    elif not _is_local(model) and (cp.is_absolute() or os.sep in ckpt or ckpt.startswith((".", "~"))):
        raise FileNotFoundError(f"ImageReward checkpoint: {str(cp)!r} does not exist. {_GET_CHECKPOINT}")
    else:
        ckpt_path = _resolve(model, ckpt, "ImageReward checkpoint", _GET_CHECKPOINT)
    vocab = _resolve(tokenizer, "vocab.txt", "ImageReward tokenizer", _GET_TOKENIZER)
    return {"checkpoint": ckpt_path, "vocab": vocab}


def load_tokenizer(tokenizer: str = TOKENIZER) -> PreTrainedTokenizerBase:
    """bert-base-uncased with the special tokens BLIP's init_tokenizer adds, so ids match the checkpoint."""
    from transformers import BertTokenizer

    name = str(Path(tokenizer).expanduser()) if _is_local(tokenizer) else tokenizer
    if _is_local(tokenizer) and Path(name).is_file():  # a vocab.txt itself
        name = str(Path(name).parent)
    tok = BertTokenizer.from_pretrained(name, do_lower_case=True)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def preprocess(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] -> the package's Resize(size, bicubic) + CenterCrop(size) + Normalize, on
    tensors (differentiable). The shorter side goes to `size` (the longer to int(size * long / short), as
    torchvision computes it), then the centre crop uses torchvision's rounding."""
    check_images(images)
    x = images.float()
    h, w = x.shape[-2:]
    if min(h, w) != size:
        if h <= w:
            nh, nw = size, int(size * w / h)
        else:
            nh, nw = int(size * h / w), size
        x = nn.functional.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp(0, 1)  # PIL clips its uint8 output
        h, w = nh, nw
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    x = x[..., top : top + size, left : left + size]
    mean = torch.tensor(PIXEL_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(PIXEL_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def check_images(images: torch.Tensor) -> None:
    """ValueError unless `images` is a float [B, 3, H, W] tensor."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, 3, H, W] float tensor in [0, 1]; got {shape}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floats in [0, 1] (got dtype {images.dtype}); divide uint8 images by 255")


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The package's state_dict from ImageReward.pt (torch.save of tensors) or a .safetensors file."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    sd = torch.load(path, map_location="cpu", weights_only=True)
    return sd.get("state_dict", sd) if isinstance(sd, dict) else sd


class ImageRewardScorer:
    """ImageReward as a reward: `scorer(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]`.

    `model`: the hub repo THUDM/ImageReward or a local directory holding `checkpoint` (ImageReward.pt;
    or a path to the file); `tokenizer`: bert-base-uncased or a local directory with its vocab.txt. Every
    file is checked (check_weights) before anything loads. `dtype` is the towers' (e.g. torch.bfloat16
    on a GPU); the head always runs in float32, as the package's does."""

    def __init__(
        self,
        model: str = HUB_REPO,
        checkpoint: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        tokenizer: str = TOKENIZER,
        config: ImageRewardConfig | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if state_dict is None:
            path = check_weights(model, checkpoint, tokenizer)["checkpoint"]
            if path is None:
                from huggingface_hub import hf_hub_download

                path = hf_hub_download(model, checkpoint or CHECKPOINT)
            state_dict = load_checkpoint(path)
        else:
            _resolve(tokenizer, "vocab.txt", "ImageReward tokenizer", _GET_TOKENIZER)
        self.tokenizer = load_tokenizer(tokenizer)
        self.config = config or ImageRewardConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.ignored_keys = build_model(state_dict, self.config)
        self.model.to(self.device)
        self.model.vision.to(dtype or torch.float32)
        self.model.text.to(dtype or torch.float32)
        self.model.eval().requires_grad_(False)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [B, max_length] as the package makes them."""
        enc = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=self.config.max_length, return_tensors="pt"
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Rewards [B] (float32), differentiable in `images` (for reward-gradient methods such as ReFL)."""
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        pixels = preprocess(images.to(self.device), self.config.image_size)
        ids, mask = self.tokenize(prompts)
        return self.model(pixels, ids, mask)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Rewards [B] (float32, on the scorer's device), without gradients."""
        with torch.no_grad():
            return self.score(images, prompts)

    def __repr__(self) -> str:
        return f"ImageRewardScorer(device={self.device}, config={asdict(self.config)})"


def build_model(
    state_dict: dict[str, torch.Tensor], config: ImageRewardConfig | None = None
) -> tuple[ImageRewardModel, list[str]]:
    """ImageRewardModel holding an ImageReward state_dict (package key names); returns it and the ignored
    keys. Built on the meta device, so the ~470M parameters are not initialised only to be overwritten."""
    mapped, ignored = map_checkpoint_keys(state_dict)
    with torch.device("meta"):
        model = ImageRewardModel(config)
    model.to_empty(device="cpu")
    try:
        missing, unexpected = model.load_state_dict(mapped, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"ImageReward checkpoint does not fit {config or ImageRewardConfig()}: {e}") from e
    if missing or unexpected:
        raise ValueError(
            "not an ImageReward checkpoint of this configuration: "
            f"missing {sorted(missing)[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {sorted(unexpected)[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    # to_empty left the non-persistent buffers uninitialised: rebuild them
    for name, _ in model.named_buffers():
        if not name.endswith("embeddings.position_ids"):
            raise RuntimeError(f"unexpected buffer {name} (transformers changed BLIP?)")
    emb = model.text.embeddings
    emb.position_ids = torch.arange(emb.position_embeddings.num_embeddings).expand(1, -1)
    return model, ignored


__all__ = [
    "ImageRewardConfig",
    "ImageRewardModel",
    "ImageRewardScorer",
    "build_model",
    "check_weights",
    "load_tokenizer",
    "map_checkpoint_keys",
    "preprocess",
]
