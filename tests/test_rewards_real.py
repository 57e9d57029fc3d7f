"""The real reward models (clipscore, pickscore, hpsv2) on tiny random-weight models of their real
classes, saved and loaded as a user's would be; the reward registry, weighted sums, reward_args and
the missing-weights errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_clip import build_clip_reward, clip_config

from solrl_engine.rewards import check_reward, load_reward, parse_reward_args

DATA = Path(__file__).parent / "data"
PROMPTS = ["a red apple on a table", "a blue car", "a lighthouse at dawn"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("clip") / "clip")


def _images(n: int = 3, size: int = 48) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(0))


def _by_hand(clip_dir: Path, images: torch.Tensor, prompts: list[str], divisor: float) -> torch.Tensor:
    """logit_scale.exp() * cos / divisor with the transformers model and processor, through PIL."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc = CLIPProcessor.from_pretrained(clip_dir)
    pil = [Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype("uint8")) for im in images]
    inp = proc(text=prompts, images=pil, return_tensors="pt", padding="max_length", max_length=77, truncation=True)
    with torch.no_grad():
        out = model(**inp)
    img = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    txt = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    return (img * txt).sum(-1) * model.logit_scale.exp() / divisor


@pytest.mark.parametrize(("name", "divisor"), [("clipscore", 100.0), ("pickscore", 26.0)])
def test_clip_rewards_match_a_hand_computation(clip_dir, name, divisor):
    args = {name: {"model": str(clip_dir)} | ({"processor": str(clip_dir)} if name == "pickscore" else {})}
    reward = load_reward(name, args)
    images = _images()
    r = reward(images, PROMPTS)
    assert r.shape == (3,) and r.dtype == torch.float32 and torch.isfinite(r).all()
    # the tensor-side resize differs from PIL's uint8 path by rounding only
    torch.testing.assert_close(r, _by_hand(clip_dir, images, PROMPTS, divisor), atol=2e-3, rtol=0)
    other = reward(images, ["a dog", "a tree", "the sea"])
    assert (other - r).abs().max() > 1e-4  # the prompt matters
    assert set(reward.last_components) == {name}


def test_weighted_sum_is_the_sum_of_its_components(clip_dir):
    args = parse_reward_args([f"clipscore.model={clip_dir}", f"pickscore.model={clip_dir}",
                              f"pickscore.processor={clip_dir}"])  # fmt: skip
    total = load_reward("pickscore:1.0,clipscore:0.5", args)
    images = _images()
    r = total(images, PROMPTS)
    comps = total.last_components
    assert set(comps) == {"pickscore", "clipscore"}
    torch.testing.assert_close(r, comps["pickscore"] + 0.5 * comps["clipscore"])
    torch.testing.assert_close(comps["clipscore"], load_reward("clipscore", args)(images, PROMPTS))


def test_hpsv2_key_map_reproduces_open_clip():
    """open_clip's own scores (tests/data/make_hpsv2_golden.py) through map_open_clip_keys."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import CLIPModel

    from solrl_engine.rewards.hpsv2 import map_open_clip_keys

    gold = load_file(DATA / "hpsv2_golden.safetensors")
    with safe_open(DATA / "hpsv2_golden.safetensors", "pt") as f:
        geo = json.loads(f.metadata()["geometry"])
    sd = {k.removeprefix("state_dict."): v for k, v in gold.items() if k.startswith("state_dict.")}
    model = CLIPModel(clip_config(geo["vocab_size"], geo["image_size"], projection_dim=geo["embed_dim"])).eval()
    missing, unexpected = model.load_state_dict(map_open_clip_keys(sd), strict=False)
    assert not unexpected and all(k.endswith("position_ids") for k in missing)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=gold["pixels"])
        txt = model.get_text_features(input_ids=gold["tokens"], attention_mask=(gold["tokens"] > 0).long())
    img = img if isinstance(img, torch.Tensor) else img.pooler_output
    txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
    torch.testing.assert_close((img * txt).sum(-1), gold["scores"], atol=1e-5, rtol=1e-5)


def test_hpsv2_reward_loads_a_checkpoint_file(tmp_path, clip_dir):
    """The reward path: CLIP geometry from `model`, weights from an open_clip-format checkpoint."""
    from transformers import CLIPModel

    hf = CLIPModel.from_pretrained(clip_dir)
    # the tiny model's weights in open_clip's format (the inverse of the map), as HPS ships them
    ck = tmp_path / "hps.pt"
    torch.save({"state_dict": _to_open_clip(hf)}, ck)
    reward = load_reward("hpsv2", {"hpsv2": {"model": str(clip_dir), "checkpoint": str(ck)}})
    r = reward(_images(), PROMPTS)
    want = _by_hand(clip_dir, _images(), PROMPTS, float(hf.logit_scale.exp().detach()))  # plain cosine
    torch.testing.assert_close(r, want, atol=2e-3, rtol=0)


def _to_open_clip(hf) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """transformers CLIPModel -> open_clip names (the inverse of map_open_clip_keys), for the test."""
    sd = hf.state_dict()
    out = {}
    for tower, src in (("visual.", "vision_model."), ("", "text_model.")):
        i = 0
        while f"{src}encoder.layers.{i}.layer_norm1.weight" in sd:
            s, d = f"{src}encoder.layers.{i}.", f"{tower}transformer.resblocks.{i}."
            out[d + "attn.in_proj_weight"] = torch.cat([sd[s + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            out[d + "attn.in_proj_bias"] = torch.cat([sd[s + f"self_attn.{x}_proj.bias"] for x in "qkv"])
            for a, b in {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
                         "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}.items():  # fmt: skip
                out[d + a + ".weight"], out[d + a + ".bias"] = sd[s + b + ".weight"], sd[s + b + ".bias"]
            i += 1
    out["visual.class_embedding"] = sd["vision_model.embeddings.class_embedding"]
    out["visual.conv1.weight"] = sd["vision_model.embeddings.patch_embedding.weight"]
    out["visual.positional_embedding"] = sd["vision_model.embeddings.position_embedding.weight"]
    for a, b in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                 ("ln_final", "text_model.final_layer_norm")):  # fmt: skip
        out[a + ".weight"], out[a + ".bias"] = sd[b + ".weight"], sd[b + ".bias"]
    out["visual.proj"] = sd["visual_projection.weight"].t().contiguous()
    out["text_projection"] = sd["text_projection.weight"].t().contiguous()
    out["token_embedding.weight"] = sd["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = sd["text_model.embeddings.position_embedding.weight"]
    out["logit_scale"] = sd["logit_scale"]
    return out


def test_reward_args_parse_and_their_errors():
    assert parse_reward_args(["pickscore.model=/w/ps", "pickscore.processor=/w/h", "hpsv2.checkpoint=/w/h.pt"]) == {
        "pickscore": {"model": "/w/ps", "processor": "/w/h"},
        "hpsv2": {"checkpoint": "/w/h.pt"},
    }
    with pytest.raises(ValueError, match="name.key=value"):
        parse_reward_args(["pickscore=/w"])
    with pytest.raises(ValueError, match="unknown reward 'pikscore'"):
        parse_reward_args(["pikscore.model=/w"])
    with pytest.raises(ValueError, match="unknown reward"):
        load_reward("shapes:1,nope:2")
    with pytest.raises(ValueError, match="not a number"):
        load_reward("shapes:x")


@pytest.mark.parametrize("name", ["clipscore", "pickscore", "hpsv2"])
def test_missing_weights_fail_before_loading_with_the_path(tmp_path, name, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        check_reward(name, {name: {"model": str(missing)}})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        check_reward(name)  # the default hub ids, not cached, offline


def test_hpsv2_missing_checkpoint_file_is_named(tmp_path, clip_dir):
    with pytest.raises(FileNotFoundError, match="hps.pt"):
        check_reward("hpsv2", {"hpsv2": {"model": str(clip_dir), "checkpoint": str(tmp_path / "hps.pt")}})


def test_a_bad_image_batch_is_a_clear_error(clip_dir):
    reward = load_reward("clipscore", {"clipscore": {"model": str(clip_dir)}})
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.rand(3, 32, 32), PROMPTS)
