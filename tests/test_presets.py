"""The paper presets: all 105 <model>_<family>_<reward> functions load through load_config (the path a
user's `solrl train configs/<file>.py:<name>` takes) and validate without loading any weights, with the
paper's hyper-parameters; overrides and unknown names behave."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from solrl_engine.rl import FAMILIES, ConfigError, load_config
from solrl_engine.rl.config import RLConfig
from solrl_engine.rl.presets import PAPER, REWARD_PROMPTS, REWARDS, define_presets, paper_config

ROOT = Path(__file__).resolve().parents[1]
FILES = {"sd3": ("sd3.py", "sd3"), "flux": ("flux1.py", "flux1"), "sana": ("sana.py", "sana")}
# the paper's per-model values (official NVlabs/Sana configs/sol_rl/*.py), written out, not read from PAPER
PER_MODEL = {
    "sd3": dict(timestep_fraction=0.6, grad_clip=0.002, solver="dpm2"),
    "flux": dict(timestep_fraction=0.4, grad_clip=1.0, solver="dpm2"),
    "sana": dict(timestep_fraction=0.6, grad_clip=1.0, solver="euler"),
}
# Wan's published inference settings (WanPipeline's docstring, the official configs), written out
WAN = {
    "wan2.1-1.3b": ("wan13b", dict(resolution=480, width=832, frames=81, shift=3.0)),
    "wan2.1-14b": ("wan14b", dict(resolution=480, width=832, frames=81, shift=3.0)),
    "wan2.2-5b": ("wan22_5b", dict(resolution=704, width=1280, frames=121, shift=5.0)),
}
# Qwen-Image's published inference settings (the model card's quick start), written out
QWEN = dict(resolution=1328, full_steps=50, guidance_scale=4.0, solver="euler", shift=None, model_path=None)
SHARED = dict(
    k=24, prompts_per_iter=48, preview_steps=6, full_steps=10, lora_rank=32, lora_alpha=64, lr=3e-4,
    weight_decay=1e-4, kl_beta=1e-4, beta=1.0, resolution=None, model_path=None, train_prompts="sample/train",
    eval_prompts="sample/test", eval_every=20, save_every=5, iterations=300, explore_layers=None,
    explore_skip=None, explore_skip_max_dim=None,
)  # fmt: skip


def _module(fname: str):  # noqa: ANN202 - a config module
    spec = importlib.util.spec_from_file_location(f"presets_{fname}", ROOT / "configs" / fname)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _names(fname: str, prefix: str) -> list[str]:
    """The config functions load_config offers: its error for an unknown name lists them."""
    with pytest.raises(ConfigError, match="has no config function") as e:
        load_config(f"{ROOT / 'configs' / fname}:{prefix}_no_such_preset")
    return str(e.value).split("it has: ", 1)[1].split(", ")


def test_the_config_files_offer_exactly_the_105_presets():
    seen = []
    for fname, prefix in FILES.values():
        expected = sorted(f"{prefix}_{f}_{r}" for f in FAMILIES for r in REWARDS)
        assert sorted(_names(fname, prefix)) == expected  # nothing else is listed (no helpers)
        assert sorted(_module(fname).__all__) == expected
        seen += expected
    assert len(seen) == len(set(seen)) == 105  # 3 models x 5 families x 7 rewards


@pytest.mark.parametrize("model", sorted(FILES))
def test_every_preset_validates_with_the_papers_settings(model):
    fname, prefix = FILES[model]
    for family in FAMILIES:
        for reward in REWARDS:
            name = f"{prefix}_{family}_{reward}"
            cfg = load_config(f"{ROOT / 'configs' / fname}:{name}")
            assert (cfg.name, cfg.model, cfg.family, cfg.reward) == (name, model, family, reward)
            own = dict(zip(("train_prompts", "eval_prompts"), REWARD_PROMPTS.get(reward, ()), strict=False))
            assert {k: getattr(cfg, k) for k in SHARED} == {**SHARED, **own}, name  # ocr: its own prompt sets
            # vlm: the judge the docs serve (vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8001)
            assert cfg.reward_args == (("vlm.url=http://127.0.0.1:8001", "vlm.model=Qwen/Qwen2.5-VL-7B-Instruct")
                                       if reward == "vlm" else ()), name  # fmt: skip
            assert {k: getattr(cfg, k) for k in PER_MODEL[model]} == PER_MODEL[model], name
            assert cfg.n == (24 if family == "diffusionnft" else 96)
            assert cfg.compiled_sampler is None  # auto: compiled + graph-captured with CUDA, eager on a CPU
            assert cfg.rollout_batch_size >= 1  # the update's sizes from the GPU at start
            assert (cfg.train_batch_size, cfg.gradient_checkpointing) == ("auto", "auto")


def test_flux_trains_the_papers_lora_targets():
    flux = load_config(f"{ROOT}/configs/flux1.py:flux1_sol_rl_pickscore")
    assert flux.lora_targets == ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    sd3 = load_config(f"{ROOT}/configs/sd3.py:sd3_sol_rl_pickscore")
    assert sd3.lora_targets is None and sd3.guidance_scale is None and sd3.shift is None  # the model's own


def test_overrides_through_set_and_through_keyword_arguments():
    cfg = load_config(f"{ROOT}/configs/sana.py:sana_sol_rl_hpsv2", ["n=32", "k=8", "model_path=/w/sana"])
    assert (cfg.n, cfg.k, cfg.model_path, cfg.family) == (32, 8, "/w/sana", "sol_rl")
    mod = _module("sd3.py")
    cfg = mod.sd3_sol_rl_pickscore(iterations=10)
    assert isinstance(cfg, RLConfig)
    assert (cfg.iterations, cfg.name, cfg.grad_clip) == (10, "sd3_sol_rl_pickscore", 0.002)
    assert "Sol-RL" in mod.sd3_sol_rl_pickscore.__doc__ and "pickscore" in mod.sd3_sol_rl_pickscore.__doc__
    assert "DiffusionNFT" in mod.sd3_diffusionnft_hpsv2.__doc__
    with pytest.raises(ConfigError, match="did you mean 'iterations'"):
        mod.sd3_sol_rl_pickscore(iteration=10)
    with pytest.raises(ConfigError, match="n must equal k"):
        load_config(f"{ROOT}/configs/flux1.py:flux1_diffusionnft_clipscore", ["n=96"])


def test_unknown_names_list_what_exists():
    with pytest.raises(ConfigError, match="sana_sol_rl_hpsv2") as e:
        load_config(f"{ROOT}/configs/sana.py:sana_sol_rl_nothing")
    assert "sana_diffusionnft_imagereward" in str(e.value)
    with pytest.raises(ConfigError, match="choose one of"):
        paper_config("sdxl", "sol_rl", "pickscore")
    with pytest.raises(ConfigError, match="choose one of"):
        paper_config("sd3", "grpo", "pickscore")
    with pytest.raises(ValueError, match="no paper presets"):
        define_presets({}, "sdxl", "sdxl")


def test_the_table_is_data():
    ns: dict = {}
    names = define_presets(ns, "sana", "demo")
    assert set(names) == set(ns) and len(names) == 35 and all(n.startswith("demo_") for n in names)
    assert set(PAPER) == set(FILES) | set(WAN) | {"qwenimage", "sana-video", "z-image", "flux2-klein", "flux-kontext",
                                                  "qwen-image-edit", "qwen-image-edit-2509", "wan2.1-i2v-14b",
                                                  "wan2.2-a14b"}


def test_the_wan_presets_take_each_models_published_settings():
    from solrl_engine.rl.presets import I2V_REWARDS

    expected = sorted([f"{prefix}_{f}_{r}" for prefix, _ in WAN.values() for f in FAMILIES for r in REWARDS]
                      + [f"wan_i2v14b_{f}_{r}" for f in FAMILIES for r in I2V_REWARDS]
                      + [f"wan22_a14b_{f}_{r}" for f in FAMILIES for r in REWARDS])  # fmt: skip
    assert sorted(_names("wan.py", "wan13b")) == expected and sorted(_module("wan.py").__all__) == expected
    for key, (prefix, want) in WAN.items():
        for family in FAMILIES:
            cfg = load_config(f"{ROOT / 'configs' / 'wan.py'}:{prefix}_{family}_clipscore")
            assert cfg.model == "wan" and {k: getattr(cfg, k) for k in want} == want, (key, family)
            assert (cfg.solver, cfg.guidance_scale, cfg.full_steps, cfg.preview_steps) == ("unipc", 5.0, 50, 30)
            assert cfg.model_path.startswith("Wan-AI/") and cfg.gradient_checkpointing == "auto"
    for family in FAMILIES:  # image-to-video: the 14B's settings, the bundled image-to-video prompts
        cfg = load_config(f"{ROOT / 'configs' / 'wan.py'}:wan_i2v14b_{family}_clipscore")
        assert cfg.model == "wan_i2v" and (cfg.train_prompts, cfg.eval_prompts) == ("i2v/train", "i2v/test")
        assert (cfg.resolution, cfg.width, cfg.frames, cfg.shift) == (480, 832, 81, 3.0)
    for family in FAMILIES:  # Wan2.2-T2V-A14B: two experts, the official t2v_A14B steps and shift
        cfg = load_config(f"{ROOT / 'configs' / 'wan.py'}:wan22_a14b_{family}_clipscore")
        assert cfg.model_path == "Wan-AI/Wan2.2-T2V-A14B-Diffusers" and cfg.lora_experts == "both"
        assert (cfg.full_steps, cfg.preview_steps, cfg.shift, cfg.guidance_scale) == (40, 24, 12.0, 4.0)
        assert cfg.guidance_scale_2 == 3.0  # the official low-noise expert's guidance
    with pytest.raises(ConfigError, match="frames = 80: the Wan VAE takes 4k \\+ 1 frames"):
        load_config(f"{ROOT / 'configs' / 'wan.py'}:wan13b_sol_rl_clipscore", ["frames=80"])
    with pytest.raises(ConfigError, match="frames = 9: applies to video models"):
        load_config(f"{ROOT / 'configs' / 'sana.py'}:sana_sol_rl_clipscore", ["frames=9"])


def test_the_qwen_image_presets_take_the_model_cards_settings():
    expected = sorted(f"qwenimage_{f}_{r}" for f in FAMILIES for r in REWARDS)
    assert sorted(_names("qwenimage.py", "qwenimage")) == expected
    assert sorted(_module("qwenimage.py").__all__) == expected
    for family in FAMILIES:
        cfg = load_config(f"{ROOT / 'configs' / 'qwenimage.py'}:qwenimage_{family}_pickscore")
        assert cfg.model == "qwenimage" and {k: getattr(cfg, k) for k in QWEN} == QWEN, family
        assert cfg.preview_steps == 30 and cfg.gradient_checkpointing == "auto"
        assert cfg.n == (24 if family == "diffusionnft" else 96) and cfg.k == 24 and cfg.lora_targets is None


def test_the_sana_video_presets_take_the_published_settings():
    """SanaVideoPipeline's documented call: 480 x 832, 81 frames, 50 steps, guidance 6.0; DPM-Solver++ 2M on the
    scheduler's own shift (8), the weights named by the family's default path."""
    expected = sorted(f"sana_video_{f}_{r}" for f in FAMILIES for r in REWARDS)
    assert sorted(_names("sana_video.py", "sana_video")) == expected
    assert sorted(_module("sana_video.py").__all__) == expected
    for family in FAMILIES:
        cfg = load_config(f"{ROOT / 'configs' / 'sana_video.py'}:sana_video_{family}_clipscore")
        assert cfg.model == "sana_video" and (cfg.resolution, cfg.width, cfg.frames) == (480, 832, 81), family
        assert (cfg.solver, cfg.guidance_scale, cfg.shift, cfg.full_steps, cfg.preview_steps) == ("dpm2", 6.0, None,
                                                                                                   50, 30)  # fmt: skip
        assert cfg.model_path is None and cfg.decode_batch_size == 1
    for family in FAMILIES:  # Wan2.2-T2V-A14B: two experts, the official t2v_A14B steps and shift
        cfg = load_config(f"{ROOT / 'configs' / 'wan.py'}:wan22_a14b_{family}_clipscore")
        assert cfg.model_path == "Wan-AI/Wan2.2-T2V-A14B-Diffusers" and cfg.lora_experts == "both"
        assert (cfg.full_steps, cfg.preview_steps, cfg.shift, cfg.guidance_scale) == (40, 24, 12.0, 4.0)
    with pytest.raises(ConfigError, match="frames = 80: the Wan VAE takes 4k \\+ 1 frames"):
        load_config(f"{ROOT / 'configs' / 'sana_video.py'}:sana_video_sol_rl_clipscore", ["frames=80"])
    with pytest.raises(ConfigError, match="applies to video models \\(model=wan or sana_video or wan_i2v\\)"):
        load_config(f"{ROOT / 'configs' / 'sana.py'}:sana_sol_rl_clipscore", ["width=64"])


def test_the_z_image_presets_take_the_model_cards_settings():
    """Tongyi-MAI/Z-Image's call: 50 steps, guidance_scale 4 (the engine's 5: the pipeline guides at g + 1), the
    scheduler's own shift; 1024 px."""
    expected = sorted(f"z_image_{f}_{r}" for f in FAMILIES for r in REWARDS)
    assert sorted(_names("z_image.py", "z_image")) == expected and sorted(_module("z_image.py").__all__) == expected
    for family in FAMILIES:
        cfg = load_config(f"{ROOT / 'configs' / 'z_image.py'}:z_image_{family}_clipscore")
        assert cfg.model == "z_image" and cfg.resolution == 1024 and cfg.model_path is None, family
        assert (cfg.solver, cfg.guidance_scale, cfg.shift, cfg.full_steps, cfg.preview_steps) == ("euler", 5.0, None,
                                                                                                   50, 30)  # fmt: skip


def test_the_flux_kontext_presets_edit_the_bundled_set_with_the_editing_rewards():
    """FluxKontextPipeline's call (28 steps, distilled guidance 2.5: the model's), Euler, 1024 px; the editing
    rewards (edit = CLIP direction and preservation), the bundled editing prompt set."""
    from solrl_engine.rl.presets import EDIT_REWARDS

    expected = sorted(f"flux_kontext_{f}_{r}" for f in FAMILIES for r in EDIT_REWARDS)
    assert sorted(_names("flux_kontext.py", "flux_kontext")) == expected
    assert sorted(_module("flux_kontext.py").__all__) == expected
    for family in FAMILIES:
        cfg = load_config(f"{ROOT / 'configs' / 'flux_kontext.py'}:flux_kontext_{family}_edit")
        assert cfg.model == "flux_kontext" and cfg.reward == "clip_direction:1.0,preserve:0.5", family
        assert (cfg.solver, cfg.guidance_scale, cfg.full_steps, cfg.preview_steps) == ("euler", None, 28, 16)
        assert (cfg.train_prompts, cfg.eval_prompts) == ("edit/train", "edit/test")
    assert load_config(f"{ROOT / 'configs' / 'flux_kontext.py'}:flux_kontext_sol_rl_vlm").reward_args[0].startswith(
        "vlm.url=")  # fmt: skip


def test_the_qwen_image_edit_presets_take_the_model_cards_call_on_the_bundled_editing_set():
    """Qwen-Image-Edit's model card: 50 steps, guidance 4.0 (true CFG against " "), Euler, edits at 1024 px; the
    editing rewards and the bundled editing prompt set."""
    from solrl_engine.rl.presets import EDIT_REWARDS

    expected = sorted(f"{m}_{f}_{r}" for m in ("qwenimage_edit", "qwenimage_edit_plus") for f in FAMILIES
                      for r in EDIT_REWARDS)  # fmt: skip
    assert sorted(_names("qwenimage_edit.py", "qwenimage_edit")) == expected
    assert sorted(_module("qwenimage_edit.py").__all__) == expected
    for family in FAMILIES:
        for model, steps in (("qwenimage_edit", (50, 30)), ("qwenimage_edit_plus", (40, 24))):
            cfg = load_config(f"{ROOT / 'configs' / 'qwenimage_edit.py'}:{model}_{family}_edit")
            assert cfg.model == model and cfg.reward == "clip_direction:1.0,preserve:0.5", family
            assert (cfg.solver, cfg.guidance_scale, (cfg.full_steps, cfg.preview_steps), cfg.resolution) == (
                "euler", 4.0, steps, 1024)  # fmt: skip
            assert (cfg.train_prompts, cfg.eval_prompts) == ("edit/train", "edit/test")


def test_the_flux2_klein_presets_take_the_pipelines_documented_settings():
    """Flux2KleinPipeline's documented call of the base model: 50 steps, guidance 4.0; the scheduler's own shift;
    1024 px."""
    expected = sorted(f"flux2_klein_{f}_{r}" for f in FAMILIES for r in REWARDS)
    assert sorted(_names("flux2.py", "flux2_klein")) == expected and sorted(_module("flux2.py").__all__) == expected
    for family in FAMILIES:
        cfg = load_config(f"{ROOT / 'configs' / 'flux2.py'}:flux2_klein_{family}_clipscore")
        assert cfg.model == "flux2" and cfg.resolution == 1024 and cfg.model_path is None, family
        assert (cfg.solver, cfg.guidance_scale, cfg.shift, cfg.full_steps, cfg.preview_steps) == ("euler", 4.0, None,
                                                                                                   50, 30)  # fmt: skip


@pytest.mark.parametrize("family", ["sol_rl", "naive_scaling", "diffusionnft"])
def test_every_preset_takes_each_objectives_published_settings(family):
    """`--set objective=NAME` goes to the preset function, which takes that objective's settings (flow_grpo's
    official configs: noise 0.7, lr 3e-4, clip 1e-4, KL 0.01 for pickscore and 0.04 otherwise, two optimizer steps
    per iteration); the other --sets still win, and the run gets a directory of its own."""
    for model, file in (("sd3", "sd3.py"), ("flux1", "flux1.py"), ("sana", "sana.py")):
        base = load_config(f"{ROOT}/configs/{file}:{model}_{family}_pickscore")
        assert base.objective == "nft" and base.name == f"{model}_{family}_pickscore"
        for obj in ("flow_grpo", "flow_grpo_fast", "awm"):
            cfg = load_config(f"{ROOT}/configs/{file}:{model}_{family}_pickscore", [f"objective={obj}", "lr=1e-4"])
            assert cfg.objective == obj and cfg.name == f"{model}_{family}_pickscore_{obj}" and cfg.lr == 1e-4
            assert (cfg.n, cfg.k, cfg.full_steps, cfg.family) == (base.n, base.k, base.full_steps, base.family)
        grpo = load_config(f"{ROOT}/configs/{file}:{model}_{family}_pickscore", ["objective=flow_grpo"])
        assert (grpo.sde_noise_level, grpo.clip_range, grpo.kl_beta, grpo.lr, grpo.updates_per_iter) == (
            0.7, 1e-4, 0.01, 3e-4, 2)
        fast = load_config(f"{ROOT}/configs/{file}:{model}_{family}_ocr", ["objective=flow_grpo_fast"])
        assert (fast.kl_beta, fast.sde_window, fast.sde_window_range) == (0.04, 2, None)
    with pytest.raises(ConfigError, match=r"no paper preset for objective 'grpo'; choose one of \('nft', 'flow_grpo'"):
        load_config(f"{ROOT}/configs/sd3.py:sd3_sol_rl_pickscore", ["objective=grpo"])
