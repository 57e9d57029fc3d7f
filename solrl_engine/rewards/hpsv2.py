"""`hpsv2`: Human Preference Score v2.1 (Wu et al., 2023): an open_clip ViT-H-14 fine-tuned on human
preferences, scored as the official code does: diag(image_features @ text_features.T) of the
normalised features (no logit scale).

open_clip imports torchvision, and PyPI's torchvision does not import beside a CPU PyTorch wheel, so
the official route cannot share one environment with the rest of the engine. ViT-H-14 is plain CLIP,
which transformers implements: we build a transformers `CLIPModel` from the geometry of
laion/CLIP-ViT-H-14-laion2B-s32B-b79K (`model=`, hub id or local directory; it also gives the tokenizer
and image sizes) and load the HPS v2.1 checkpoint (`checkpoint=`, the file `HPS_v2.1_compressed.pt`
from the hub repo xswu/HPSv2) into it through `map_open_clip_keys`. The map was checked against
open_clip itself on tiny random weights (tests/data/make_hpsv2_golden.py writes open_clip's state dict,
inputs and scores; tests/test_rewards_real.py reproduces them through the map).
"""

from __future__ import annotations

from pathlib import Path

import torch

from solrl_engine.rewards._clip import CLIPScorer, check_source, is_local, offline

DEFAULT_MODEL = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
HUB_REPO = "xswu/HPSv2"
CHECKPOINT = "HPS_v2.1_compressed.pt"


def resolve_checkpoint(checkpoint: str | None) -> str | None:
    """A local file path, or the cached hub file; None when it will be downloaded (online)."""
    if checkpoint and (is_local(checkpoint) or Path(checkpoint).suffix in (".pt", ".bin", ".safetensors")):
        if not Path(checkpoint).expanduser().is_file():
            raise FileNotFoundError(
                f"hpsv2 checkpoint {checkpoint!r} does not exist: download {CHECKPOINT} "
                f"(`huggingface-cli download {HUB_REPO} {CHECKPOINT}`) and pass its path as hpsv2.checkpoint=FILE"
            )
        return str(Path(checkpoint).expanduser())
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(HUB_REPO, checkpoint or CHECKPOINT)
    if isinstance(cached, str):
        return cached
    if offline():
        raise FileNotFoundError(
            f"hpsv2 checkpoint {CHECKPOINT} of {HUB_REPO} is not in the local Hugging Face cache and HF_HUB_OFFLINE "
            f"is set: run `huggingface-cli download {HUB_REPO} {CHECKPOINT}` or pass hpsv2.checkpoint=FILE"
        )
    return None


def check_weights(model: str = DEFAULT_MODEL, checkpoint: str | None = None, **_: object) -> None:
    check_source(model, "hpsv2 model (the CLIP-H geometry, tokenizer and image sizes)")
    resolve_checkpoint(checkpoint)


def map_open_clip_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip CLIP state dict -> transformers CLIPModel names (q/k/v split, projections transposed)."""
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}

    def tower(src: str, dst: str) -> None:
        i = 0
        while f"{src}transformer.resblocks.{i}.ln_1.weight" in sd:
            s, d = f"{src}transformer.resblocks.{i}.", f"{dst}encoder.layers.{i}."
            q, k, v = sd[s + "attn.in_proj_weight"].chunk(3)
            qb, kb, vb = sd[s + "attn.in_proj_bias"].chunk(3)
            for name, w, b in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
                out[d + f"self_attn.{name}.weight"], out[d + f"self_attn.{name}.bias"] = w, b
            pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
                     "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}  # fmt: skip
            for a, b_ in pairs.items():
                out[d + b_ + ".weight"], out[d + b_ + ".bias"] = sd[s + a + ".weight"], sd[s + a + ".bias"]
            i += 1

    tower("visual.", "vision_model.")
    tower("", "text_model.")
    out["vision_model.embeddings.class_embedding"] = sd["visual.class_embedding"]
    out["vision_model.embeddings.patch_embedding.weight"] = sd["visual.conv1.weight"]
    out["vision_model.embeddings.position_embedding.weight"] = sd["visual.positional_embedding"]
    for a, b in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                 ("ln_final", "text_model.final_layer_norm")):  # fmt: skip
        out[b + ".weight"], out[b + ".bias"] = sd[a + ".weight"], sd[a + ".bias"]
    out["visual_projection.weight"] = sd["visual.proj"].t().contiguous()
    out["text_projection.weight"] = sd["text_projection"].t().contiguous()
    out["text_model.embeddings.token_embedding.weight"] = sd["token_embedding.weight"]
    out["text_model.embeddings.position_embedding.weight"] = sd["positional_embedding"]
    out["logit_scale"] = sd["logit_scale"].reshape(())
    return out


def load_open_clip_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The HPS checkpoint's state dict ({"state_dict": ...} or a bare one; safetensors or torch)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    ck = torch.load(path, map_location="cpu", weights_only=True)
    return ck.get("state_dict", ck) if isinstance(ck, dict) else ck


class HPSv2(CLIPScorer):
    """See the module docstring. `checkpoint`: the HPS v2.1 file (default: the hub's, when cached)."""

    def __init__(self, model: str = DEFAULT_MODEL, checkpoint: str | None = None, **kw: object) -> None:
        check_weights(model, checkpoint)
        path = resolve_checkpoint(checkpoint)
        if path is None:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(HUB_REPO, checkpoint or CHECKPOINT)
        super().__init__(model, model, weights=False, **kw)  # type: ignore[arg-type]
        mapped = map_open_clip_keys(load_open_clip_checkpoint(path))
        missing, unexpected = self.model.load_state_dict(mapped, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(
                f"{path} does not fit the CLIP geometry of {model}: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        self.model.to(self.device, self.dtype).eval()
