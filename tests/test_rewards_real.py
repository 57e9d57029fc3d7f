"""The real reward models (clipscore, pickscore, hpsv2) on tiny random-weight models of their real
classes, saved and loaded as a user's would be; HPS v2.1's key map against open_clip's own scores (the
golden file); the reward registry, weighted sums, reward_args and the missing-weights errors."""

from __future__ import annotations

import json
import sys
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


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache (the constant is read at import, so patch it as well as the variable)."""
    import huggingface_hub.constants as c

    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    return cache


def _images(n: int = 3, size: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


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
    torch.testing.assert_close(reward.last_components[name], other)


def test_tensor_preprocessing_is_the_processors(clip_dir):
    """Resize (shorter side, longer floored), center crop and normalisation as CLIPImageProcessor does, on
    square, landscape and portrait images (smooth ones, so PIL's uint8 rounding is the only difference)."""
    from PIL import Image
    from transformers import CLIPImageProcessor

    from solrl_engine.rewards._clip import ImageSpec, preprocess

    spec, proc = ImageSpec.load(str(clip_dir)), CLIPImageProcessor.from_pretrained(clip_dir)
    for h, w in ((48, 48), (40, 71), (67, 45), (20, 26)):
        yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        img = torch.stack([yy, xx, (yy + xx) / 2])[None]
        pil = Image.fromarray((img[0].permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
        want = proc(images=[pil], return_tensors="pt")["pixel_values"]
        got = preprocess(img, spec)
        assert got.shape == want.shape == (1, 3, 32, 32)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0)  # ~2 uint8 steps / std


def test_batching_repeats_and_gradients(clip_dir):
    """Batches of 2 give the batch-of-32 scores; repeated prompts (a rollout group) score as distinct ones;
    score() is differentiable in the images, __call__ is not."""
    images = _images(5, seed=1)
    prompts = ["a cat", "a cat", "a dog", "a cat", "a dog"]
    big = load_reward("clipscore", {"clipscore": {"model": str(clip_dir)}})
    small = load_reward("clipscore", {"clipscore": {"model": str(clip_dir), "batch_size": "2"}})
    torch.testing.assert_close(small(images, prompts), big(images, prompts), atol=1e-6, rtol=0)
    scorer = small.parts[0][2]
    one_by_one = torch.cat([scorer(images[i : i + 1], [p]) for i, p in enumerate(prompts)])
    torch.testing.assert_close(scorer(images, prompts), one_by_one, atol=1e-6, rtol=0)
    x = images.clone().requires_grad_(True)
    scorer.score(x, prompts).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert not scorer(images, prompts).requires_grad


def test_bfloat16_scores_are_close_to_float32(clip_dir):
    fp32 = load_reward("clipscore", {"clipscore": {"model": str(clip_dir)}})
    bf16 = load_reward("clipscore", {"clipscore": {"model": str(clip_dir), "dtype": "bfloat16"}})
    assert bf16.parts[0][2].model.dtype == torch.bfloat16
    r = bf16(_images(), PROMPTS)
    assert r.dtype == torch.float32
    torch.testing.assert_close(r, fp32(_images(), PROMPTS), atol=3e-2, rtol=0)


def test_weighted_sum_is_the_sum_of_its_components(clip_dir):
    args = parse_reward_args((f"clipscore.model={clip_dir}", f"pickscore.model={clip_dir}",
                              f"pickscore.processor={clip_dir}"))  # fmt: skip
    total = load_reward("pickscore:1.0,clipscore:0.5", args)
    images = _images()
    r = total(images, PROMPTS)
    comps = total.last_components
    assert set(comps) == {"pickscore", "clipscore"}
    torch.testing.assert_close(r, comps["pickscore"] + 0.5 * comps["clipscore"])
    torch.testing.assert_close(comps["clipscore"], load_reward("clipscore", args)(images, PROMPTS))
    assert repr(total) == "1 * pickscore + 0.5 * clipscore"


def test_shapes_still_loads_by_name():
    from solrl_engine.data import shapes as world

    reward = load_reward("shapes")
    prompts = ["a red circle", "a blue square"]
    r = reward(torch.rand(2, 3, world.IMAGE_SIZE, world.IMAGE_SIZE), prompts)
    assert r.shape == (2,) and set(reward.last_components) == {"shapes"}
    with pytest.raises(ValueError, match="has no argument 'model'"):
        load_reward("shapes", model="/w")


# ---------------------------------------------------------------------------------------------- HPS v2.1


def _golden() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    gold = load_file(DATA / "hpsv2_golden.safetensors")
    with safe_open(DATA / "hpsv2_golden.safetensors", "pt") as f:
        geo = json.loads(f.metadata()["geometry"])
    sd = {k.removeprefix("state_dict."): v for k, v in gold.items() if k.startswith("state_dict.")}
    return gold, sd, geo


def _unit(x: object) -> torch.Tensor:
    x = x if isinstance(x, torch.Tensor) else x.pooler_output  # type: ignore[attr-defined]
    return x / x.norm(dim=-1, keepdim=True)


def test_hpsv2_key_map_reproduces_open_clip():
    """open_clip's own scores (tests/data/make_hpsv2_golden.py) through map_open_clip_keys + build_model,
    with open_clip's zero padding and with the end-token padding our tokenizer makes."""
    from solrl_engine.rewards.hpsv2 import build_model

    gold, sd, geo = _golden()
    config = clip_config(geo["vocab_size"], geo["image_size"], eos_token_id=2, projection_dim=geo["embed_dim"])
    model = build_model(sd, config)
    tokens = gold["tokens"]
    eot = int(tokens.max())
    first_eot = (tokens == eot).int().argmax(-1, keepdim=True)
    after = torch.arange(tokens.shape[1])[None] > first_eot
    with torch.no_grad():
        img = _unit(model.get_image_features(pixel_values=gold["pixels"]))
        for ids in (tokens, torch.where(after, eot, tokens)):
            txt = _unit(model.get_text_features(input_ids=ids, attention_mask=(~after).long()))
            torch.testing.assert_close((img * txt).sum(-1), gold["scores"], atol=1e-5, rtol=1e-5)


def test_hpsv2_key_map_rejects_other_architectures():
    from solrl_engine.rewards.hpsv2 import map_open_clip_keys

    _, sd, _ = _golden()
    with pytest.raises(ValueError, match="no place for"):
        map_open_clip_keys({**sd, "visual.attn_pool.query": torch.zeros(1)})
    with pytest.raises(ValueError, match="visual.proj"):
        map_open_clip_keys({k: v for k, v in sd.items() if k != "visual.proj"})
    assert set(map_open_clip_keys({f"module.{k}": v for k, v in sd.items()})) == set(map_open_clip_keys(sd))


def test_hpsv2_builtin_geometry_is_vit_h_14():
    """The built-in config is open_clip's ViT-H-14 (model_configs/ViT-H-14.json), checked on the meta device."""
    from transformers import CLIPModel

    from solrl_engine.rewards.hpsv2 import vit_h_14_config

    cfg = vit_h_14_config()
    with torch.device("meta"):
        model = CLIPModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["vision_model.embeddings.position_embedding.weight"] == (257, 1280)  # (224 / 14)^2 + 1
    assert shapes["text_model.embeddings.token_embedding.weight"] == (49408, 1024)
    assert shapes["visual_projection.weight"] == (1024, 1280) and shapes["text_projection.weight"] == (1024, 1024)
    assert cfg.vision_config.num_hidden_layers == 32 and cfg.text_config.num_hidden_layers == 24
    assert cfg.vision_config.hidden_size // cfg.vision_config.num_attention_heads == 80  # head_width 80
    assert cfg.text_config.num_attention_heads == 16 and cfg.text_config.hidden_act == "gelu"
    assert sum(v.numel() for v in model.state_dict().values()) == pytest.approx(986.1e6, rel=1e-3)


def _to_open_clip(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers CLIPModel -> open_clip names (the inverse of map_open_clip_keys), as HPS ships them."""
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
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_hpsv2_reward_loads_a_checkpoint_file(tmp_path, clip_dir, fmt):
    """The reward path: geometry and processor from `model`, weights from an open_clip-format checkpoint
    (a torch file holding {"state_dict": ...} as HPS ships it, or safetensors); the score is the cosine."""
    from safetensors.torch import save_file
    from transformers import CLIPModel

    from solrl_engine.rewards._clip import ImageSpec, preprocess

    hf = CLIPModel.from_pretrained(clip_dir).eval()
    ck = tmp_path / f"hps.{fmt}"
    torch.save({"state_dict": _to_open_clip(hf), "epoch": 1}, ck) if fmt == "pt" else save_file(_to_open_clip(hf), ck)
    reward = load_reward("hpsv2", {"hpsv2": {"model": str(clip_dir), "checkpoint": str(ck)}})
    images = _images()
    r = reward(images, PROMPTS)
    assert r.shape == (3,) and torch.isfinite(r).all()
    tok = reward.parts[0][2].tokenizer(PROMPTS, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():  # by hand: the original model, HPS's preprocessing (no clamp after the resize)
        img = _unit(hf.get_image_features(pixel_values=preprocess(images, ImageSpec.load(str(clip_dir)), False)))
        txt = _unit(hf.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]))
    torch.testing.assert_close(r, (img * txt).sum(-1), atol=1e-5, rtol=0)
    # and the PIL route of the processor agrees to rounding; HTML entities are unescaped as open_clip does
    cosine = _by_hand(clip_dir, images, PROMPTS, float(hf.logit_scale.detach().exp()))
    torch.testing.assert_close(r, cosine, atol=2e-3, rtol=0)
    torch.testing.assert_close(reward(images[:1], ["salt &amp; pepper"]), reward(images[:1], ["salt & pepper"]))


# ------------------------------------------------------------------------------- arguments and errors


def test_reward_args_parse_and_their_errors(clip_dir):
    assert parse_reward_args(("pickscore.model=/w/ps", "pickscore.processor=/w/h", "hpsv2.checkpoint=/w/h.pt")) == {
        "pickscore": {"model": "/w/ps", "processor": "/w/h"},
        "hpsv2": {"checkpoint": "/w/h.pt"},
    }
    assert parse_reward_args(()) == {}
    for bad in ("pickscore=/w", "pickscore.model", "model=/w", ".model=/w", "pickscore.=/w", "pickscore.model="):
        with pytest.raises(ValueError, match=rf"{bad}.*name\.key=value"):
            parse_reward_args((bad,))
    with pytest.raises(ValueError, match="unknown reward 'pikscore'"):
        parse_reward_args(("pikscore.model=/w",))
    with pytest.raises(ValueError, match="unknown reward"):
        load_reward("shapes:1,nope:2")
    with pytest.raises(ValueError, match="not a number"):
        load_reward("shapes:x")
    with pytest.raises(ValueError, match="'hpsv2', which is not part of"):
        check_reward("clipscore", {"clipscore": {"model": str(clip_dir)}, "hpsv2": {"checkpoint": "/w/h.pt"}})
    # a misspelt key or a bad value fails at start-up, naming what is accepted
    with pytest.raises(ValueError, match="no argument 'modle'.*model, processor"):
        check_reward("pickscore", {"pickscore": {"modle": "/w"}})
    with pytest.raises(ValueError, match=r"clipscore.batch_size='many': expected int"):
        check_reward("clipscore", {"clipscore": {"model": str(clip_dir), "batch_size": "many"}})
    with pytest.raises(ValueError, match="clipscore.dtype='float42'"):
        check_reward("clipscore", {"clipscore": {"model": str(clip_dir), "dtype": "float42"}})
    check_reward("clipscore", {"clipscore": {"model": str(clip_dir), "dtype": "bfloat16", "divisor": "30"}})


@pytest.mark.parametrize("name", ["clipscore", "pickscore", "hpsv2"])
def test_a_missing_directory_is_named(tmp_path, name):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        check_reward(name, {name: {"model": str(missing)}})
    if name != "clipscore":
        with pytest.raises(FileNotFoundError, match=f"{name} processor.*{missing}"):
            check_reward(name, {name: {"processor": str(missing)}})


def test_a_directory_without_weights_is_named(tmp_path, clip_dir):
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(clip_dir, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match=f"{partial}.*no weights"):
        check_reward("clipscore", {"clipscore": {"model": str(partial)}})


@pytest.mark.parametrize(
    ("name", "ids"),
    [
        ("clipscore", ["openai/clip-vit-large-patch14"]),
        ("pickscore", ["yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"]),
        ("hpsv2", ["laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "xswu/HPSv2"]),
    ],
)
def test_uncached_hub_ids_fail_offline_and_pass_online(monkeypatch, empty_cache, clip_dir, name, ids):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=rf"{ids[0]}.*offline.*hf download {ids[0]}"):
        check_reward(name)  # the default hub ids, not cached, offline
    if len(ids) > 1:  # the second source, once the first is a local directory
        key = "model" if name == "pickscore" else "processor"
        with pytest.raises(FileNotFoundError, match=rf"{ids[1]}.*hf download {ids[1]}"):
            check_reward(name, {name: {key: str(clip_dir)}})
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_reward(name)  # online: the ids will download when the reward loads; nothing is fetched here


def test_hpsv2_checkpoint_errors_name_the_file_and_how_to_get_it(tmp_path, clip_dir, monkeypatch, empty_cache):
    args = {"model": str(clip_dir), "checkpoint": str(tmp_path / "hps.pt")}
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'hps.pt'}.*HPS_v2.1_compressed.pt.*hf download xswu"):
        check_reward("hpsv2", {"hpsv2": args})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url = "https://huggingface.co/xswu/HPSv2/resolve/main/HPS_v2.1_compressed.pt"
    with pytest.raises(FileNotFoundError, match=f"HPS_v2.1_compressed.pt of the hub repo xswu/HPSv2.*{url}"):
        check_reward("hpsv2", {"hpsv2": {"model": str(clip_dir)}})
    with pytest.raises(FileNotFoundError, match="HPS_v2_compressed.pt of the hub repo xswu/HPSv2"):
        check_reward("hpsv2", {"hpsv2": {"model": str(clip_dir), "checkpoint": "HPS_v2_compressed.pt"}})


def test_a_missing_package_names_the_extra(monkeypatch, clip_dir):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    with pytest.raises(ImportError, match=r"'transformers'.*pip install -e \"\.\[rewards\]\""):
        load_reward("clipscore", {"clipscore": {"model": str(clip_dir)}})


def test_bad_inputs_are_clear_errors(clip_dir):
    reward = load_reward("clipscore", {"clipscore": {"model": str(clip_dir)}})
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.rand(3, 32, 32), PROMPTS)
    with pytest.raises(ValueError, match="uint8"):
        reward((torch.rand(3, 3, 32, 32) * 255).to(torch.uint8), PROMPTS)
    with pytest.raises(ValueError, match="3 images but 2 prompts"):
        reward(_images(), PROMPTS[:2])


def test_a_reward_of_published_layout_builds_saves_in_fp16_and_scores(tmp_path):
    """build_clip_reward(published=...): the GPU session's PickScore of CLIP ViT-H/14's size goes through this path
    (its towers' sizes, the full vocabulary beside the stand-in tokenizer, FP16 on disk); here at a small size."""
    from tiny_clip import VIT_H_14

    small = {**VIT_H_14, "image_size": 28, "projection_dim": 16,
             "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
             "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            patch_size=14)}  # fmt: skip
    path = build_clip_reward(tmp_path / "clip", published=small)
    saved = json.loads((path / "config.json").read_text())
    assert saved["text_config"]["vocab_size"] == VIT_H_14["vocab_size"] and saved["vision_config"]["patch_size"] == 14
    reward = load_reward("pickscore", parse_reward_args([f"pickscore.model={path}", f"pickscore.processor={path}"]))
    scores = reward(_images(2, 40), ["a red circle", "a blue square"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    from transformers import CLIPModel

    p = VIT_H_14
    with torch.device("meta"):  # the published layout: ViT-H-14's 986M weights (open_clip's count)
        full = CLIPModel(clip_config(p["vocab_size"], p["image_size"], 2, p["projection_dim"], p["text"], p["vision"]))
    assert 0.98e9 < sum(w.numel() for w in full.parameters()) < 0.99e9
