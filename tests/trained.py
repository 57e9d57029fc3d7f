"""Checks of a finished tiny training run, shared by the conditioned families' tests (FLUX.1 Kontext, the Qwen
editors, Wan I2V): its metrics, and its exported LoRA loaded by the stock pipeline."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from solrl_engine.cli import load_lora_into
from solrl_engine.sampling.sampler import sample


def two_iterations(out: Path) -> list[dict]:
    """The run's metrics: two iterations, finite losses."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    return recs


def stock_pipeline_draws_the_lora(pipe: Any, stock: Callable[[], torch.Tensor], model: Any, lora: Path,
                                  draw: Callable[[Any], torch.Tensor]) -> None:  # fmt: skip
    """`pipe.load_lora_weights(lora)` changes what the stock pipeline draws (`stock()`), and the engine's model with
    the same adapter (`load_lora_into`) draws that (`draw(model)`, to 1e-5)."""
    before = stock()
    pipe.load_lora_weights(str(lora))
    after = stock()
    assert (after - before).abs().max() > 1e-4  # the trained adapter changes the stock pipeline's output
    load_lora_into(model.transformer, str(lora))
    torch.testing.assert_close(draw(model), after, atol=1e-5, rtol=0)


def euler(prompt: Any, seed: int = 5, steps: int = 3) -> Callable[[Any], torch.Tensor]:
    """What the engine draws for `prompt` and `seed` in `steps` Euler steps, decoded: a `draw` for the check above."""
    return lambda m: m.decode(sample(m, m.encode_prompts([prompt]), [seed], steps, solver="euler"))
