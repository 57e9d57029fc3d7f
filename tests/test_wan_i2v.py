"""Wan image-to-video through the engine, on a tiny random-weight WanImageToVideoPipeline of the real classes (a
CLIP vision tower, a 36-channel transformer with image cross-attention) saved and loaded as a user's weights are,
with the bundled image-to-video prompt set (a motion and a first frame per line): the engine's clip equals the
stock pipeline's for a seed and an image under guidance (the image kept in the unconditional pass), the image
changes the clip, every family trains through `solrl train` with frame-0 consistency as a reward term, and the
exported LoRA loads into the stock pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import LATENT_SHAPES, MAX_SEQUENCE_LENGTH, SIZES, WAN_FRAMES, build_clip_reward, build_wan_i2v
from trained import stock_pipeline_draws_the_lora, two_iterations

from solrl_engine.data import load_prompts
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample

SIDE, TOKENS = SIZES["wan"], MAX_SEQUENCE_LENGTH["wan"]
OPTS = dict(resolution=SIDE, width=SIDE, frames=WAN_FRAMES, max_sequence_length=TOKENS)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wan_i2v(tmp_path_factory.mktemp("wan_i2v") / "wi")


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("wiclip") / "clip")


def _stock(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _clip(pipe: Any, prompt: Any, seed: int, steps: int, guidance: float = 5.0) -> torch.Tensor:
    return pipe(image=prompt.open_images()[0], prompt=str(prompt), height=SIDE, width=SIDE, num_frames=WAN_FRAMES,
                num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
                output_type="pt", max_sequence_length=TOKENS).frames.float()  # fmt: skip


def test_the_engines_clip_is_the_stock_pipelines_for_a_seed_and_an_image(wi):
    """UniPC under guidance 5.0: the unconditional pass keeps the image's condition channels and CLIP states, as the
    pipeline's does; FP32 equal to 1e-5 (1.7e-6 measured). Without the image the clip differs."""
    prompts = load_prompts("i2v/train")[:2]
    m = load_model("wan_i2v", wi, "cpu", torch.float32, **OPTS)
    assert m.latent_shape == LATENT_SHAPES["wan"] and model_spec("wan_i2v").conditioned
    cond = m.encode_prompts(prompts)
    assert cond.image.shape == (2, 20, *LATENT_SHAPES["wan"][1:]) and cond.image_states.shape == (2, 17, 16)
    uncond = m.encode_unconditional()
    assert uncond.image is None and uncond.against(cond).image is cond.image
    x = sample(m, cond, [3, 11], 3, solver="unipc", guidance_scale=5.0, uncond=uncond, dtype=torch.float32)
    ours = m.decode(x)
    pipe = _stock(wi)
    theirs = torch.cat([_clip(pipe, p, s, 3) for p, s in zip(prompts, [3, 11], strict=True)])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    blind = type(cond)(cond.hidden, None, None, torch.zeros_like(cond.image), cond.image_states)
    other = m.decode(sample(m, blind, [3, 11], 3, solver="unipc", guidance_scale=5.0, uncond=uncond))
    assert (other - ours).abs().max() > 1e-3


def test_a_pipeline_that_writes_the_first_frame_into_the_latent_is_refused(wi):
    pipe = _stock(wi)
    pipe.register_to_config(expand_timesteps=True)
    from solrl_engine.models import wrap_pipeline

    with pytest.raises(ValueError, match="expand_timesteps.*does not sample yet"):
        wrap_pipeline(pipe, width=SIDE, frames=WAN_FRAMES)


def _train_args(wi: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={wi}", f"resolution={SIDE}", f"width={SIDE}", f"frames={WAN_FRAMES}",
            f"reward_args=clipscore.model={clip}", "reward=clipscore:1.0,preserve:0.5", f"n={n}", "k=2",
            "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2", "eval_prompt_count=2",
            "eval_seeds=1", "eval_every=2", "save_every=2", "rollout_batch_size=8", "train_batch_size=2",
            "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4",
            "reward_frames=3", *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/wan.py:wan_i2v14b_{family}_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_starts_clips_from_images_and_exports_a_lora_the_stock_pipeline_loads(wi, clip, tmp_path,
                                                                                           monkeypatch):  # fmt: skip
    """Two sol_rl iterations on the bundled image-to-video set, scored on frames by CLIPScore and on the first
    frame's consistency with the image (preserve); the adapter, loaded by WanImageToVideoPipeline.load_lora_weights,
    draws what the engine draws with it."""
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train_args(wi, clip, out, "sol_rl", "save_every=1")) == 0
    recs = two_iterations(out)
    assert "heldout_reward" in recs[-1] and "reward_preserve_mean" in recs[-1]
    prompt = load_prompts("i2v/test")[0]
    pipe = _stock(wi)

    def draw(m: Any) -> torch.Tensor:
        return m.decode(sample(m, m.encode_prompts([prompt]), [5], 3, solver="unipc", guidance_scale=5.0,
                               uncond=m.encode_unconditional(), dtype=torch.float32))  # fmt: skip

    stock_pipeline_draws_the_lora(pipe, lambda: _clip(pipe, prompt, 5, 3),
                                  load_model("wan_i2v", wi, "cpu", torch.float32, **OPTS), out / "lora", draw)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_image_to_video(family, wi, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / family
    assert main(_train_args(wi, clip, out, family)) == 0
    two_iterations(out)


def test_text_prompts_are_refused_before_any_weights_load(wi, clip, tmp_path, monkeypatch):
    from solrl_engine import models
    from solrl_engine.cli import main

    monkeypatch.setattr(models.ModelSpec, "build", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(SystemExit, match="train_prompts='sample/train': model=wan_i2v takes an image per prompt"):
        main(_train_args(wi, clip, tmp_path / "a", "sol_rl", "train_prompts=sample/train"))


def test_the_explorer_regenerates_conditioned_prompts_through_the_stock_pipeline(wi, clip):
    """Other trainers' path with an image-to-video set: previews in NVFP4, then the selected seeds regenerated by
    the stock WanImageToVideoPipeline, each prompt's image passed with its seeds: each clip is what the pipeline
    draws for that image and seed called alone."""
    from solrl_engine.explore import Explorer
    from solrl_engine.rewards import load_reward

    prompts = load_prompts("i2v/train")[:2]
    pipe = _stock(wi)
    reward = load_reward("clipscore:1.0,preserve:0.5", {"clipscore": {"model": str(clip)}})
    ex = Explorer(pipe, reward, n=3, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIDE, width=SIDE,
                  frames=WAN_FRAMES, solver="unipc", batch_size=4)  # fmt: skip
    sel = ex.select(prompts)
    regen = sel.regenerate(pipe, steps=2, batch_size=4, max_sequence_length=TOKENS)
    assert regen.images.shape == (4, WAN_FRAMES, 3, SIDE, SIDE) and regen.rewards.shape == (2, 2)
    for row, (prompt, seed) in enumerate([(p, s) for p, seeds in zip(prompts, sel.seeds, strict=True) for s in seeds]):
        torch.testing.assert_close(regen.images[row : row + 1], _clip(pipe, prompt, seed, 2), atol=1e-5, rtol=0)
