"""What CLIPScore, PickScore and HPSv2 share: a transformers CLIPModel and its tokenizer, image
preprocessing on tensors (no PIL round trip, so batches stay on the device and gradients can flow),
weight checks that run before anything loads, and batched scoring.

Each scorer is `score = multiplier * cos(image_embeds, text_embeds)`; the subclasses set the multiplier.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# CLIP's own normalisation, the default when a processor config does not name one
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def offline() -> bool:
    """Whether the Hugging Face hub is off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), read now, not at
    import, so a launcher or a test that sets it late is obeyed."""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))  # fmt: skip


def is_local(name: str) -> bool:
    """A path rather than a hub id ("org/name"): absolute, relative with ./ ~ or no single slash, or existing."""
    p = Path(name)
    return p.is_absolute() or name.startswith((".", "~")) or p.exists() or name.count("/") != 1 or "\\" in name


def download_hint(repo: str, files: str = "", local_dir: str = "") -> str:
    """The command that fetches `repo` (the `hf` CLI of huggingface_hub >= 0.34)."""
    extra = "".join(f" {a}" for a in (files, f"--local-dir {local_dir}" if local_dir else "") if a)
    return f"`hf download {repo}{extra}`"


def check_source(name: str, what: str, filename: str = "config.json", files: str = "") -> None:
    """Fail now, naming what is expected, when `name` cannot give `filename`: a local directory must
    hold it; a hub id must be in the local cache when the hub is offline (online, it will download)."""
    if is_local(name):
        if not (Path(name).expanduser() / filename).is_file():
            raise FileNotFoundError(
                f"{what}: {name!r} is not a directory holding {filename}. Pass a hub id or a local copy, made "
                f"with e.g. {download_hint('<hub id>', files, name)}"
            )
        return
    if offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, filename), str):
            raise FileNotFoundError(
                f"{what}: hub id {name!r} ({filename}) is not in the local Hugging Face cache and the hub is offline "
                f"(HF_HUB_OFFLINE). Run {download_hint(name, files)} where there is internet, or pass a local directory"
            )


def resolve_hub_file(name: str, repo: str, what: str, expected: str, get: str) -> str | None:
    """A weight file given as a path, or as a bare file name of the hub repo `repo`: its local path; None when it is a
    hub file that is not cached yet (online, the reward downloads it as it loads). Raises FileNotFoundError naming the
    file and `get` (how to get it) for a missing path, or for a hub file that is not cached while offline."""
    p = Path(name).expanduser()
    if p.is_file():
        return str(p)
    if "/" in name or "\\" in name or name.startswith(("~", ".")):  # a path; a bare name is a hub file
        raise FileNotFoundError(f"{what} {name!r} does not exist (expected {expected}). {get}")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo, name)
    if isinstance(cached, str):
        return cached
    if offline():
        raise FileNotFoundError(
            f"{what} {name} of the hub repo {repo} is not in the local Hugging Face cache and the hub is offline "
            f"(HF_HUB_OFFLINE). {get}"
        )
    return None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip


def check_model(name: str, what: str) -> None:
    """check_source for a from_pretrained model; a local directory must also hold its weights."""
    check_source(name, what)
    p = Path(name).expanduser()
    if is_local(name) and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise FileNotFoundError(f"{what}: {name!r} holds config.json but no weights (one of {', '.join(WEIGHT_FILES)})")


def check_processor(name: str, what: str) -> None:
    """A CLIP processor (tokenizer and image sizes): its two small configs. A copy needs only the small files:
    `--include "*.json" "*.txt"` skips the weights."""
    for f in ("preprocessor_config.json", "tokenizer_config.json"):
        check_source(name, what, f, '--include "*.json" "*.txt"')


def load_clip(model: str) -> Any:
    """A transformers CLIPModel in float32 (the scorer casts it after reading the exact logit scale)."""
    from transformers import CLIPModel

    return CLIPModel.from_pretrained(str(Path(model).expanduser()) if is_local(model) else model)


def config_file(name: str, filename: str) -> str:
    """Local path of `filename` from a directory or a hub id (cached, or downloaded when online)."""
    if is_local(name):
        return str(Path(name).expanduser() / filename)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(name, filename)


def _size(s: Any, default: int) -> int | tuple[int, int]:
    """A processor size (int, dict or transformers 5 SizeDict): the shortest edge, or (height, width)."""
    if s is None:
        return default
    if isinstance(s, int):
        return s
    get = s.get if isinstance(s, dict) else (lambda k: getattr(s, k, None))
    if get("shortest_edge"):
        return int(get("shortest_edge"))
    return int(get("height")), int(get("width"))


class ImageSpec:
    """The image half of a CLIPImageProcessor, read from its preprocessor_config.json."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.resize = _size(cfg.get("size"), 224) if cfg.get("do_resize", True) else None
        crop = _size(cfg.get("crop_size"), 224) if cfg.get("do_center_crop", True) else None
        self.crop = (crop, crop) if isinstance(crop, int) else crop
        self.mode = "bilinear" if cfg.get("resample", 3) == 2 else "bicubic"  # PIL codes: 2 bilinear, 3 bicubic
        normalize = cfg.get("do_normalize", True)
        self.mean = tuple(cfg.get("image_mean") or OPENAI_MEAN) if normalize else (0.0, 0.0, 0.0)
        self.std = tuple(cfg.get("image_std") or OPENAI_STD) if normalize else (1.0, 1.0, 1.0)

    @classmethod
    def load(cls, name: str) -> ImageSpec:
        with open(config_file(name, "preprocessor_config.json")) as f:
            return cls(json.load(f))


def preprocess(images: torch.Tensor, spec: ImageSpec, clamp: bool = True) -> torch.Tensor:
    """CLIPImageProcessor on tensors: resize (the shorter side to `resize`, the longer one floored, as
    transformers computes it; antialiased bicubic, as PIL), center crop, normalise. `clamp` keeps the
    resized pixels in [0, 1] as PIL's uint8 images are (HPS resizes float tensors and does not)."""
    x = images.float()
    h, w = x.shape[-2:]
    if spec.resize is not None:
        if isinstance(spec.resize, int):
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(spec.resize * long / short)
            nh, nw = (spec.resize, new_long) if h <= w else (new_long, spec.resize)
        else:
            nh, nw = spec.resize
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode=spec.mode, align_corners=False, antialias=True)
            x = x.clamp(0, 1) if clamp else x
            h, w = nh, nw
    if spec.crop is not None and spec.crop != (h, w):
        ch, cw = spec.crop
        if ch > h or cw > w:  # the processor pads; a CLIP input never needs it after the resize
            x = F.pad(x, ((cw - w) // 2, (cw - w + 1) // 2, (ch - h) // 2, (ch - h + 1) // 2))
            h, w = x.shape[-2:]
        top, left = (h - ch) // 2, (w - cw) // 2
        x = x[..., top : top + ch, left : left + cw]
    mean = torch.tensor(spec.mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def check_images(images: torch.Tensor, prompts: list[str]) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, 3, H, W] float tensor in [0, 1]; got {got}")
    if not images.is_floating_point():
        raise ValueError(f"images must be float in [0, 1]; got {images.dtype} (divide uint8 images by 255)")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        n = "a str" if isinstance(prompts, str) else len(prompts)
        raise ValueError(f"got {images.shape[0]} images but {n} prompts (one prompt per image)")


def features(out: Any) -> torch.Tensor:
    """get_image/text_features: a tensor up to transformers 4, an output whose pooler_output is the
    projected embedding from transformers 5."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """`dtype` as given (a torch.dtype or its name, e.g. "bfloat16" from reward_args), float32 by default:
    the published scores are float32 ones, and a reward's rounding reorders close samples."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        dt = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"dtype {dtype!r} is not a torch floating dtype (float32, bfloat16, float16)")
        dtype = dt
    return dtype


class CLIPScorer:
    """`scorer(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]` float32 on the scorer's device:
    multiplier() * cos(image, text) of a transformers CLIPModel, in the model's own dtype, in batches
    of `batch_size` images, each distinct prompt encoded once per call."""

    clamp_resized = True

    def __init__(self, model: Any, processor: str, device: torch.device, dtype: torch.dtype,
                 batch_size: int | str = 32) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        self.device, self.dtype = device, dtype
        # the scale from the float32 weights: a float16 logit_scale would shift every score by up to 0.2%
        self.logit_scale = float(model.logit_scale.detach().float().exp())
        self.model = model.to(device, dtype).eval().requires_grad_(False)
        self.image_spec = ImageSpec.load(processor)
        self.tokenizer = AutoTokenizer.from_pretrained(str(Path(processor).expanduser()) if is_local(processor)
                                                       else processor)  # fmt: skip
        positions = self.model.config.text_config.max_position_embeddings
        self.max_length = min(int(self.tokenizer.model_max_length), positions)  # 77 for every CLIP
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    def multiplier(self) -> float:
        """What the cosine is multiplied by (set by each reward)."""
        return 1.0

    def prepare_prompt(self, prompt: str) -> str:
        """Text cleaning before the tokenizer (none: transformers' CLIP tokenizer normalises itself)."""
        return prompt

    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """Unit-norm text embeddings [len(prompts), D] (float32), padded to max_length as CLIP was trained."""
        prompts = [self.prepare_prompt(p) for p in prompts]
        out = []
        for i in range(0, len(prompts), self.batch_size):
            tok = self.tokenizer(prompts[i : i + self.batch_size], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)  # fmt: skip
            t = features(self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]))
            out.append(F.normalize(t.float(), dim=-1))
        return torch.cat(out)

    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm image embeddings [B, D] (float32) of images in [0, 1]; differentiable in `images`."""
        px = preprocess(images.to(self.device), self.image_spec, clamp=self.clamp_resized).to(self.dtype)
        return F.normalize(features(self.model.get_image_features(pixel_values=px)).float(), dim=-1)

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Rewards [B] float32, differentiable in `images` (for reward-gradient methods)."""
        check_images(images, prompts)
        unique = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # a rollout group repeats its prompt
        txt = self.text_embeds(list(unique))[torch.tensor([unique[p] for p in prompts], device=self.device)]
        cos = torch.cat([(self.image_embeds(images[i : i + self.batch_size]) * txt[i : i + self.batch_size]).sum(-1)
                         for i in range(0, len(prompts), self.batch_size)])  # fmt: skip
        return cos * self.multiplier()

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Rewards [B] float32 on the scorer's device, without gradients."""
        with torch.no_grad():
            return self.score(images, prompts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, dtype={self.dtype}, x{self.multiplier():.4g})"


def device_of(device: str | torch.device | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
