"""Wan2.2-A14B's two experts through the engine, on a tiny random-weight WanPipeline of the real classes with a
`transformer_2` of its own weights and the published boundary_ratio 0.875, saved and loaded as a user's weights
are: the engine's clip is the stock pipeline's for a seed (both experts run, each at the pipeline's timesteps), rows
on both sides of the boundary run their own expert, `solrl train` quantizes and trains both (or the one
`lora_experts` names), and the exported adapter loads into the stock pipeline's two experts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_pipelines import MAX_SEQUENCE_LENGTH, SIZES, WAN_FRAMES, build_wan

from solrl_engine.models import load_model
from solrl_engine.sampling.sampler import sample

PROMPTS = ["a red apple", "a blue car"]
SIDE, TOKENS = SIZES["wan"], MAX_SEQUENCE_LENGTH["wan"]
OPTS = dict(resolution=SIDE, width=SIDE, frames=WAN_FRAMES, max_sequence_length=TOKENS)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wan22(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wan(tmp_path_factory.mktemp("wan22") / "wan", two_experts=True)


def _stock(path: Path):  # noqa: ANN202 - a diffusers WanPipeline
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _clips(pipe, prompts: list[str], seeds: list[int], steps: int) -> torch.Tensor:  # noqa: ANN001
    return pipe(prompt=prompts, generator=[torch.Generator().manual_seed(s) for s in seeds], height=SIDE, width=SIDE,
                num_frames=WAN_FRAMES, num_inference_steps=steps, guidance_scale=5.0, output_type="pt",
                max_sequence_length=TOKENS).frames.float()  # fmt: skip


def _engine(m, prompts: list[str], seeds: list[int], steps: int, **kw) -> torch.Tensor:  # noqa: ANN001, ANN003
    x = sample(m, m.encode_prompts(prompts), seeds, steps, solver="unipc", guidance_scale=5.0,
               uncond=m.encode_prompts([""]), dtype=torch.float32, **kw)  # fmt: skip
    return m.decode(x)


def test_the_engines_clip_is_the_stock_pipelines_with_both_experts(wan22):
    """4 UniPC steps at timesteps 1000, 900 (the high-noise expert, >= 875) and 750, 501 (the low-noise one): FP32
    equal to 1e-5 (1.4e-6 measured); sampling with the first expert alone, what the engine did before, is 0.43 off."""
    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    experts = m.transformer.experts()
    assert m.transformer.boundary == 875.0 and m.transformer.capturable is False
    calls = dict.fromkeys(experts, 0)
    for name, e in experts.items():
        e.register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    ours = _engine(m, PROMPTS, [3, 11], 4)
    assert calls == {"transformer": 4, "transformer_2": 4}  # two steps each, conditional and unconditional passes
    theirs = _clips(_stock(wan22), PROMPTS, [3, 11], 4)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    first_only = _engine(m, PROMPTS, [3, 11], 4, transformer=experts["transformer"])
    assert (first_only - theirs).abs().max() > 0.1


def test_rows_on_both_sides_of_the_boundary_run_their_own_expert(wan22):
    """The update's batches mix timesteps: each row's output is its own expert's, as if called alone."""
    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    net, e = m.transformer, m.transformer.experts()
    x = torch.randn(3, *m.latent_shape)
    ts = torch.tensor([950.0, 500.0, 875.0])  # high, low, high (the boundary itself is the high-noise expert's)
    text = m.encode_prompts(["a", "b", "c"]).hidden
    got = net(hidden_states=x, timestep=ts, encoder_hidden_states=text, return_dict=False)[0]
    for i, name in enumerate(["transformer", "transformer_2", "transformer"]):
        alone = e[name](hidden_states=x[i : i + 1], timestep=ts[i : i + 1], encoder_hidden_states=text[i : i + 1],
                        return_dict=False)[0]  # fmt: skip
        torch.testing.assert_close(got[i : i + 1], alone, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_pipelines import build_clip_reward

    return build_clip_reward(tmp_path_factory.mktemp("wan22clip") / "clip")


def _train(wan22: Path, clip: Path, out: Path, *extra: str) -> list[str]:
    sets = [f"model_path={wan22}", f"resolution={SIDE}", f"width={SIDE}", f"frames={WAN_FRAMES}",
            f"reward_args=clipscore.model={clip}", "n=4", "k=2", "prompts_per_iter=2", "iterations=1",
            "preview_steps=1", "full_steps=2", "eval_prompt_count=2", "eval_seeds=1", "eval_every=5", "save_every=1",
            "rollout_batch_size=8", "train_batch_size=2", "lora_rank=4", "lora_alpha=8", "lr=1e-2",
            "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4", "reward_frames=3", *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/wan.py:wan13b_sol_rl_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_trains_both_experts_and_the_stock_pipeline_loads_them(wan22, clip, tmp_path, monkeypatch):
    """A sol_rl iteration (each expert guided at its own scale): the explore copy quantizes both experts' blocks, the
    adapter is one file per expert, and the stock pipeline with both loaded (load_lora_weights, then with
    load_into_transformer_2) draws what the engine draws with the same adapter."""
    from solrl_engine import hw
    from solrl_engine.cli import load_lora_into, main
    from solrl_engine.rl.export import adapter_files, load_lora

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train(wan22, clip, out, "guidance_scale_2=3.0")) == 0  # (the high-noise expert's: wan's 5.0)
    assert json.loads((out / "config.json").read_text())["guidance_scale_2"] == 3.0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in recs] == [1] and math.isfinite(recs[0]["loss"])
    quant = (out / "quantization.txt").read_text()
    assert "transformer.blocks.0.ffn.net.2" in quant and "transformer_2.blocks.1.ffn.net.2" in quant
    assert set(adapter_files(out / "lora")) == {"transformer", "transformer_2"}
    pipe = _stock(wan22)
    before = _clips(pipe, PROMPTS[:1], [5], 3)
    load_lora(pipe, out / "lora")  # checked against its manifest, then each file into its expert
    after = _clips(pipe, PROMPTS[:1], [5], 3)
    assert (after - before).abs().max() > 1e-4
    for expert in ("transformer", "transformer_2"):
        assert any("lora_A" in n for n, _ in getattr(pipe, expert).named_parameters())
    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    load_lora_into(m.transformer, str(out / "lora"))
    torch.testing.assert_close(_engine(m, PROMPTS[:1], [5], 3), after, atol=1e-4, rtol=0)
    one = load_model("wan", build_wan(tmp_path / "one"), "cpu", torch.float32, **OPTS)
    with pytest.raises(ValueError, match="trained on a two-expert model.*has one transformer"):
        load_lora_into(one.transformer, str(out / "lora"))


def test_lora_experts_low_puts_the_adapter_on_the_low_noise_expert_only(wan22, tmp_path):
    from solrl_engine.rl.adapters import LoraAdapters
    from solrl_engine.rl.export import adapter_files, save_lora

    m = load_model("wan", wan22, "cpu", torch.float32, lora_experts="low", **OPTS)
    lora = LoraAdapters(m.transformer, 4, 8, ("to_q", "to_k", "to_v", "to_out.0"))
    assert lora.layers and all(n.startswith("transformer_2.blocks.") for n in lora.layers)
    assert not any("lora_" in n for n, _ in m.transformer.experts()["transformer"].named_parameters())
    assert set(adapter_files(save_lora(lora, tmp_path / "lora", "WanPipeline"))) == {"transformer_2"}


def test_expert_choices_are_refused_where_there_are_no_experts(wan22, tmp_path):
    from solrl_engine.rl.config import RLConfig

    with pytest.raises(ValueError, match="lora_experts='high': this pipeline has one transformer"):
        load_model("wan", build_wan(tmp_path / "one"), "cpu", torch.float32, lora_experts="high", **OPTS)
    with pytest.raises(ValueError, match="lora_experts.*applies to two-expert models .*'sd3' has one transformer"):
        RLConfig(model="sd3", lora_experts="low").validate()
    with pytest.raises(ValueError, match="lora_experts.*choose one of"):
        RLConfig(model="wan", lora_experts="middle").validate()
    with pytest.raises(ValueError, match="lora_experts.*holds one transformer .*model_index.json"):
        RLConfig(model="wan", model_path=str(build_wan(tmp_path / "one2")), lora_experts="low").validate()
    RLConfig(model="wan", model_path=str(wan22), lora_experts="low").validate()  # two experts: taken
    with pytest.raises(ValueError, match="lora_experts.*train_mode=full trains every weight"):
        RLConfig(model="wan", lora_experts="low", train_mode="full", family="naive_scaling").validate()


def test_the_memory_plan_counts_both_experts_and_the_lora_on_those_trained(wan22, tmp_path):
    """From the saved pipeline's model_index.json (transformer_2 and boundary_ratio): both experts' weights, and LoRA
    on the experts lora_experts names; a published hub id's experts come from the family's HUB_EXPERTS."""
    from solrl_engine.rl import memplan
    from solrl_engine.rl.config import RLConfig

    def plan(path: Path, **kw: str):  # noqa: ANN202 - a MemoryPlan
        cfg = RLConfig(name="w", model="wan", model_path=str(path), resolution=SIDE, width=SIDE, frames=WAN_FRAMES,
                       train_batch_size=1, rollout_batch_size=2, **kw)  # fmt: skip
        return memplan.memory_plan(cfg)

    one, two, low = plan(build_wan(tmp_path / "one")), plan(wan22), plan(wan22, lora_experts="low")
    assert two.transformer_params_b == pytest.approx(2 * one.transformer_params_b)
    assert "two experts (boundary_ratio 0.875)" in two.transformer_source
    rows = [{r.part: r.gib for r in p.rows} for p in (one, two, low)]
    assert rows[1]["trained weights"] == pytest.approx(2 * rows[0]["trained weights"])  # LoRA on both experts
    assert rows[2]["trained weights"] == pytest.approx(rows[0]["trained weights"])  # on the low-noise one
    from solrl_engine.models.experts import boundary_ratio

    assert boundary_ratio("Wan-AI/Wan2.2-T2V-A14B-Diffusers", {"Wan-AI/Wan2.2-T2V-A14B-Diffusers": 0.875})


def test_wan22_image_to_video_switches_its_experts_as_its_pipeline_does(tmp_path):
    """Wan2.2-I2V-A14B's layout (no CLIP tower, boundary_ratio 0.9) through model=wan_i2v: the clip a seed and an
    image give is the stock WanImageToVideoPipeline's (FP32), with both experts run."""
    from tiny_pipelines import build_wan_i2v

    from solrl_engine.data import load_prompts

    path = build_wan_i2v(tmp_path / "wi22", two_experts=True)
    m = load_model("wan_i2v", path, "cpu", torch.float32, **OPTS)
    assert m.transformer.boundary == 900.0
    prompt = load_prompts("i2v/train")[0]
    cond = m.encode_prompts([prompt])
    assert cond.image_states is None  # no image cross-attention in Wan2.2's I2V
    x = sample(m, cond, [7], 4, solver="unipc", guidance_scale=5.0, uncond=m.encode_unconditional(),
               dtype=torch.float32)  # fmt: skip
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(image=prompt.open_images()[0], prompt=str(prompt), height=SIDE, width=SIDE, num_frames=WAN_FRAMES,
                  num_inference_steps=4, guidance_scale=5.0, generator=torch.Generator().manual_seed(7),
                  output_type="pt", max_sequence_length=TOKENS).frames.float()  # fmt: skip
    torch.testing.assert_close(m.decode(x), theirs, atol=1e-5, rtol=0)


def test_each_expert_guided_at_its_own_scale_as_the_stock_pipeline_guides_it(wan22, tmp_path):
    """guidance_scale 5.0 for the high-noise expert and guidance_scale_2 2.0 for the low-noise one (the official A14B
    pair is 4.0 / 3.0): the engine's clip equals WanPipeline(guidance_scale=5.0, guidance_scale_2=2.0)'s in FP32, and
    differs from the one-scale clip. The rollouts carry both scales as one float (ExpertGuidance), and a regeneration
    through the stock pipeline gets both."""
    from solrl_engine.models import model_spec
    from solrl_engine.models.experts import ExpertGuidance, expert_guidance, guidance_at
    from solrl_engine.sampling.rollouts import Rollouts, RolloutSettings

    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    g = expert_guidance(m, 5.0, 2.0)
    assert isinstance(g, ExpertGuidance) and float(g) == 5.0 and g != 1.0
    assert [g.at(t) for t in (1.0, 0.9, 0.875, 0.8749, 0.5)] == [5.0, 5.0, 5.0, 2.0, 2.0]  # as the experts switch
    rows = guidance_at(g, torch.tensor([0.95, 0.5]), like=torch.zeros(2, 3, 4))
    assert rows.shape == (2, 1, 1) and rows.flatten().tolist() == [5.0, 2.0]  # Flow-GRPO's update: one per row
    assert guidance_at(5.0, 0.5) == 5.0 and expert_guidance(m, 5.0, 5.0) == 5.0
    import copy
    import pickle

    for twin in (copy.deepcopy(g), pickle.loads(pickle.dumps(g))):  # both scales survive a copy (a config's, a rank's)
        assert isinstance(twin, ExpertGuidance) and twin == g and twin.at(0.5) == 2.0
    assert g != expert_guidance(m, 5.0, 2.5) and g == 5.0 and {g: 1}[5.0] == 1  # another low scale is another
    x = sample(m, m.encode_prompts(PROMPTS), [3, 11], 4, solver="unipc", guidance_scale=g,
               uncond=m.encode_prompts([""]), dtype=torch.float32)  # fmt: skip
    ours = m.decode(x)
    pipe = _stock(wan22)
    theirs = pipe(prompt=PROMPTS, generator=[torch.Generator().manual_seed(s) for s in (3, 11)], height=SIDE,
                  width=SIDE, num_frames=WAN_FRAMES, num_inference_steps=4, guidance_scale=5.0, guidance_scale_2=2.0,
                  output_type="pt", max_sequence_length=TOKENS).frames.float()  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert (_engine(m, PROMPTS, [3, 11], 4) - theirs).abs().max() > 1e-3  # one scale for both: another clip
    ro = Rollouts(m, model_spec("wan"), lambda im, p: im.mean((1, 2, 3)), RolloutSettings(guidance_scale=5.0,
                                                                                          guidance_scale_2=2.0))
    assert isinstance(ro.cfg_guidance, ExpertGuidance) and (ro.pipeline_guidance, ro.pipeline_guidance_2) == (5.0, 2.0)
    one = load_model("wan", build_wan(tmp_path / "one-expert"), "cpu", torch.float32, **OPTS)
    with pytest.raises(ValueError, match="guidance_scale_2.*one transformer"):
        expert_guidance(one, 5.0, 2.0)
    with pytest.raises(ValueError, match="both use classifier-free guidance"):
        ExpertGuidance(1.0, 3.0, 875.0, True)


def test_guidance_scale_2_is_refused_where_it_means_nothing(tmp_path):
    from solrl_engine.rl.config import ConfigError, RLConfig

    with pytest.raises(ConfigError, match="guidance_scale_2.*two-expert model"):
        RLConfig(model="sana", guidance_scale_2=3.0).validate()
    with pytest.raises(ConfigError, match="guidance_scale_2.*holds one transformer"):
        RLConfig(model="wan", model_path=str(build_wan(tmp_path / "one")), guidance_scale_2=3.0).validate()
    with pytest.raises(ConfigError, match="guidance_scale_2.*neither does"):
        RLConfig(model="wan", guidance_scale=1.0, guidance_scale_2=3.0).validate()
    with pytest.raises(ConfigError, match="guidance_scale_2.*>= 0"):
        RLConfig(model="wan", guidance_scale_2=-1.0).validate()
    RLConfig(model="wan", guidance_scale=4.0, guidance_scale_2=3.0).validate()


def test_flow_grpo_trains_two_experts_each_guided_at_its_own_scale(wan22, clip, tmp_path, monkeypatch):
    """Flow-GRPO recomputes the guided velocity of the SDE steps it trains on, rows of several timesteps in one
    batch: each row gets the scale of the expert its timestep runs (the objective's own `_guided`, on velocities whose
    guided value is the scale itself), and `solrl train` runs the objective end to end on two experts guided apart."""
    from solrl_engine import hw
    from solrl_engine.cli import main
    from solrl_engine.models.experts import expert_guidance
    from solrl_engine.rl.objectives.flow_grpo import _guided

    m = load_model("wan", wan22, "cpu", torch.float32, **OPTS)
    cond = m.encode_prompts(PROMPTS)
    t = torch.tensor([0.95, 0.5])  # the high-noise expert's row, then the low-noise one's
    v = _guided(lambda c: torch.full((2, 3), 0.0 if c is not cond else 1.0), cond, m.encode_prompts([""]),
                expert_guidance(m, 4.0, 3.0), t)  # (conditional 1, unconditional 0: the guided value is the scale)
    assert v[:, 0].tolist() == [4.0, 3.0]
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "grpo"
    sets = ("guidance_scale_2=3.0", "objective=flow_grpo", "family=naive_scaling", "full_steps=3", "kl_beta=0.04",
            "policy_dtype=float32", "updates_per_iter=1")  # fmt: skip
    assert main(_train(wan22, clip, out, *sets)) == 0
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(rec["loss"]) and rec["objective"] == "flow_grpo", rec
