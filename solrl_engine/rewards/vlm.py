"""`vlm`: a vision-language model as the judge, through an OpenAI-compatible chat endpoint (what vLLM and SGLang
serve: `vllm serve Qwen/Qwen2.5-VL-7B-Instruct`).

Each image goes to the judge with the prompt it was made for, in a template that asks for one number from 0 to
`max_score`; the answer must be that number and nothing else (parsed strictly). The reward is score / max_score,
in [0, 1]. A malformed answer is asked again (`retries` times, the same request); if it stays malformed the image
gets NaN, never a made-up 0: the run's nonfinite_policy then skips or stops, the answer is logged, and
`malformed` counts them. The judge's server is checked at start: it must list `model` at /v1/models.

An edit (a conditioned prompt: an instruction with its source image, solrl_engine/data) goes to the judge as the
source image, then the edit, in `edit_template`, which asks how well the edit follows the instruction while keeping
the rest of the source.

Arguments (reward_args): vlm.url=http://127.0.0.1:8000 (required), vlm.model=NAME (required), vlm.template=...
(with {prompt}), vlm.edit_template=... (with {prompt}), vlm.max_score=10, vlm.retries=2, vlm.timeout_s=120,
vlm.workers=8 (requests in flight). The API key, if the server wants one, comes from the environment variable
named by vlm.api_key_env (OPENAI_API_KEY).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

log = logging.getLogger("solrl_engine.rewards")

TEMPLATE = ("This image was generated for the prompt: \"{prompt}\". Rate how well it matches the prompt and how good "
            "it looks, from 0 (not at all) to {max_score} (perfectly). Answer with the number only.")  # fmt: skip
EDIT_TEMPLATE = ("The first image is a source image; the second is the source edited by the instruction: "
                 "\"{prompt}\". Rate how well the edit follows the instruction while keeping the rest of the source "
                 "unchanged, from 0 (not at all) to {max_score} (perfectly). Answer with the number only.")  # fmt: skip
_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*\.?\s*")


def parse_score(answer: str, max_score: float) -> float | None:
    """The answer's score if it is one number in [0, max_score] and nothing else (a trailing period allowed), else
    None."""
    m = _NUMBER.fullmatch(answer or "")
    if m is None:
        return None
    v = float(m.group(1))
    return v if 0 <= v <= max_score else None


def check_weights(url: str | None = None, model: str | None = None, **_: Any) -> None:
    """The judge needs its server and model named (nothing is loaded here)."""
    if not url or not model:
        raise ValueError("reward 'vlm' needs its judge: reward_args vlm.url=http://HOST:PORT (an OpenAI-compatible "
                         "server: vLLM, SGLang) and vlm.model=NAME (the model it serves)")  # fmt: skip


def _png_data_url(image: torch.Tensor) -> str:
    from PIL import Image

    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _file_data_url(path: Any) -> str:
    """An image file as the judge sees it: 8-bit RGB PNG (whatever the file's own format or mode)."""
    from PIL import Image

    buf = io.BytesIO()
    with Image.open(path) as im:
        im.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class VLMJudge:
    """Callable `(images [B, 3, H, W] in [0, 1], prompts) -> Tensor[B]`: the judge's score / max_score, NaN where
    its answer stayed malformed (see the module docstring)."""

    name = "vlm"

    def __init__(self, url: str | None = None, model: str | None = None, template: str = TEMPLATE,
                 max_score: float = 10.0, retries: int = 2, timeout_s: float = 120.0, workers: int = 8,
                 api_key_env: str = "OPENAI_API_KEY", edit_template: str = EDIT_TEMPLATE) -> None:  # fmt: skip
        check_weights(url, model)
        for key, t in (("template", template), ("edit_template", edit_template)):
            if "{prompt}" not in t:
                raise ValueError(f"reward argument vlm.{key} must hold {{prompt}} (where the image's prompt goes)")
        self.edit_template = edit_template
        if not (max_score > 0 and math.isfinite(max_score)) or retries < 0 or workers < 1:
            raise ValueError("reward arguments: vlm.max_score > 0, vlm.retries >= 0 and vlm.workers >= 1")
        self.url, self.model, self.template = str(url).rstrip("/"), str(model), template
        self.max_score, self.retries, self.timeout_s, self.workers = float(max_score), retries, timeout_s, workers
        self.key = os.environ.get(api_key_env) or None
        self.model_id = f"{self.model} at {self.url}"
        self.malformed = 0  # answers that stayed malformed (their images scored NaN)
        served = [m.get("id") for m in self._get("/v1/models").get("data", [])]
        if self.model not in served:
            raise ValueError(f"the judge's server {self.url} serves {served}, not {self.model!r}: set vlm.model to "
                             "one of them")  # fmt: skip

    def _headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}

    def _get(self, path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=self._headers()),
                                        timeout=self.timeout_s) as r:  # fmt: skip
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ValueError(f"the judge's server {self.url} did not answer {path} ({e}): start it (vllm serve "
                             f"{self.model}) or fix vlm.url") from None  # fmt: skip

    def ask(self, image: torch.Tensor, prompt: str) -> str:
        """The judge's answer for one image (an edit: its source, then the edit, in the editing template)."""
        from solrl_engine.data import prompt_images

        sources = prompt_images(prompt)[:1]
        template = self.edit_template if sources else self.template
        text = template.replace("{prompt}", str(prompt)).replace("{max_score}", f"{self.max_score:g}")
        urls = [_file_data_url(p) for p in sources] + [_png_data_url(image)]
        body = {"model": self.model, "temperature": 0.0, "max_tokens": 16, "messages": [{"role": "user", "content": [
            {"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers=self._headers(), method="POST")  # fmt: skip
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            got = json.loads(r.read())
        try:
            return str(got["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            return json.dumps(got)[:200]  # not a chat completion: malformed, shown as it came

    def score(self, image: torch.Tensor, prompt: str) -> float:
        answer = ""
        for _ in range(self.retries + 1):
            answer = self.ask(image, prompt)
            v = parse_score(answer, self.max_score)
            if v is not None:
                return v / self.max_score
        self.malformed += 1
        log.warning("vlm judge: malformed answer %r for prompt %r after %d tries: the image scores NaN (%d so far)",
                    answer[:200], prompt, self.retries + 1, self.malformed)  # fmt: skip
        return float("nan")

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        with ThreadPoolExecutor(min(self.workers, max(1, len(prompts)))) as pool:
            scores = list(pool.map(self.score, list(images), list(prompts)))
        return torch.tensor(scores, dtype=torch.float32)
