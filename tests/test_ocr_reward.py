"""The `ocr` reward with its real weights (RapidOCR's PP-OCRv4 ONNX models ship in its wheel: nothing downloads):
text rendered with Pillow, scored exact > misspelled > empty; the text comes from the prompt's double quotes;
the bundled prompt sets and presets go with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("rapidocr_onnxruntime", reason="the ocr reward needs rapidocr-onnxruntime (the dev extra)")

from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from solrl_engine.data import load_prompts  # noqa: E402
from solrl_engine.data.shapes import PromptError  # noqa: E402
from solrl_engine.rewards import check_reward, load_reward  # noqa: E402
from solrl_engine.rewards.ocr import edit_distance, target_text, text_reward  # noqa: E402
from solrl_engine.rl import load_config  # noqa: E402


def _render(text: str, size: int = 256) -> torch.Tensor:
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).text((16, 100), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    check_reward("ocr")  # the weights are found (the wheel's), before any model loads
    return load_reward("ocr")


def test_exact_text_scores_above_misspelled_above_none(ocr):
    prompts = ['a shop sign that says "OPEN LATE"'] * 4
    images = torch.stack([_render("OPEN LATE"), _render("OPEM LATF"), _render("CLOSED"), _render("")])
    r = ocr(images, prompts)
    assert r.shape == (4,) and r[0] == 1.0 and r[3] == 0.0
    assert r[0] > r[1] > r[3] and r[1] > r[2]  # two wrong characters of eight cost a quarter
    assert ocr(_render("open late")[None], ['"OPEN LATE"']).item() == 1.0  # case and spaces do not count


def test_the_target_is_the_quoted_text_and_the_score_is_flow_grpos():
    assert target_text('a mug printed with "MONDAY AGAIN" on it, "x"') == "MONDAY AGAIN"
    with pytest.raises(PromptError, match="double quotes"):
        target_text("a mug on a desk")
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert text_reward("xxOPENLATExx", "open late") == 1.0  # the target inside what was read: full marks
    assert text_reward("a" * 40, "open") == 0.0  # unrelated text costs no more than the target's length
    assert text_reward("OPENLAT", "OPEN LATE") == pytest.approx(1 - 1 / 8)


def test_the_bundled_prompt_sets_and_presets_go_with_it(ocr):
    for split in ("train", "test"):
        prompts = load_prompts(f"ocr/{split}")
        assert len(prompts) >= 16
        ocr.check_prompts(prompts)  # every one quotes its text
    with pytest.raises(PromptError, match="has none"):
        ocr.check_prompts(load_prompts("sample/train"))
    cfg = load_config("configs/sana.py:sana_sol_rl_ocr")
    assert (cfg.reward, cfg.train_prompts, cfg.eval_prompts) == ("ocr", "ocr/train", "ocr/test")
