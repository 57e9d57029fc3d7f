"""ImageReward without its package: the key map and scoring against the package's own outputs.

tests/data/imagereward_golden.safetensors was made by tests/data/make_imagereward_golden.py in a
separate environment with image-reward 1.5 installed: a tiny random-weight model built from the
package's classes, its state_dict under the package's key names, and the scores its own
`ImageReward.score` gave. Here it goes through our key map into transformers' BLIP classes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from solrl_engine.rewards import imagereward as ir

GOLDEN = Path(__file__).parent / "data" / "imagereward_golden.safetensors"


@pytest.fixture(scope="module")
def golden() -> dict:
    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tiny = json.loads(meta["tiny"])
    vocab = meta["vocab"].split("\n")
    config = ir.ImageRewardConfig(
        image_size=tiny["image_size"],
        patch_size=tiny["patch_size"],
        vision_width=tiny["vision_width"],
        vision_layers=tiny["vision_layers"],
        vision_heads=tiny["vision_heads"],
        vocab_size=len(vocab) + 2,
        text_width=tiny["text_width"],
        text_layers=tiny["text_layers"],
        text_heads=tiny["text_heads"],
        text_intermediate=tiny["text_intermediate"],
        max_positions=tiny["max_positions"],
    )
    return {
        "sd": {k.removeprefix("sd."): v for k, v in tensors.items() if k.startswith("sd.")},
        "t": tensors,
        "prompts": json.loads(meta["prompts"]),
        "vocab": vocab,
        "config": config,
        "mean_std": json.loads(meta["mean_std"]),
    }


@pytest.fixture(scope="module")
def tok_dir(golden: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tokenizer")
    (d / "vocab.txt").write_text("\n".join(golden["vocab"]) + "\n")
    return d


@pytest.fixture(scope="module")
def scorer(golden: dict, tok_dir: Path) -> ir.ImageRewardScorer:
    return ir.ImageRewardScorer(state_dict=golden["sd"], tokenizer=str(tok_dir), config=golden["config"], device="cpu")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.float()[None] / 255


def test_constants_are_the_packages(golden: dict) -> None:
    assert golden["mean_std"] == [ir.REWARD_MEAN, ir.REWARD_STD]


def test_tokenization_matches_package(golden: dict, scorer: ir.ImageRewardScorer) -> None:
    ids, mask = scorer.tokenize(golden["prompts"])
    assert torch.equal(ids, golden["t"]["input_ids"])
    assert torch.equal(mask, golden["t"]["attention_mask"])
    assert ids.shape[1] == ir.MAX_LENGTH and bool(mask[2].all())  # the long prompt is truncated
    assert bool((ids[:, 0] == scorer.tokenizer.cls_token_id).all())  # [CLS] kept, not [ENC]


def test_key_map_reproduces_package_scores(golden: dict, scorer: ir.ImageRewardScorer) -> None:
    t = golden["t"]
    # the package's own preprocessed 224x224 images (uint8 out of PIL), batched
    images = torch.cat([_u8(t["image0"]), _u8(t["crop1"]), _u8(t["image2"])])
    scores = scorer(images, golden["prompts"])
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), t["score"], atol=1e-5, rtol=0)


def test_preprocess_matches_package_pil(golden: dict) -> None:
    t = golden["t"]
    std = torch.tensor(ir.PIXEL_STD).view(1, 3, 1, 1)
    # 224x224 in: no resize, no crop, in either
    assert torch.equal(ir.preprocess(_u8(t["image0"])), ir.preprocess(_u8(t["image0"])[..., :224, :224]))
    # 96x136 in: bicubic with antialias is PIL's kernel; what is left is PIL's uint8 rounding
    diff = (ir.preprocess(_u8(t["image1"])) - ir.preprocess(_u8(t["crop1"]))) * std * 255
    assert diff.abs().max() < 2.0 and diff.abs().mean() < 0.5


def test_full_path_score_close_to_package(golden: dict, scorer: ir.ImageRewardScorer) -> None:
    """Raw non-square image through our tensor preprocessing vs the package's PIL one."""
    s = scorer(_u8(golden["t"]["image1"]), golden["prompts"][1:2])
    assert abs(s.item() - golden["t"]["score"][1].item()) < 5e-3


def test_key_map_covers_the_package_keys(golden: dict, scorer: ir.ImageRewardScorer) -> None:
    mapped, ignored = ir.map_checkpoint_keys(golden["sd"])
    assert set(mapped) == set(scorer.model.state_dict())
    assert sorted(ignored) == [
        "blip.text_encoder.embeddings.position_ids",
        "blip.text_proj.bias",
        "blip.text_proj.weight",
        "blip.vision_proj.bias",
        "blip.vision_proj.weight",
    ]


def test_key_map_covers_full_size_model(golden: dict) -> None:
    """The package's key names at ImageReward v1.0's depth (24 ViT blocks, 12 BERT layers) reach every
    weight of the default-config model (built on the meta device: no memory)."""
    full = ir.ImageRewardConfig()
    keys = set()
    for k in golden["sd"]:
        if m := re.match(r"(blip\.visual_encoder\.blocks\.)\d+(\..*)", k):
            keys |= {f"{m[1]}{i}{m[2]}" for i in range(full.vision_layers)}
        elif m := re.match(r"(blip\.text_encoder\.encoder\.layer\.)\d+(\..*)", k):
            keys |= {f"{m[1]}{i}{m[2]}" for i in range(full.text_layers)}
        else:
            keys.add(k)
    mapped, _ = ir.map_checkpoint_keys(dict.fromkeys(keys, torch.empty(0)))
    with torch.device("meta"):
        model = ir.ImageRewardModel(full)
    assert set(mapped) == set(model.state_dict())
    n = sum(p.numel() for p in model.parameters())
    assert 4.4e8 < n < 4.9e8, n  # ViT-L/16 (~303M) + BERT-base with cross-attention (~137M+) + head


def test_scores_shape_finite_and_differentiable(scorer: ir.ImageRewardScorer) -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 64, 80, generator=g)
    prompts = ["a red cat", "a dog on the sofa"]
    s = scorer(images, prompts)
    assert s.shape == (2,) and bool(torch.isfinite(s).all()) and not s.requires_grad
    x = images.clone().requires_grad_(True)
    scorer.score(x, prompts).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and x.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "images",
    [torch.rand(3, 32, 32), torch.rand(2, 4, 32, 32), torch.rand(2, 1, 32, 32), torch.zeros(2, 3, 32, 32).byte()],
)
def test_bad_images_raise(scorer: ir.ImageRewardScorer, images: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]|floats"):
        scorer(images, ["a cat"] * 2)


def test_prompt_count_mismatch_raises(scorer: ir.ImageRewardScorer) -> None:
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        scorer(torch.rand(2, 3, 32, 32), ["a cat"])


def test_loads_from_local_dir(golden: dict, tok_dir: Path, tmp_path: Path) -> None:
    """The real loading path: check_weights, torch.load of ImageReward.pt, key map."""
    torch.save(golden["sd"], tmp_path / ir.CHECKPOINT)
    found = ir.check_weights(str(tmp_path), tokenizer=str(tok_dir))
    assert found == {"checkpoint": str(tmp_path / ir.CHECKPOINT), "vocab": str(tok_dir / "vocab.txt")}
    s = ir.ImageRewardScorer(str(tmp_path), tokenizer=str(tok_dir), config=golden["config"], device="cpu")
    t = golden["t"]
    torch.testing.assert_close(s(_u8(t["image0"]), golden["prompts"][:1]).double(), t["score"][:1], atol=1e-5, rtol=0)


def test_check_weights_names_missing_local_files(tmp_path: Path, tok_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "ImageReward.pt")) + ".*hf download"):
        ir.check_weights(str(tmp_path), tokenizer=str(tok_dir))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.pt"))):
        ir.check_weights(checkpoint=str(tmp_path / "nope.pt"), tokenizer=str(tok_dir))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "vocab.txt")) + ".*bert-base-uncased"):
        torch.save({}, tmp_path / "ImageReward.pt")
        ir.check_weights(str(tmp_path), tokenizer=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):  # before any model is built
        ir.ImageRewardScorer(str(tmp_path / "missing"), tokenizer=str(tok_dir), device="cpu")


def test_check_weights_uncached_hub_offline(tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(
        FileNotFoundError, match=r"'ImageReward\.pt' of the hub repo 'THUDM/ImageReward'.*HF_HUB_OFFLINE"
    ):
        ir.check_weights(tokenizer=str(tok_dir))
    torch.save({}, tmp_path / "ImageReward.pt")
    with pytest.raises(FileNotFoundError, match=r"'vocab\.txt' of the hub repo 'bert-base-uncased'"):
        ir.check_weights(str(tmp_path))


def test_bf16_towers_stay_close(golden: dict, tok_dir: Path) -> None:
    """dtype=bfloat16 (what a GPU run would use) casts the towers only; the head stays float32."""
    s = ir.ImageRewardScorer(
        state_dict=golden["sd"], tokenizer=str(tok_dir), config=golden["config"], device="cpu", dtype=torch.bfloat16
    )
    assert s.model.vision.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    assert s.model.head.layers[0].weight.dtype == torch.float32
    t = golden["t"]
    images = torch.cat([_u8(t["image0"]), _u8(t["crop1"]), _u8(t["image2"])])
    torch.testing.assert_close(s(images, golden["prompts"]).double(), t["score"], atol=0.05, rtol=0)
