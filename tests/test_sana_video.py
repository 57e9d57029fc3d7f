"""SANA-Video (text-to-video) through the engine, on a tiny random-weight SanaVideoPipeline of the real classes saved
and loaded as a user's weights are: a seed's latent is the one the stock pipeline draws, the engine's sample (the
`dpm2` solver on the pipeline's shift-8 sigmas, classifier-free guidance against the empty prompt encoded as the
pipeline encodes its negative) equals the stock pipeline's, videos decode to [B, F, 3, H, W], the explore copy
takes SANA's rule, every family trains through `solrl train`, and the exported LoRA loads into the stock pipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_pipelines import LATENT_SHAPES, MAX_SEQUENCE_LENGTH, SIZES, WAN_FRAMES, build_sana_video, linear_rows

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample, seeded_noise

PROMPTS = ["a red apple", "a blue car"]
SIDE, TOKENS = SIZES["sana_video"], MAX_SEQUENCE_LENGTH["sana_video"]
OPTS = dict(resolution=SIDE, width=SIDE, frames=WAN_FRAMES, max_sequence_length=TOKENS)


@pytest.fixture(scope="module")
def sv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sana_video(tmp_path_factory.mktemp("sana_video") / "sv")


def _stock(path: Path, dtype: torch.dtype):  # noqa: ANN202 - a diffusers SanaVideoPipeline
    from diffusers import SanaVideoPipeline

    pipe = SanaVideoPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe, prompts: list[str], seeds: list[int], steps: int, guidance: float) -> torch.Tensor:  # noqa: ANN001
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return pipe(prompt=prompts, height=SIDE, width=SIDE, frames=WAN_FRAMES, num_inference_steps=steps,
                guidance_scale=guidance, generator=gens, output_type="pt", max_sequence_length=TOKENS,
                use_resolution_binning=False).frames.float()  # fmt: skip


def test_a_saved_sana_video_pipeline_loads_as_a_video_model(sv):
    m = load_model("sana_video", sv, "cpu", torch.float32, **OPTS)
    assert m.latent_shape == LATENT_SHAPES["sana_video"] and m.vae_factor == 8 and m.integer_timesteps
    cond = m.encode_prompts(PROMPTS)
    assert cond.hidden.shape == (2, TOKENS, 48) and cond.pooled is None and cond.mask.shape == (2, TOKENS)
    video = m.decode(torch.randn(2, *m.latent_shape))
    assert video.shape == (2, WAN_FRAMES, 3, SIDE, SIDE) and 0 <= video.min() and video.max() <= 1
    with pytest.raises(ValueError, match="4k \\+ 1 frames"):
        load_model("sana_video", sv, "cpu", torch.float32, **{**OPTS, "frames": 8})
    with pytest.raises(ValueError, match="multiple of 16"):
        load_model("sana_video", sv, "cpu", torch.float32, **{**OPTS, "width": 72})
    with pytest.raises(ValueError, match="holds a SanaVideoPipeline.*set model=sana_video"):
        load_model("wan", sv, "cpu", torch.float32, **OPTS)


def test_the_negative_prompt_is_encoded_as_the_pipeline_encodes_it(sv):
    """The pipeline prepends its complex human instruction to every prompt and keeps the first and last tokens;
    its negative "" gets neither: the unconditional states are the pipeline's negative ones, not those of ""."""
    m = load_model("sana_video", sv, "cpu", torch.float32, **OPTS)
    pos, pos_mask, neg, neg_mask = m.pipe.encode_prompt(["a red apple"], negative_prompt="", max_sequence_length=TOKENS,
                                                        complex_human_instruction=m._instruction())  # fmt: skip
    assert torch.equal(m.encode_prompts(["a red apple"]).hidden, pos) and torch.equal(m.encode_unconditional().mask,
                                                                                      neg_mask)  # fmt: skip
    torch.testing.assert_close(m.encode_unconditional().hidden, neg, atol=0, rtol=0)
    assert int(neg_mask.sum()) == 1 < int(m.encode_prompts([""]).mask.sum())  # "" with the instruction is longer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_sample_is_the_stock_pipelines_for_the_same_seed(sv, dtype):
    """DPM-Solver++ 2M under guidance 6.0 against the pipeline's negative: the engine's `dpm2` solver with the
    model's guidance and its unconditional states gives the stock pipeline's video (BF16: to BF16 rounding)."""
    m = load_model("sana_video", sv, "cpu", dtype, **OPTS)
    seeds, steps, g = [3, 11], 4, model_spec("sana_video").guidance_scale
    assert g == 6.0
    x = sample(m, m.encode_prompts(PROMPTS), seeds, steps, solver="dpm2", guidance_scale=g,
               uncond=m.encode_unconditional(), dtype=torch.float32)  # fmt: skip
    ours = m.decode(x)
    pipe = _stock(sv, dtype)
    theirs = _call(pipe, PROMPTS, seeds, steps, g)
    noise = pipe.prepare_latents(2, 16, SIDE, SIDE, WAN_FRAMES, torch.float32, "cpu",
                                 [torch.Generator().manual_seed(s) for s in seeds])  # fmt: skip
    assert torch.equal(noise, seeded_noise(seeds, m.latent_shape))  # a seed is the stock pipeline's latent
    # BF16: guidance 6 multiplies the rounding of two BF16 forwards; measured max 0.032, mean 0.0034 (FP32: exact)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
    assert (ours - theirs).abs().mean() < (1e-5 if dtype == torch.float32 else 5e-3)
    if dtype == torch.float32:  # the instruction-prefixed "" as unconditional: another video, as it would be wrong
        wrong = sample(m, m.encode_prompts(PROMPTS), seeds, steps, solver="dpm2", guidance_scale=g,
                       uncond=m.encode_prompts([""]), dtype=torch.float32)  # fmt: skip
        assert (m.decode(wrong) - theirs).abs().max() > 10 * tol


def test_the_explore_copy_takes_sanas_rule(sv):
    """Cross-attention key/value and the FFN's 1x1 convolutions are quantized; the linear self-attention, the
    depthwise and temporal convolutions, the embedders and the output projection stay in BF16."""
    m = load_model("sana_video", sv, "cpu", torch.float32, **OPTS)
    copy = ExploreCopy(m.transformer, "nvfp4", changes=model_spec("sana_video").explore_rule)
    q = set(copy.report.quantized)
    for b in (0, 1):
        assert {f"transformer_blocks.{b}.attn2.to_k", f"transformer_blocks.{b}.attn2.to_v",
                f"transformer_blocks.{b}.ff.conv_inverted", f"transformer_blocks.{b}.ff.conv_point"} <= q  # fmt: skip
    assert not any(".attn1." in n or "conv_depth" in n or "conv_temp" in n for n in q)
    assert all(n.startswith("transformer_blocks.") for n in q)


def test_tokens_per_sample_are_the_video_tokens_the_layers_see(sv):
    m = load_model("sana_video", sv, "cpu", torch.float32, **OPTS)
    _, f, h, w = m.latent_shape
    assert m.tokens_per_sample == f * h * w // 4 and m.tokens_per_sample in linear_rows(m)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_pipelines import build_clip_reward

    return build_clip_reward(tmp_path_factory.mktemp("svclip") / "clip")


def _run(sv: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={sv}", f"resolution={SIDE}", f"width={SIDE}", f"frames={WAN_FRAMES}",
            f"reward_args=clipscore.model={clip}", f"n={n}", "k=2", "prompts_per_iter=2", "iterations=2",
            "preview_steps=1", "full_steps=2", "eval_prompt_count=2", "eval_seeds=1", "eval_every=2", "save_every=2",
            "rollout_batch_size=8", "train_batch_size=2", "lora_rank=4", "lora_alpha=8", "lr=1e-2",
            "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4", "reward_frames=3", *extra]  # fmt: skip
    args = ["train", f"configs/sana_video.py:sana_video_{family}_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def _trained(sv: Path, clip: Path, out: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`solrl train` of `family` for 2 iterations into `out`, its records, grids and clips checked."""
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)  # the compile family samples eagerly here
    assert main(_run(sv, clip, out, family)) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    from PIL import Image

    with Image.open(out / "compare.gif") as gif:
        assert gif.n_frames == WAN_FRAMES  # the clips play, frame by frame
    if family in ("sol_rl", "naive_quant"):
        quant = (out / "quantization.txt").read_text()
        assert "transformer_blocks.0.ff.conv_point" in quant and quant.startswith("quantize_model[nvfp4]")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_a_saved_sana_video_pipeline_through_solrl_train(family, sv, clip, tmp_path,
                                                                                  monkeypatch):  # fmt: skip
    _trained(sv, clip, tmp_path / family, family, monkeypatch)


def test_sol_rl_trains_and_exports_a_lora_the_stock_pipeline_loads_as_the_engine_samples_it(sv, clip, tmp_path,
                                                                                             monkeypatch):  # fmt: skip
    """A sol_rl run through `solrl train` (records, grids, clips, the explore copy's layers); its adapter, loaded by
    SanaVideoPipeline.load_lora_weights, changes the stock pipeline's video, and the stock pipeline with it draws
    what the engine draws with the same adapter for the same seed."""
    from solrl_engine.cli import load_lora_into
    from solrl_engine.rl.export import load_lora

    out = _trained(sv, clip, tmp_path / "run", "sol_rl", monkeypatch)
    pipe = _stock(sv, torch.float32)
    before = _call(pipe, ["a red apple"], [5], 3, 6.0)
    load_lora(pipe, out / "lora")  # checked against its manifest, then pipe.load_lora_weights
    after = _call(pipe, ["a red apple"], [5], 3, 6.0)
    assert (after - before).abs().max() > 1e-4  # the trained adapter changes the stock pipeline's video
    m = load_model("sana_video", sv, "cpu", torch.float32, **OPTS)
    load_lora_into(m.transformer, str(out / "lora"))
    x = sample(m, m.encode_prompts(["a red apple"]), [5], 3, solver="dpm2", guidance_scale=6.0,
               uncond=m.encode_unconditional(), dtype=torch.float32)  # fmt: skip
    torch.testing.assert_close(m.decode(x), after, atol=1e-4, rtol=0)


def test_the_explorer_takes_a_stock_sana_video_pipeline_and_regenerates_clips(sv, clip):
    """Other trainers' path: a stock SanaVideoPipeline (whose clip length is `frames=`, not `num_frames=`), previews
    in NVFP4, the selected seeds regenerated through the stock pipeline at its guidance, scored on frames."""
    from solrl_engine.explore import Explorer
    from solrl_engine.rewards import load_reward

    pipe = _stock(sv, torch.float32)
    reward = load_reward("clipscore", {"clipscore": {"model": str(clip)}})
    ex = Explorer(pipe, reward, n=4, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIDE, width=SIDE,
                  frames=WAN_FRAMES, solver="dpm2", batch_size=4)  # fmt: skip
    sel = ex.select(PROMPTS)
    assert len(sel.seeds) == 2 and sel.noise.shape == (4, *LATENT_SHAPES["sana_video"])
    regen = sel.regenerate(pipe, steps=2, max_sequence_length=TOKENS)
    assert regen.images.shape == (4, WAN_FRAMES, 3, SIDE, SIDE) and regen.rewards.shape == (2, 2)
    assert ex.copy is not None and ex.copy.report.quantized
    uncond = ex.rollouts.uncond()  # the previews' guidance contrasts against the pipeline's negative prompt
    assert uncond is not None and torch.equal(uncond.hidden, ex.model.encode_unconditional().hidden)
    assert not torch.equal(uncond.mask, ex.model.encode_prompts([""]).mask)


def test_another_vae_is_refused_at_load(sv):
    from diffusers import AutoencoderDC

    pipe = _stock(sv, torch.float32)
    pipe.vae = AutoencoderDC(in_channels=3, latent_channels=16, encoder_block_out_channels=(8, 8),
                             decoder_block_out_channels=(8, 8), encoder_block_types=("ResBlock",) * 2,
                             decoder_block_types=("ResBlock",) * 2, encoder_layers_per_block=(1, 1),
                             decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()),
                             decoder_qkv_multiscales=((), ()))  # fmt: skip
    from solrl_engine.models import wrap_pipeline

    with pytest.raises(ValueError, match="decodes with a AutoencoderDC.*Wan2.1 VAE"):
        wrap_pipeline(pipe, width=SIDE, frames=WAN_FRAMES)
