"""`hpsv2`: Human Preference Score v2.1 (Wu et al., 2023), an open_clip ViT-H-14 fine-tuned on human
preference pairs (HPD v2).

score = diag(image_features @ text_features.T) of the L2-normalised features, i.e. the plain cosine, with
no logit scale: what the official `hpsv2.score` (hpsv2/img_score.py) returns, about 0.2-0.35.

Why not open_clip: open_clip imports torchvision at import time, and PyPI's torchvision wheels link
libtorch_cuda / libc10_cuda, so beside a CPU PyTorch wheel torchvision fails to import ("operator
torchvision::nms does not exist"); the official route cannot share one environment with the engine.
ViT-H-14 is plain CLIP, which transformers implements, so the HPS checkpoint (open_clip names) is loaded
into a transformers `CLIPModel` of the same geometry through `map_open_clip_keys`. The map is checked
against open_clip itself: tests/data/make_hpsv2_golden.py writes a tiny random open_clip model's state
dict, inputs and scores, and tests/test_rewards_real.py reproduces the scores to 1e-5 through the map.

Arguments (reward_args `hpsv2.KEY=VALUE`):
  checkpoint  the HPS v2.1 file: a path to HPS_v2.1_compressed.pt (a torch file holding {"state_dict": ...},
              or a .safetensors state dict); a bare file name is taken from the hub repo xswu/HPSv2 (e.g.
              HPS_v2_compressed.pt for v2.0); default HPS_v2.1_compressed.pt from the local hub cache, or
              downloaded when online.
  processor   the tokenizer and image sizes: default laion/CLIP-ViT-H-14-laion2B-s32B-b79K (only its small
              files are needed). open_clip's tokenizer is CLIP's BPE; transformers' CLIP tokenizer on the same
              BPE gives the same ids, 77 long (checked by make_hpsv2_golden.py), once HTML entities are
              unescaped as open_clip does (prepare_prompt).
  model       a directory or hub id whose config.json gives the CLIP geometry instead of the built-in
              ViT-H-14 (and the processor, when `processor` is not given).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import torch

from solrl_engine.rewards._clip import (
    CLIPScorer,
    check_processor,
    check_source,
    device_of,
    download_hint,
    is_local,
    resolve_dtype,
    resolve_hub_file,
)

DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
HUB_REPO = "xswu/HPSv2"
CHECKPOINT = "HPS_v2.1_compressed.pt"
CHECKPOINT_URL = f"https://huggingface.co/{HUB_REPO}/resolve/main/{CHECKPOINT}"
_GET = f"Get it with {download_hint(HUB_REPO, CHECKPOINT)} or from {CHECKPOINT_URL}, and pass hpsv2.checkpoint=FILE"


def vit_h_14_config() -> Any:
    """open_clip's ViT-H-14 (its model_configs/ViT-H-14.json) as a transformers CLIPConfig: exact GELU,
    LayerNorm eps 1e-5, 16 heads of 80 (vision) and of 64 (text). eos_token_id 2 selects transformers'
    argmax pooling of the text tower, which is open_clip's (the end token has the largest id)."""
    from transformers import CLIPConfig

    text = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
                bos_token_id=49406, eos_token_id=2, pad_token_id=1)  # fmt: skip
    vision = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                  image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5)  # fmt: skip
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=1024)


def resolve_checkpoint(checkpoint: str | None = None) -> str | None:
    """The checkpoint's local path; None when it is a hub file that is not cached and will be downloaded.
    Raises FileNotFoundError (naming the file and how to get it) for a missing path, or a hub file that is
    not cached while offline."""
    return resolve_hub_file(checkpoint or CHECKPOINT, HUB_REPO, "hpsv2 checkpoint", CHECKPOINT, _GET)


def check_weights(
    model: str | None = None, checkpoint: str | None = None, processor: str | None = None, **_: object
) -> None:
    """Before loading: the checkpoint, the processor and (if given) the geometry's config can be found."""
    if model:
        check_source(model, "hpsv2 model (the CLIP geometry)")
    check_processor(processor or model or DEFAULT_PROCESSOR, "hpsv2 processor (CLIP-H tokenizer and image sizes)")
    resolve_checkpoint(checkpoint)


_BLOCK = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
          "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}  # fmt: skip
_LAYER_NORMS = {"visual.ln_pre": "vision_model.pre_layrnorm", "visual.ln_post": "vision_model.post_layernorm",
                "ln_final": "text_model.final_layer_norm"}  # fmt: skip


def map_open_clip_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict -> transformers CLIPModel names. Attention's packed in_proj splits into
    q/k/v; the two projections are transposed (open_clip multiplies x @ proj, transformers x @ W.T). Every
    source key must be used, so a checkpoint of another architecture fails here, not as wrong scores."""
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"not an open_clip CLIP state dict: no {key!r}")
        used.add(key)
        return sd[key]

    out: dict[str, torch.Tensor] = {}
    for src, dst in (("visual.", "vision_model."), ("", "text_model.")):
        i = 0
        while f"{src}transformer.resblocks.{i}.ln_1.weight" in sd:
            s, d = f"{src}transformer.resblocks.{i}.", f"{dst}encoder.layers.{i}."
            for kind in ("weight", "bias"):
                q, k, v = take(f"{s}attn.in_proj_{kind}").chunk(3)
                for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[f"{d}self_attn.{proj}.{kind}"] = t
                for a, b in _BLOCK.items():
                    out[f"{d}{b}.{kind}"] = take(f"{s}{a}.{kind}")
            i += 1
        if i == 0:
            raise ValueError(f"not an open_clip CLIP state dict: no {src}transformer.resblocks.0")
    out["vision_model.embeddings.class_embedding"] = take("visual.class_embedding")
    out["vision_model.embeddings.patch_embedding.weight"] = take("visual.conv1.weight")
    out["vision_model.embeddings.position_embedding.weight"] = take("visual.positional_embedding")
    for a, b in _LAYER_NORMS.items():
        out[f"{b}.weight"], out[f"{b}.bias"] = take(f"{a}.weight"), take(f"{a}.bias")
    out["visual_projection.weight"] = take("visual.proj").t().contiguous()
    out["text_projection.weight"] = take("text_projection").t().contiguous()
    out["text_model.embeddings.token_embedding.weight"] = take("token_embedding.weight")
    out["text_model.embeddings.position_embedding.weight"] = take("positional_embedding")
    out["logit_scale"] = take("logit_scale").reshape(())
    left = sorted(set(sd) - used - {"attn_mask", "visual.attn_mask"})
    if left:
        raise ValueError(f"open_clip keys this CLIP has no place for: {left[:6]}{'...' if len(left) > 6 else ''}")
    return out


def load_open_clip_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The state dict of an HPS checkpoint: a torch file ({"state_dict": ...} or a bare state dict) or a
    .safetensors file. Torch files are read with weights_only=True (no arbitrary unpickling)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError or RuntimeError, by version
        raise ValueError(
            f"{path} cannot be read as tensors only ({type(e).__name__}: {str(e)[:200]}). If you trust the file, "
            'convert it once: python -c "import torch, safetensors.torch as s; '
            f"s.save_file(torch.load('{path}', weights_only=False)['state_dict'], 'hps.safetensors')\" "
            "and pass hpsv2.checkpoint=hps.safetensors"
        ) from e
    sd = ck.get("state_dict", ck) if isinstance(ck, dict) else ck
    if not isinstance(sd, dict):
        raise ValueError(f"{path} holds a {type(sd).__name__}, not a state dict")
    return sd


def build_model(state_dict: dict[str, torch.Tensor], config: Any = None) -> Any:
    """A transformers CLIPModel (float32, on the CPU) holding an open_clip state dict. Built on the meta
    device, so ViT-H's ~1B parameters are not initialised only to be overwritten."""
    from transformers import CLIPModel

    mapped = map_open_clip_keys(state_dict)
    with torch.device("meta"):
        model = CLIPModel(config if config is not None else vit_h_14_config())
    model.to_empty(device="cpu")
    try:
        missing, unexpected = model.load_state_dict(mapped, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"the checkpoint does not fit this CLIP geometry: {str(e)[:600]}") from e
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit this CLIP geometry: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")  # fmt: skip
    for name, buf in model.named_buffers():  # to_empty left the non-persistent buffers uninitialised
        if not name.endswith("position_ids"):
            raise RuntimeError(f"unexpected buffer {name} (transformers changed CLIP?)")
        owner = model.get_submodule(name.rpartition(".")[0])
        owner.position_ids = torch.arange(buf.shape[-1]).expand(1, -1)
    return model.eval()


class HPSv2(CLIPScorer):
    """diag(image_features @ text_features.T) of normalised features (see the module docstring)."""

    clamp_resized = False  # HPS resizes float tensors (ToTensor, then Resize): no uint8 clipping

    def __init__(
        self,
        model: str | None = None,
        checkpoint: str | None = None,
        processor: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ) -> None:
        check_weights(model, checkpoint, processor)
        path = resolve_checkpoint(checkpoint)
        if path is None:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(HUB_REPO, checkpoint or CHECKPOINT)
        config = None
        if model:
            from transformers import CLIPConfig

            config = CLIPConfig.from_pretrained(str(Path(model).expanduser()) if is_local(model) else model)
        clip = build_model(load_open_clip_checkpoint(path), config)
        self.checkpoint = path
        super().__init__(clip, processor or model or DEFAULT_PROCESSOR, device_of(device), resolve_dtype(dtype),
                         batch_size)  # fmt: skip

    def multiplier(self) -> float:
        return 1.0

    def prepare_prompt(self, prompt: str) -> str:
        """open_clip's tokenizer unescapes HTML entities ("&amp;") before BPE; transformers' does not (the
        other differences, whitespace and case, its normaliser covers; ftfy's mojibake repair is skipped)."""
        return html.unescape(html.unescape(prompt)).strip()
