"""HPSv3 on a tiny random-weight Qwen2-VL of transformers' real classes, saved and loaded as a user's would be
(a processor directory of the Qwen2-VL-Instruct layout, an HPSv3.safetensors of the published key layouts),
against the package's own scoring steps written out here: PIL resize, Qwen2-VL's chat template and processor,
the language model on embedded tokens with sequential positions, the head at <|Reward|>, its first output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_pipelines import _qwen_tokenizer

from solrl_engine.rewards import check_reward, load_reward

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-Instruct's chat template (chat_template.json), its image and text branches
TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
            "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
            "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
            "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = ["a red apple on a table", "a blue car", "a lighthouse at dawn, oil painting"]


def _old_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 4.45's names (model.layers.*, visual.*) for a state dict of today's."""
    out = {}
    for k, v in sd.items():
        if k.startswith("model.language_model."):
            k = "model." + k.removeprefix("model.language_model.")
        elif k.startswith("model.visual."):
            k = k.removeprefix("model.")
        out[k] = v
    return out


def build_hpsv3(root: Path, seed: int = 0) -> tuple[Path, Path, Path]:
    """(processor dir, checkpoint of today's key layout, checkpoint of 4.45's): a 2-layer Qwen2-VL (48 wide, M-RoPE
    sections 4/4/4) with a 1-block vision tower, the tokenizer with <|Reward|> added as the package adds it, and
    the ranknet head; the head's last layer scaled up so scores spread."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from solrl_engine.rewards.hpsv3 import head

    proc = root / "qwen2-vl"
    tok = _qwen_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(proc)
    Qwen2VLImageProcessorPil().save_pretrained(proc)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    text = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [4, 4, 4]}, pad_token_id=pad,
                bos_token_id=pad, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=48, mlp_ratio=2, num_heads=2, in_chans=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    config.save_pretrained(proc)
    torch.manual_seed(seed)
    config.text_config.vocab_size = len(tok) + 1  # the package's resize_token_embeddings after adding <|Reward|>
    vlm = Qwen2VLForConditionalGeneration(config)
    rm = head(48)
    with torch.no_grad():
        rm[5].weight.mul_(50.0)
    sd = {k: v.contiguous() for k, v in vlm.state_dict().items()}
    sd |= {f"rm_head.{k}": v for k, v in rm.state_dict().items()}
    save_file(sd, root / "HPSv3.safetensors")
    (root / "old").mkdir()
    save_file(_old_layout(sd), root / "old" / "HPSv3.safetensors")
    return proc, root / "HPSv3.safetensors", root / "old" / "HPSv3.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return build_hpsv3(tmp_path_factory.mktemp("hpsv3"))


def _images(n: int = 3, hw: tuple[int, int] = (64, 64), seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, *hw, generator=torch.Generator().manual_seed(seed))


def _by_the_package(proc: Path, ckpt: Path, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The package's HPSv3RewardInferencer.reward on transformers' classes, step by step: 8-bit PIL images resized
    (bicubic) to qwen_vl_utils' size for 256*28*28 pixels, the chat template with the instruction and the reward
    token, the processor's image-token expansion, Qwen2VLForConditionalGeneration's language model on the
    embedded tokens (position ids left to the model: sequential), the head at <|Reward|>, output 0."""
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from solrl_engine.rewards.hpsv3 import INSTRUCTION, SUFFIX, head

    tok = AutoTokenizer.from_pretrained(proc, padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    ip = AutoImageProcessor.from_pretrained(proc)
    pil = []
    for im in images:
        p = Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
        h, w = smart_resize(p.height, p.width, factor=28, min_pixels=256 * 28 * 28, max_pixels=256 * 28 * 28)
        pil.append(p.resize((w, h)))
    px = ip(images=pil, return_tensors="pt")
    texts = []
    for prompt, grid in zip(prompts, px["image_grid_thw"], strict=True):
        msg = [{"role": "user", "content": [{"type": "image"},
                                            {"type": "text", "text": INSTRUCTION.format(text_prompt=prompt) + SUFFIX}]}]
        t = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        texts.append(t.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4)))
    b = tok(texts, padding=True, return_tensors="pt")
    config = AutoConfig.from_pretrained(proc)
    config.text_config.vocab_size = len(tok)
    model = Qwen2VLForConditionalGeneration(config).eval()
    sd = load_file(ckpt)
    model.load_state_dict({k: v for k, v in sd.items() if not k.startswith("rm_head.")})
    rm = head(48).eval()
    rm.load_state_dict({k.removeprefix("rm_head."): v for k, v in sd.items() if k.startswith("rm_head.")})
    with torch.no_grad():
        emb = model.model.language_model.embed_tokens(b["input_ids"])
        feats = torch.cat(model.model.get_image_features(px["pixel_values"], px["image_grid_thw"]).pooler_output)
        mask = (b["input_ids"] == config.image_token_id).unsqueeze(-1).expand_as(emb)
        emb = emb.masked_scatter(mask, feats)
        hidden = model.model.language_model(inputs_embeds=emb, attention_mask=b["attention_mask"])[0]
        logits = rm(hidden.float())
        at = b["input_ids"] == tok.convert_tokens_to_ids("<|Reward|>")
        return logits[at].view(len(prompts), -1)[:, 0]


def _args(proc: Path, ckpt: Path, **kw: str) -> dict[str, dict[str, str]]:
    return {"hpsv3": {"processor": str(proc), "checkpoint": str(ckpt), "dtype": "float32", "device": "cpu", **kw}}


@pytest.mark.parametrize("layout", ["today", "transformers 4.45"])
def test_hpsv3_matches_the_packages_steps(tiny, layout):
    proc, new, old = tiny
    images = _images()
    reward = load_reward("hpsv3", _args(proc, old if layout != "today" else new, batch_size="2"))
    r = reward(images, PROMPTS)
    assert r.shape == (3,) and r.dtype == torch.float32 and torch.isfinite(r).all()
    torch.testing.assert_close(r, _by_the_package(proc, new, images, PROMPTS), atol=1e-4, rtol=1e-5)
    assert r.std() > 1e-3  # the tiny head spreads scores, so the comparison means something
    other = reward(images, ["a dog", "a tree", "the sea at night"])
    assert (other - r).abs().max() > 1e-4  # the prompt matters


def test_hpsv3_batching_padding_and_sizes(tiny):
    """A score does not depend on its batch (right padding, causal attention), and a non-square image goes
    through the package's resize (its area within one merged patch row of 256*28*28)."""
    proc, new, _ = tiny
    reward = load_reward("hpsv3", _args(proc, new, batch_size="3"))
    images = _images()
    together = reward(images, PROMPTS)
    alone = torch.cat([reward(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    wide = _images(2, (64, 112), seed=1)
    torch.testing.assert_close(reward(wide, PROMPTS[:2]), _by_the_package(proc, new, wide, PROMPTS[:2]),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    # a NaN or inf image scores NaN (never a made-up score from its 8-bit rounding); the others are unchanged
    bad = images.clone()
    bad[1, 0, 3, 3], bad[2, 1, 0, 0] = float("nan"), float("inf")
    got = reward(bad, PROMPTS)
    assert got[1:].isnan().all()
    torch.testing.assert_close(got[:1], together[:1], atol=1e-5, rtol=1e-5)  # scored alone: another padding
    bf16 = load_reward("hpsv3", _args(proc, new, dtype="bfloat16"))(images, PROMPTS)
    assert (bf16 - together).abs().max() < 0.05 * together.abs().max() + 0.05


def test_hpsv3_text_and_sizes_are_the_packages():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    from solrl_engine.rewards.hpsv3 import INSTRUCTION, SUFFIX, smart_resize, user_text

    assert INSTRUCTION.startswith("\nYou are tasked with evaluating a generated image based on Visual Quality and Text"
                                  " Alignment and give a overall score")  # fmt: skip
    assert INSTRUCTION.endswith("the original description.\nTextual prompt - {text_prompt}\n\n\n")
    # the package's lines that end in spaces (an editor stripping them would change every score)
    assert [ln for ln in INSTRUCTION.split("\n") if ln.endswith(" ")] == [
        ln for ln in INSTRUCTION.split("\n") if ln.startswith(("You are", "**", "- **Safety"))]  # fmt: skip
    assert "**Visual Quality:**  " in INSTRUCTION and "**Text Alignment:**  " in INSTRUCTION
    assert SUFFIX == "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
    assert user_text("a cat").count("a cat") == 1 and user_text("a cat").count("<|Reward|>") == 1
    assert smart_resize(512, 512) == (448, 448) == smart_resize(1024, 1024)
    for h, w in [(512, 768), (720, 1280), (64, 64), (1328, 1328), (480, 832), (33, 500)]:
        mine = smart_resize(h, w)
        assert mine == theirs(h, w, factor=28, min_pixels=256 * 28 * 28, max_pixels=256 * 28 * 28), (h, w)
        assert mine[0] % 28 == 0 and mine[1] % 28 == 0
        assert abs(mine[0] * mine[1] - 256 * 28 * 28) <= 28 * (mine[0] + mine[1]), (h, w, mine)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000)


def test_hpsv3_refuses_what_is_not_its_checkpoint(tmp_path, tiny):
    from safetensors.torch import save_file

    from solrl_engine.rewards.hpsv3 import split_keys

    proc, new, _ = tiny
    with pytest.raises(ValueError, match="not an HPSv3 state dict: keys"):
        split_keys({"text_model.embeddings.token_embedding.weight": torch.zeros(2), "rm_head.0.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="no rm_head"):
        split_keys({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    half = tmp_path / "half.safetensors"  # the head's last layer missing: a strict load names it
    from safetensors.torch import load_file

    save_file({k: v for k, v in load_file(new).items() if not k.startswith("rm_head.5")}, half)
    with pytest.raises(ValueError, match=r"(?s)rm_head is not HPSv3.s.*5\.weight"):
        load_reward("hpsv3", _args(proc, half))
    with pytest.raises(ValueError, match="images must be"):
        load_reward("hpsv3", _args(proc, new))(torch.rand(2, 64, 64), PROMPTS[:2])


def test_hpsv3_missing_files_are_named_before_loading(tmp_path, tiny, monkeypatch):
    import huggingface_hub.constants as c

    proc, new, _ = tiny
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'x.safetensors'}.*HPSv3.safetensors.*hf download "
                                                r"MizzenAI/HPSv3"):  # fmt: skip
        check_reward("hpsv3", {"hpsv3": {"processor": str(proc), "checkpoint": str(tmp_path / "x.safetensors")}})
    with pytest.raises(FileNotFoundError, match="hpsv3 processor.*preprocessor_config.json|hpsv3 processor.*config"):
        check_reward("hpsv3", {"hpsv3": {"processor": str(tmp_path), "checkpoint": str(new)}})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="HPSv3.safetensors of the hub repo MizzenAI/HPSv3.*offline"):
        check_reward("hpsv3", {"hpsv3": {"processor": str(proc)}})
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen2-VL-7B-Instruct.*not in the local Hugging Face cache"):
        check_reward("hpsv3", {"hpsv3": {"checkpoint": str(new)}})
    check_reward("hpsv3", {"hpsv3": {"processor": str(proc), "checkpoint": str(new)}})  # both local: fine
