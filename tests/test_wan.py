"""Wan (text-to-video) through the engine, on a tiny random-weight WanPipeline of the real classes saved and
loaded as a user's weights are: the latent a seed gives is the one the stock pipeline draws, the engine's
sample (the `unipc` solver, classifier-free guidance against the empty prompt) equals the stock pipeline's for
the same seed, videos decode to [B, F, 3, H, W], and the explore copy quantizes the blocks' linears."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_pipelines import LATENT_SHAPES, MAX_SEQUENCE_LENGTH, SIZES, WAN_FRAMES, build_wan, linear_rows

from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample, seeded_noise

PROMPTS = ["a red apple", "a blue car"]
OPTS = dict(resolution=SIZES["wan"], width=SIZES["wan"], frames=WAN_FRAMES,
            max_sequence_length=MAX_SEQUENCE_LENGTH["wan"])


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wan(tmp_path_factory.mktemp("wan") / "wan")


def _stock(path: Path, dtype: torch.dtype):  # noqa: ANN202 - a diffusers WanPipeline
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_a_saved_wan_pipeline_loads_as_a_video_model(wan):
    m = load_model("wan", wan, "cpu", torch.float32, **OPTS)
    assert m.latent_shape == LATENT_SHAPES["wan"] and m.vae_factor == 8 and m.integer_timesteps
    cond = m.encode_prompts(PROMPTS)
    assert cond.hidden.shape == (2, MAX_SEQUENCE_LENGTH["wan"], 32) and cond.pooled is None and cond.mask is None
    video = m.decode(torch.randn(2, *m.latent_shape))
    assert video.shape == (2, WAN_FRAMES, 3, SIZES["wan"], SIZES["wan"]) and 0 <= video.min() and video.max() <= 1
    with pytest.raises(ValueError, match="4k \\+ 1 frames"):
        load_model("wan", wan, "cpu", torch.float32, **{**OPTS, "frames": 8})
    with pytest.raises(ValueError, match="multiple of 16"):
        load_model("wan", wan, "cpu", torch.float32, **{**OPTS, "width": 72})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_sample_is_the_stock_pipelines_for_the_same_seed(wan, dtype):
    """The stock pipeline draws its latents from one seeded CPU generator per video, as `seeded_noise` does,
    and samples with UniPC under classifier-free guidance against the empty prompt: the engine's `unipc`
    solver with the model's own guidance gives the same video (BF16: to BF16 rounding)."""
    m = load_model("wan", wan, "cpu", dtype, **OPTS)
    seeds, steps, g = [3, 11], 4, model_spec("wan").guidance_scale
    x = sample(m, m.encode_prompts(PROMPTS), seeds, steps, solver="unipc", guidance_scale=g,
               uncond=m.encode_prompts([""]), dtype=torch.float32)  # fmt: skip
    ours = m.decode(x)
    pipe = _stock(wan, dtype)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    theirs = pipe(prompt=PROMPTS, height=SIZES["wan"], width=SIZES["wan"], num_frames=WAN_FRAMES,
                  num_inference_steps=steps, guidance_scale=g, generator=gens, output_type="pt",
                  max_sequence_length=MAX_SEQUENCE_LENGTH["wan"]).frames  # fmt: skip
    noise = pipe.prepare_latents(2, 16, SIZES["wan"], SIZES["wan"], WAN_FRAMES, torch.float32, "cpu",
                                 [torch.Generator().manual_seed(s) for s in seeds])  # fmt: skip
    assert torch.equal(noise, seeded_noise(seeds, m.latent_shape))  # a seed is the stock pipeline's latent
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours, theirs.float(), atol=tol, rtol=0)
    other = sample(m, m.encode_prompts(PROMPTS), [4, 12], steps, solver="unipc", guidance_scale=g,
                   uncond=m.encode_prompts([""]), dtype=torch.float32)  # fmt: skip
    assert (m.decode(other) - theirs.float()).abs().max() > 10 * tol  # other seeds: another video


def test_the_explore_copy_quantizes_the_blocks_linears(wan):
    m = load_model("wan", wan, "cpu", torch.float32, **OPTS)
    copy = ExploreCopy(m.transformer, "nvfp4", changes=model_spec("wan").explore_rule)
    q = set(copy.report.quantized)
    assert q and all(n.startswith("blocks.") for n in q)
    assert {"blocks.0.attn1.to_q", "blocks.0.ffn.net.2", "blocks.1.attn2.to_out.0"} <= q
    assert not any("condition_embedder" in n or n == "proj_out" for n in q)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_pipelines import build_clip_reward

    return build_clip_reward(tmp_path_factory.mktemp("wanclip") / "clip")


def _run(wan: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={wan}", f"resolution={SIZES['wan']}", f"width={SIZES['wan']}", f"frames={WAN_FRAMES}",
            f"reward_args=clipscore.model={clip}", f"n={n}", "k=2", "prompts_per_iter=2", "iterations=2",
            "preview_steps=1", "full_steps=2", "eval_prompt_count=2", "eval_seeds=1", "eval_every=2", "save_every=2",
            "rollout_batch_size=8", "train_batch_size=2", "lora_rank=4", "lora_alpha=8", "lr=1e-2",
            "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4", "reward_frames=3", *extra]  # fmt: skip
    args = ["train", f"configs/wan.py:wan13b_{family}_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sol_rl", "naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_family_trains_a_saved_wan_pipeline_through_solrl_train(family, wan, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)  # the compile family samples eagerly here
    out = tmp_path / family
    extra = ("log_with=tensorboard",) if family == "sol_rl" else ()
    assert main(_run(wan, clip, out, family, *extra)) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    assert (out / "compare.png").exists() and (out / "compare.gif").exists()
    from PIL import Image

    with Image.open(out / "compare.gif") as gif:
        assert gif.n_frames == WAN_FRAMES  # the clips play, frame by frame
    if family == "sol_rl":  # the tracker gets the clips as they play: compare.gif's bytes, as TensorBoard shows them
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0}).Reload()
        played = events.Images("eval/compare_video")
        assert [e.step for e in played] == [2] and played[0].encoded_image_string == (out / "compare.gif").read_bytes()
    if family in ("sol_rl", "naive_quant"):
        quant = (out / "quantization.txt").read_text()
        assert "blocks.0.ffn.net.2" in quant and quant.startswith("quantize_model[nvfp4]")


def test_the_exported_lora_loads_into_the_stock_wan_pipeline_as_the_engine_samples_it(wan, clip, tmp_path,
                                                                                        monkeypatch):  # fmt: skip
    """A sol_rl run's adapter, loaded by WanPipeline.load_lora_weights, changes the stock pipeline's video, and
    the stock pipeline with it draws what the engine draws with the same adapter for the same seed."""
    from solrl_engine import hw
    from solrl_engine.cli import load_lora_into, main
    from solrl_engine.rl.export import load_lora

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_run(wan, clip, out, "sol_rl", "iterations=1", "eval_every=5", "save_every=1")) == 0
    pipe = _stock(wan, torch.float32)
    kw = dict(height=SIZES["wan"], width=SIZES["wan"], num_frames=WAN_FRAMES, num_inference_steps=3,
              guidance_scale=5.0, output_type="pt", max_sequence_length=MAX_SEQUENCE_LENGTH["wan"])  # fmt: skip
    before = pipe(prompt=["a red apple"], generator=[torch.Generator().manual_seed(5)], **kw).frames
    load_lora(pipe, out / "lora")  # checked against its manifest, then pipe.load_lora_weights
    after = pipe(prompt=["a red apple"], generator=[torch.Generator().manual_seed(5)], **kw).frames
    assert (after - before).abs().max() > 1e-4  # the trained adapter changes the stock pipeline's video
    m = load_model("wan", wan, "cpu", torch.float32, **OPTS)
    load_lora_into(m.transformer, str(out / "lora"))
    x = sample(m, m.encode_prompts(["a red apple"]), [5], 3, solver="unipc", guidance_scale=5.0,
               uncond=m.encode_prompts([""]), dtype=torch.float32)  # fmt: skip
    torch.testing.assert_close(m.decode(x), after.float(), atol=1e-4, rtol=0)


def test_the_explorer_takes_a_stock_wan_pipeline_and_regenerates_clips(wan, clip):
    """Other trainers' path: a stock WanPipeline with its clip length and width, previews in NVFP4, the selected
    seeds regenerated through the stock pipeline, scored on frames by the weighted reward."""
    from solrl_engine.explore import Explorer
    from solrl_engine.rewards import load_reward

    pipe = _stock(wan, torch.float32)
    reward = load_reward("clipscore:1.0,temporal:0.2", {"clipscore": {"model": str(clip)}})
    ex = Explorer(pipe, reward, n=4, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZES["wan"],
                  width=SIZES["wan"], frames=WAN_FRAMES, solver="unipc", batch_size=4)  # fmt: skip
    sel = ex.select(PROMPTS)
    assert len(sel.seeds) == 2 and all(len(s) == 2 for s in sel.seeds)
    assert sel.noise.shape == (4, *LATENT_SHAPES["wan"])
    regen = sel.regenerate(pipe, steps=2, max_sequence_length=512)
    assert regen.images.shape == (4, WAN_FRAMES, 3, SIZES["wan"], SIZES["wan"]) and regen.rewards.shape == (2, 2)
    assert set(reward.last_components) == {"clipscore", "temporal"}
    assert ex.copy is not None and ex.copy.report.quantized


def test_each_prompt_is_encoded_once_and_the_text_encoder_leaves_the_device(wan):
    """UMT5-XXL is 5.7B parameters: a prompt's embeddings are cached after its first encode, and with offload
    the encoder is on the CPU whenever it is not encoding."""
    m = load_model("wan", wan, "cpu", torch.float32, offload_text_encoders=True, **OPTS)
    enc, calls, moves = m.pipe.text_encoder, [], []
    enc.register_forward_hook(lambda *a: calls.append(1))
    to = enc.to
    enc.to = lambda *a, **k: (moves.append(str(a[0] if a else k.get("device"))), to(*a, **k))[1]
    first = m.encode_prompts(PROMPTS)
    again = m.encode_prompts(PROMPTS + PROMPTS[:1])
    assert len(calls) == 1 and torch.equal(again.hidden[:2], first.hidden)
    assert moves == [str(m.device_), "cpu"]  # onto the device for the one encode, back to the CPU after it


def test_fp8_attention_runs_in_the_explore_copy_only_and_can_be_undone(wan, monkeypatch):
    """explore_attention=fp8: every attention call of the copy's forward (self and cross, each block) runs the FP8
    attention op (its reference on a CPU, counted here as the calls happen); the policy's forward never does; bf16
    restores the copy's own forward bit for bit, and an exception inside the forward leaves no mode behind."""
    from solrl_engine.quant import fp8 as fp8_numerics

    m = load_model("wan", wan, "cpu", torch.float32, **OPTS)
    copy = ExploreCopy(m.transformer, "nvfp4", changes=model_spec("wan").explore_rule)
    attended: list[tuple[int, ...]] = []
    reference = fp8_numerics.attention

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                 key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        attended.append(tuple(q.shape))
        return reference(q, k, v, scale, key_bias)

    monkeypatch.setattr(fp8_numerics, "attention", counting)  # the op's reference, counted
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, *LATENT_SHAPES["wan"], generator=g)
    enc = m.encode_prompts(PROMPTS)
    t = torch.full((2,), 500.0)

    def run(module: torch.nn.Module) -> torch.Tensor:
        return module(hidden_states=x, timestep=t, encoder_hidden_states=enc.hidden, return_dict=False)[0]

    with torch.no_grad():
        plain = run(copy.transformer)
        copy.set_attention("fp8")
        fp8 = run(copy.transformer)
        calls = len(attended)
        policy = run(m.transformer)
        assert len(attended) == calls  # the policy's attention never runs in FP8
        copy.set_attention("bf16")
        again = run(copy.transformer)
    blocks = len(m.transformer.blocks)
    assert calls == 2 * blocks  # attn1 and attn2 in every block
    assert torch.equal(again, plain) and len(attended) == calls
    err = (fp8 - plain).norm() / plain.norm()
    assert 0 < err < 0.1, err  # E4M3 q, k, v and P: a percent-level change, not a different model
    assert not torch.equal(policy, plain)  # (the copy is NVFP4; the policy is not)

    copy.set_attention("fp8")
    with pytest.raises(TypeError), torch.no_grad():
        copy.transformer(hidden_states=x, timestep=t)  # no encoder_hidden_states: fails inside the forward
    from torch.overrides import _get_current_function_mode_stack

    assert _get_current_function_mode_stack() == []
    with pytest.raises(ValueError, match="choose one of.*bf16.*fp8"):
        copy.set_attention("fp4")


def test_explore_attention_is_checked_and_reaches_the_trainers_copy(wan, clip):
    from solrl_engine.rl.config import ConfigError, RLConfig
    from solrl_engine.rl.runtime import explorer_for

    base = dict(model="wan", model_path=str(wan), resolution=SIZES["wan"], width=SIZES["wan"], frames=WAN_FRAMES,
                device="cpu", n=4, k=2, preview_steps=1, full_steps=2, explore_precision="nvfp4",
                reward="clipscore", reward_args=(f"clipscore.model={clip}",))  # fmt: skip
    with pytest.raises(ConfigError, match="explore_attention.*choose bf16"):
        RLConfig(**base, explore_attention="fp16").validate()
    with pytest.raises(ConfigError, match="explore_attention.*naive_quant or sol_rl"):
        RLConfig(**{**base, "family": "naive_scaling"}, explore_attention="fp8").validate()
    cfg = RLConfig(**base, explore_attention="fp8").validate()
    ex = explorer_for(cfg)
    assert ex.copy is not None and ex.copy.attention == "fp8" and ex.spec.attention == "fp8"
    from solrl_engine.rl.fidelity import fidelity

    res = fidelity(cfg, prompts=1, n=2, k=2, progress=False)  # solrl fidelity too, saying what the attention ran
    assert res["explore_attention"] == "fp8" and res["attention_ran"] == "reference"  # (a CPU: the op's reference)
    with pytest.raises(ValueError, match=r"quantize\['attention'\].*choose a quantized"):
        from solrl_engine.explore import Explorer

        Explorer(_stock(wan, torch.float32), lambda im, p: im.mean((1, 2, 3, 4)), n=4, k=2,
                 explore_precision="bf16", quantize={"attention": "fp8"})  # fmt: skip


def test_tokens_per_sample_are_the_video_tokens_the_layers_see(wan):
    """Wan patches (1, 2, 2): explore_precision=auto's probe rows (Rollouts.forward_rows) per clip are
    frames x h/2 x w/2, one of the row counts its linear layers see (hooks)."""
    m = load_model("wan", wan, "cpu", torch.float32, **OPTS)
    _, f, h, w = m.latent_shape
    assert m.tokens_per_sample == f * h * w // 4 and m.tokens_per_sample in linear_rows(m)
