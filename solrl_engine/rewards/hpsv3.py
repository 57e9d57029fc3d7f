"""`hpsv3`: HPSv3 (Ma et al., 2025), a Qwen2-VL-7B-Instruct trained on human preference pairs (HPDv3), with a
reward head read at a special `<|Reward|>` token.

Why not the `hpsv3` package: it pulls deepspeed, trl and torchvision, and was written against transformers 4
(the engine needs 5). The model is transformers' own Qwen2-VL, so it is scored here as the package's
`HPSv3RewardInferencer.reward` does, on transformers' classes:

1. each image as the package reads it from a file: 8-bit RGB (the float image rounded, as a PNG stores it),
   resized with PIL's bicubic filter to qwen_vl_utils' `smart_resize` size for min = max = 256 * 28 * 28
   pixels (448 x 448 for a square image), then Qwen2-VL's image processor (rescale, CLIP normalisation,
   14-pixel patches, 2 x 2 merge);
2. the text, Qwen2-VL-Instruct's chat template for one user turn (the image, then `INSTRUCTION` with the prompt,
   then `SUFFIX`, which holds the reward token) with the generation prompt, right-padded;
3. the language model runs on the embedded tokens with the image features in place of the image tokens and no
   input ids, so every token gets sequential positions (the package's forward; not Qwen2-VL's 3-D image
   positions);
4. the head (hidden -> 1024 -> 16 -> 2, ReLU between, float32) at the `<|Reward|>` token gives (mu, sigma) of
   the preference score; the reward is mu, as the package's README reads it.

Arguments (reward_args `hpsv3.KEY=VALUE`):
  checkpoint  the HPSv3 weights (the whole model: vision tower, language model and head), a path to
              HPSv3.safetensors (or a torch file of the same state dict), or a bare file name of the hub repo
              MizzenAI/HPSv3; default HPSv3.safetensors from the local hub cache, or downloaded when online.
              The keys of transformers 4.45 (model.layers.*, visual.*) and of later releases
              (model.language_model.*, model.visual.*) are both read.
  processor   Qwen2-VL-7B-Instruct's small files (config.json, the tokenizer, preprocessor_config.json): default
              the hub id Qwen/Qwen2-VL-7B-Instruct; only its *.json and *.txt files are needed.
  dtype       default bfloat16, the package's (the head stays float32); float32 for exact comparisons.
  batch_size  images per forward, default 8.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from solrl_engine.rewards._clip import (
    check_images,
    check_source,
    device_of,
    download_hint,
    is_local,
    resolve_dtype,
    resolve_hub_file,
)

HUB_REPO = "MizzenAI/HPSv3"
CHECKPOINT = "HPSv3.safetensors"
DEFAULT_PROCESSOR = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
IMAGE_TOKEN = "<|image_pad|>"
PIXELS = 256 * 28 * 28  # the package's min_pixels = max_pixels
_GET = f"Get it with {download_hint(HUB_REPO, CHECKPOINT)} and pass hpsv3.checkpoint=FILE"

# The package's instruction (hpsv3/dataset/data_collator_qwen.py INSTRUCTION and prompt_with_special_token),
# character for character: the model was trained on exactly this text.
INSTRUCTION = "\n".join((
    "",
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and"
    " give a overall score to estimate the human preference. Please provide a rating from 0 to 10, "
    "with 0 being the worst and 10 being the best. ",
    "",
    "**Visual Quality:**  ",
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be "
    "considered:",
    "- **Reasonableness:** The image should not contain any significant biological or logical "
    "errors, such as abnormal body structures or nonsensical environmental setups.",
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear "
    "and easy to interpret, with no blurring or indistinct areas.",
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other"
    " visual elements (e.g., hair, clothing, shadows).",
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene "
    "should convey a sense of harmony and balance.",
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political,"
    " violent, or adult material. If such content is present, the image quality and satisfaction "
    "score should be the lowest possible. ",
    "",
    "**Text Alignment:**  ",
    "Assess how well the image matches the textual prompt across the following sub-dimensions:",
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, "
    "animal, object) align with the textual description. The subject should match the description in"
    " terms of number, appearance, and behavior.",
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, "
    "evaluate how well the image adheres to this style.",
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements "
    "in the image logically fit the scenario described in the prompt. The environment should support"
    " and enhance the subject without contradictions.",
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.",
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict with "
    "or distort the original description.",
    "Textual prompt - {text_prompt}",
    "",
    "",
    "",
))
SUFFIX = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"

# Qwen2-VL-Instruct's chat template rendered for [{"role": "user", "content": [image, text]}] with
# add_generation_prompt=True (its default system turn first)
CHAT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


def user_text(prompt: str) -> str:
    """The whole text of the user turn for `prompt` (instruction, prompt, then the reward token)."""
    return INSTRUCTION.format(text_prompt=prompt) + SUFFIX


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = PIXELS,
                 max_pixels: int = PIXELS) -> tuple[int, int]:  # fmt: skip
    """qwen_vl_utils' size: both sides multiples of `factor`, the area within [min_pixels, max_pixels], the aspect
    ratio kept as nearly as that allows (the package resizes every image to this before its processor)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"hpsv3: an image of {height} x {width} has an aspect ratio over 200, which Qwen2-VL refuses")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_pil(images: torch.Tensor) -> list[Any]:
    """[B, 3, H, W] in [0, 1] -> 8-bit RGB PIL images, as a PNG of each stores them."""
    from PIL import Image

    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in arr]


def check_weights(checkpoint: str | None = None, processor: str = DEFAULT_PROCESSOR, **_: object) -> None:
    """Before loading: the checkpoint and Qwen2-VL's small files can be found."""
    what = "hpsv3 processor (Qwen2-VL-7B-Instruct's config, tokenizer and image processor)"
    for f in ("config.json", "tokenizer_config.json", "preprocessor_config.json"):
        check_source(processor, what, f, '--include "*.json" "*.txt"')
    resolve_hub_file(checkpoint or CHECKPOINT, HUB_REPO, "hpsv3 checkpoint", CHECKPOINT, _GET)


def head(hidden: int) -> nn.Sequential:
    """The package's "ranknet" head (its default sizes); the keys of its state dict are the checkpoint's rm_head.*."""
    return nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))  # fmt: skip


def split_keys(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An HPSv3 state dict -> (Qwen2VLModel's, the head's). Reads both transformers layouts (see the module
    docstring); lm_head is dropped (the reward reads hidden states). A key of neither is an error, so a checkpoint
    of another model fails here, not as wrong scores."""
    vlm: dict[str, torch.Tensor] = {}
    rm: dict[str, torch.Tensor] = {}
    other = []
    for key, t in state_dict.items():
        k = key.removeprefix("module.")
        if k.startswith("rm_head."):
            rm[k.removeprefix("rm_head.")] = t
        elif k == "lm_head.weight":
            continue
        elif k.startswith(("model.language_model.", "model.visual.")):
            vlm[k.removeprefix("model.")] = t
        elif k.startswith("visual."):
            vlm[k] = t
        elif k.startswith("model."):
            vlm["language_model." + k.removeprefix("model.")] = t
        else:
            other.append(key)
    if other or not rm or not vlm:
        raise ValueError(f"not an HPSv3 state dict: {'keys ' + str(other[:4]) if other else 'no rm_head.* or model.*'}"
                         f" (expected rm_head.*, model.* or model.language_model.*, visual.* or model.visual.*)")
    return vlm, rm


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: a .safetensors file, or a torch file read with weights_only=True ({"model": ...}
    or a bare state dict, as the package accepts)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError or RuntimeError, by version
        raise ValueError(f"{path} cannot be read as tensors only ({type(e).__name__}: {str(e)[:200]}); pass the "
                         f"published {CHECKPOINT}") from e  # fmt: skip
    sd = ck.get("model", ck) if isinstance(ck, dict) else ck
    if not isinstance(sd, dict):
        raise ValueError(f"{path} holds a {type(sd).__name__}, not a state dict")
    return sd


def build_model(state_dict: dict[str, torch.Tensor], processor: str) -> tuple[Any, nn.Sequential]:
    """Qwen2VLModel (its config from `processor`, its vocabulary the checkpoint's: Qwen2-VL's plus <|Reward|>) and
    the head, holding the checkpoint, in float32 on the CPU. Built on the meta device, so 7B parameters are not
    initialised only to be overwritten; the rotary tables (not in any checkpoint) are then computed."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    vlm_sd, head_sd = split_keys(state_dict)
    config = AutoConfig.from_pretrained(_local(processor))
    emb = vlm_sd.get("language_model.embed_tokens.weight")
    if emb is None:
        raise ValueError("not an HPSv3 state dict: no embed_tokens.weight")
    config.text_config.vocab_size = emb.shape[0]
    with torch.device("meta"):
        vlm = Qwen2VLModel(config)
    vlm.to_empty(device="cpu")
    try:
        vlm.load_state_dict({k: v.float() for k, v in vlm_sd.items()}, strict=True)
    except RuntimeError as e:  # missing / unexpected keys, shape mismatches
        raise ValueError(f"the checkpoint does not fit {processor}'s Qwen2-VL config: {str(e)[:600]}") from e
    for module in vlm.modules():
        if "RotaryEmbedding" in type(module).__name__:
            vlm._init_weights(module)  # transformers computes a rotary module's inv_freq here
    persistent = set(vlm.state_dict())
    for name, _ in vlm.named_buffers():
        if name not in persistent and "rotary" not in name:
            raise RuntimeError(f"unexpected buffer {name} (transformers changed Qwen2-VL?)")
    rm = head(config.text_config.hidden_size)
    try:
        rm.load_state_dict({k: v.float() for k, v in head_sd.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"the checkpoint's rm_head is not HPSv3's (hidden -> 1024 -> 16 -> 2): {str(e)[:400]}") from e
    return vlm.eval(), rm.eval()


def _local(name: str) -> str:
    return str(Path(name).expanduser()) if is_local(name) else name


class HPSv3:
    """`reward(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]`: HPSv3's mu (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        processor: str = DEFAULT_PROCESSOR,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = "bfloat16",
        batch_size: int = 8,
    ) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        check_weights(checkpoint, processor)
        path = resolve_hub_file(checkpoint or CHECKPOINT, HUB_REPO, "hpsv3 checkpoint", CHECKPOINT, _GET)
        if path is None:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(HUB_REPO, checkpoint or CHECKPOINT)
        self.checkpoint = path
        self.device, self.dtype = device_of(device), resolve_dtype(dtype)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokenizer = AutoTokenizer.from_pretrained(_local(processor), padding_side="right")
        self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.image_processor = AutoImageProcessor.from_pretrained(_local(processor))
        vlm, rm = build_model(load_state_dict(path), processor)
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if self.reward_id >= vlm.config.text_config.vocab_size:
            raise ValueError(f"{REWARD_TOKEN} is token {self.reward_id} of {processor}'s tokenizer, past the "
                             f"checkpoint's {vlm.config.text_config.vocab_size} embeddings: another "
                             "tokenizer?")  # fmt: skip
        self.merge = int(vlm.config.vision_config.spatial_merge_size)
        self.vlm = vlm.to(self.device, self.dtype).requires_grad_(False)
        self.head = rm.to(self.device).requires_grad_(False)  # float32, as the package keeps it

    def inputs(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Token ids, attention mask, pixel patches and image grids for one batch, as the package's processor call
        makes them (each image's <|image_pad|> repeated once per merged patch)."""
        pil = [im.resize(smart_resize(im.height, im.width)[::-1], resample=3) for im in to_pil(images)]  # 3: bicubic
        px = self.image_processor(images=pil, return_tensors="pt")
        texts = []
        for prompt, grid in zip(prompts, px["image_grid_thw"], strict=True):
            n = int(grid.prod()) // self.merge**2
            texts.append(CHAT.format(text=user_text(prompt)).replace(IMAGE_TOKEN, IMAGE_TOKEN * n, 1))
        tok = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"],
                "pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}  # fmt: skip

    def _score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        b = {k: v.to(self.device) for k, v in self.inputs(images, prompts).items()}
        ids = b["input_ids"]
        emb = self.vlm.get_input_embeddings()(ids)
        feats = self.vlm.get_image_features(b["pixel_values"].to(self.dtype), b["image_grid_thw"])
        feats = torch.cat(list(feats.pooler_output if hasattr(feats, "pooler_output") else feats)).to(emb.dtype)
        mask = ids == self.image_id
        if int(mask.sum()) != feats.shape[0]:
            raise RuntimeError(f"hpsv3: {int(mask.sum())} image tokens for {feats.shape[0]} image features")
        emb = emb.masked_scatter(mask.unsqueeze(-1), feats)
        pos = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, ids.shape[0], -1)
        hidden = self.vlm.language_model(inputs_embeds=emb, attention_mask=b["attention_mask"],
                                         position_ids=pos).last_hidden_state  # fmt: skip
        at = ids == self.reward_id
        if not bool((at.sum(1) == 1).all()):
            raise RuntimeError(f"hpsv3: each text must hold {REWARD_TOKEN} once; counts {at.sum(1).tolist()}")
        return self.head(hidden[at].float())[:, 0]

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Rewards [B] float32 on the scorer's device (no gradients: the package's 8-bit PIL path is not
        differentiable). An image with a NaN or inf pixel scores NaN, as in the other rewards: rounding it to 8 bits
        would make up a finite score; the run's nonfinite_policy decides."""
        check_images(images, prompts)
        out = torch.full((len(prompts),), float("nan"), device=self.device)
        ok = torch.isfinite(images).flatten(1).all(dim=1).nonzero().flatten().tolist()
        with torch.no_grad():
            for i in range(0, len(ok), self.batch_size):
                rows = ok[i : i + self.batch_size]
                out[rows] = self._score(images[rows], [prompts[j] for j in rows])
        return out

    def __repr__(self) -> str:
        return f"HPSv3(device={self.device}, dtype={self.dtype})"
