"""`ocr`: text rendering, as Flow-GRPO's OCR task scores it.

Each prompt names the text to render between its first pair of double quotes (`a shop sign that says "OPEN
LATE"`). An OCR model reads the image; both texts are lowercased with their spaces removed; the reward is
1 - edit distance / target length, in [0, 1]: 1 where the image's text holds the target, and a wrong or missing
character costs one character's share (the distance is capped at the target's length, so unrelated text read
beside it costs no more than nothing read at all).

The OCR model is RapidOCR's ONNX port of PaddleOCR's PP-OCRv4 detection and recognition (`rapidocr-onnxruntime`,
whose wheel ships the weights, so it runs offline, on the CPU, in CI). Flow-GRPO reads with PaddleOCR itself;
the same models in another runtime, so scores may differ slightly from the official ones.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from solrl_engine.data.shapes import PromptError

_QUOTED = re.compile(r'"([^"]*)"')


def target_text(prompt: str) -> str:
    """The text between the prompt's first pair of double quotes; PromptError where it has none."""
    m = _QUOTED.search(prompt)
    if m is None or not m.group(1).strip():
        raise PromptError(f'the ocr reward scores the text between double quotes; prompt {prompt!r} has none: write '
                          'it as: a sign that says "OPEN"')  # fmt: skip
    return m.group(1)


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def text_reward(read: str, target: str) -> float:
    """1 - min(edit distance, len) / len of the normalised texts; 1.0 where the text read contains the target."""
    read, target = normalise(read), normalise(target)
    if not target:
        return 0.0
    dist = 0 if target in read else min(edit_distance(read, target), len(target))
    return 1.0 - dist / len(target)


def check_weights(**_: Any) -> None:
    """RapidOCR and its bundled ONNX weights import (nothing is downloaded)."""
    import rapidocr_onnxruntime  # noqa: F401 - an ImportError names the extra (rewards._needs_packages)


class OCRReward:
    """Callable `(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]` in [0, 1]; `min_confidence`: recognised
    pieces below it are dropped (Flow-GRPO keeps any above 0)."""

    name = "ocr"
    model_id = "RapidOCR PP-OCRv4 (rapidocr-onnxruntime)"

    def __init__(self, min_confidence: float = 0.0) -> None:
        check_weights()
        from rapidocr_onnxruntime import RapidOCR

        # Flow-GRPO reads without the angle classifier; every recognised piece is returned (text_score 0)
        self.engine = RapidOCR(use_cls=False, text_score=0.0)
        self.min_confidence = min_confidence

    def read(self, image: torch.Tensor) -> str:
        """The text the OCR model reads in one image [3, H, W] in [0, 1], pieces in reading order joined."""
        arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        result, _ = self.engine(arr[:, :, ::-1].copy())  # RGB -> BGR, as OpenCV images are
        return "".join(text for _box, text, conf in (result or []) if float(conf) > self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        targets = [target_text(p) for p in prompts]
        return torch.tensor([text_reward(self.read(img), t) for img, t in zip(images, targets, strict=True)])

    def check_prompts(self, prompts: list[str]) -> None:
        """Every prompt names its text in double quotes (PromptError naming the first that does not)."""
        for p in dict.fromkeys(prompts):
            target_text(p)
