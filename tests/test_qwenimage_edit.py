"""Qwen-Image-Edit (image editing) through the engine, on a tiny random-weight QwenImageEditPipeline of the real
classes saved and loaded as a user's weights are (tests/tiny_pipelines.py: build_qwenimage_edit; the Qwen2-VL
processor's video part stands in where torchvision is missing, `qwen_vl_processor`), with the bundled editing
prompt set: the engine's edit equals the stock pipeline's for a seed and a source (without guidance, and with it
once the pipeline's norm rescale is off), the source reaches both the text states and the image tokens, each prompt
guides against its own source-conditioned negative, every family trains through `solrl train` on the editing
rewards, the exported LoRA loads into the stock pipeline, and bad input is refused before any weight loads."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import SIZES, build_clip_reward, build_qwenimage_edit, linear_rows, qwen_vl_processor
from trained import euler, stock_pipeline_draws_the_lora, two_iterations

from solrl_engine.data import ConditionedPrompt, load_prompts
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample

SIZE = SIZES["qwenimage"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _processor() -> Iterator[None]:
    with qwen_vl_processor():
        yield


@pytest.fixture(scope="module")
def qe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwenimage_edit(tmp_path_factory.mktemp("qwenedit") / "qe")


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("qeclip") / "clip")


@pytest.fixture
def at_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stock pipeline puts the source at 1024 x 1024 pixels whatever the edit's size (the engine at the edit's
    R x R: the same call at R = 1024); here its area is the tiny edit's, so the two compare at 64 px."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as mod

    area = mod.calculate_dimensions
    monkeypatch.setattr(mod, "calculate_dimensions", lambda target, ratio: area(SIZE * SIZE, ratio))


def _stock(path: Path) -> Any:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model(path: Path) -> Any:
    return load_model("qwenimage_edit", path, "cpu", torch.float32, resolution=SIZE)


def _edit(pipe: Any, prompt: ConditionedPrompt, seed: int, steps: int, **kw: Any) -> torch.Tensor:
    """The stock pipeline's edit of a conditioned prompt, the source resized to the edit's size (the engine's)."""
    src = pipe.image_processor.resize(prompt.open_images()[0], SIZE, SIZE)
    return pipe(prompt=str(prompt), image=src, height=SIZE, width=SIZE, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images.float()  # fmt: skip


@contextlib.contextmanager
def no_norm_rescale() -> Iterator[list[int]]:
    """The stock pipelines' rescale of each token's guided velocity to the conditional one's norm switched off:
    their per-token torch.norm returns ones (counted in the list yielded); every other norm (the VAE's) passes."""
    calls: list[int] = []
    norm = torch.norm

    def ones(t: torch.Tensor, *args: Any, **k: Any) -> torch.Tensor:
        if not args and k == {"dim": -1, "keepdim": True}:
            calls.append(1)
            return torch.ones_like(t[..., :1])
        return norm(t, *args, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "norm", ones)
        yield calls


def test_the_engines_edit_is_the_stock_pipelines_for_a_seed_and_a_source(qe, at_size):
    """Two instructions on two bundled sources (128 px, resized to the edit's 64), no guidance: FP32 equal to the
    stock pipeline's to 1e-5. The source reaches the transformer twice: its latents (zeroed, the edit differs) and
    its vision tokens in the text states (one instruction on two sources: two different text states)."""
    prompts = load_prompts("edit/train")[:2]
    m = _model(qe)
    cond = m.encode_prompts(prompts)
    assert cond.image is not None and cond.image.shape == (2, 16, SIZE // 8, SIZE // 8)
    ours = m.decode(sample(m, cond, [3, 11], 3, solver="euler"))
    pipe = _stock(qe)
    theirs = torch.cat([_edit(pipe, p, s, 3, true_cfg_scale=1.0) for p, s in zip(prompts, [3, 11], strict=True)])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    blind = type(cond)(cond.hidden, None, cond.mask, torch.zeros_like(cond.image))
    assert (m.decode(sample(m, blind, [3, 11], 3, solver="euler")) - ours).abs().max() > 1e-3
    a, b = prompts
    same_text = m.encode_prompts([ConditionedPrompt(str(a), a.images), ConditionedPrompt(str(a), b.images)])
    assert (same_text.hidden[0] - same_text.hidden[1]).abs().max() > 1e-3  # the vision tokens differ
    spec = model_spec("qwenimage_edit")
    assert spec.conditioned and spec.guidance == "cfg" and spec.guidance_scale == 4.0


def test_guidance_contrasts_each_edit_with_its_own_source_conditioned_negative(qe, at_size):
    """The engine's CFG (4.0) equals the stock pipeline's true CFG against negative_prompt=" " (encoded with the
    prompt's source) once the pipeline's per-token norm rescale is off (torch.norm returns ones during the call),
    for two edits of one batch; guiding both against one shared negative (the first source's) differs."""
    prompts = load_prompts("edit/train")[:2]
    m = _model(qe)
    cond = m.encode_prompts(prompts)
    assert cond.negative_hidden is not None and len(cond.negative_hidden) == 2
    g, seeds, steps = model_spec("qwenimage_edit").guidance_scale, [5, 6], 3
    ours = m.decode(sample(m, cond, seeds, steps, guidance_scale=g, uncond=m.encode_unconditional(), solver="euler"))
    pipe = _stock(qe)
    with no_norm_rescale() as calls:
        theirs = torch.cat([_edit(pipe, p, s, steps, true_cfg_scale=g, negative_prompt=" ")
                            for p, s in zip(prompts, seeds, strict=True)])  # fmt: skip
    assert len(calls) == 2 * 2 * steps  # the rescale was reached (and neutralised) at every step of both edits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    first = cond.negative_hidden[:1].expand_as(cond.negative_hidden)
    shared = type(cond)(cond.hidden, None, cond.mask, cond.image, None, first, None)
    other = m.decode(sample(m, shared, seeds, steps, guidance_scale=g, uncond=m.encode_unconditional(), solver="euler"))
    assert (other[1] - ours[1]).abs().max() > 1e-3 and torch.equal(other[0], ours[0])


def test_tokens_per_sample_counts_the_source_tokens_the_transformer_reads(qe, qp, tmp_path):
    """The image tokens each linear of the image stream sees (what the memory plan and the auto explore probe size
    with): the latent's and the source's, one set per source for the 2509 editor."""
    m = _model(qe)
    latent = (SIZE // 16) ** 2
    assert m.tokens_per_sample == 2 * latent and m.tokens_per_sample in linear_rows(m, load_prompts("edit/train")[0])
    plus = load_model("qwenimage_edit_plus", qp, "cpu", torch.float32, resolution=SIZE)
    assert 3 * latent in linear_rows(plus, load_prompts(str(_two_source_set(tmp_path, 1)))[0])


def test_a_prompt_without_a_source_and_a_size_the_pipeline_cannot_round_are_refused(qe):
    m = _model(qe)
    with pytest.raises(ValueError, match="Qwen-Image-Edit edits one image per prompt.*conditioned"):
        m.encode_prompts(["make it red"])
    with pytest.raises(ValueError, match="resolution=48: Qwen-Image-Edit edits at a multiple of 32.*use 32"):
        load_model("qwenimage_edit", qe, "cpu", torch.float32, resolution=48)
    from solrl_engine.rl import ConfigError, load_config

    for model in ("qwenimage_edit", "qwenimage_edit_plus"):  # a config says so before any weights load
        with pytest.raises(ConfigError, match=f"resolution.*model={model} draws at a multiple of 32 pixels: use 992"):
            load_config(f"{ROOT}/configs/qwenimage_edit.py:{model}_sol_rl_edit", ["resolution=1000"])


def _train_args(qe: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={qe}", f"resolution={SIZE}", f"reward_args=clip_direction.model={clip}", f"n={n}", "k=2",
            "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2", "eval_prompt_count=2",
            "eval_seeds=1", "eval_every=2", "save_every=2", "rollout_batch_size=8", "train_batch_size=2",
            "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4",
            *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/qwenimage_edit.py:qwenimage_edit_{family}_edit", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_edits_and_exports_a_lora_the_stock_pipeline_loads(qe, clip, tmp_path, monkeypatch, at_size):
    """Two sol_rl iterations (guidance 4.0 against each source's negative) on the bundled editing set with the
    editing rewards; the exported adapter, loaded by QwenImageEditPipeline.load_lora_weights, draws what the engine
    draws with it for a seed and a source."""
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train_args(qe, clip, out, "sol_rl", "save_every=1")) == 0
    recs = two_iterations(out)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    prompt = load_prompts("edit/test")[0]
    pipe = _stock(qe)
    stock_pipeline_draws_the_lora(pipe, lambda: _edit(pipe, prompt, 5, 3, true_cfg_scale=1.0), _model(qe),
                                  out / "lora", euler(prompt))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_the_editor(family, qe, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / family
    assert main(_train_args(qe, clip, out, family)) == 0
    two_iterations(out)


def test_a_prompt_set_without_images_is_refused_before_any_weights_load(qe, clip, tmp_path, monkeypatch):
    from solrl_engine import models
    from solrl_engine.cli import main

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models.ModelSpec, "build", no_load)
    with pytest.raises(SystemExit, match="train_prompts='sample/train': model=qwenimage_edit takes an image per "
                                         "prompt"):  # fmt: skip
        main(_train_args(qe, clip, tmp_path / "a", "sol_rl", "train_prompts=sample/train"))


def test_the_explorer_regenerates_edits_through_the_stock_pipeline(qe, clip, at_size):
    """Other trainers' path with an editing set: NVFP4 previews (no guidance), then the selected seeds regenerated
    by the stock QwenImageEditPipeline with each instruction's source: each edit is the pipeline's for that source
    and seed called alone."""
    from solrl_engine.explore import Explorer
    from solrl_engine.rewards import load_reward

    prompts = load_prompts("edit/train")[:2]
    pipe = _stock(qe)
    reward = load_reward("clip_direction:1.0,preserve:0.5", {"clip_direction": {"model": str(clip)}})
    ex = Explorer(pipe, reward, n=3, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZE, batch_size=4,
                  guidance_scale=1.0)  # fmt: skip
    sel = ex.select(prompts)
    regen = sel.regenerate(pipe, steps=2, batch_size=4, true_cfg_scale=1.0)
    assert regen.images.shape == (4, 3, SIZE, SIZE) and regen.rewards.shape == (2, 2)
    for row, (prompt, seed) in enumerate([(p, s) for p, seeds in zip(prompts, sel.seeds, strict=True) for s in seeds]):
        torch.testing.assert_close(regen.images[row : row + 1], _edit(pipe, prompt, seed, 2, true_cfg_scale=1.0),
                                   atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.slow
def test_flow_grpo_guides_each_edit_against_its_own_negative_in_the_update(qe, clip, tmp_path, monkeypatch):
    """Flow-GRPO recomputes guided velocities in its update (`_guided`): each row contrasts with its own source's
    negative (not the shared unconditional row, which would give another velocity), and a run with guidance 4.0
    trains with finite losses."""
    from solrl_engine import hw
    from solrl_engine.cli import main
    from solrl_engine.rl.objectives.flow_grpo import _guided

    m = _model(qe)
    cond = m.encode_prompts(load_prompts("edit/train")[:2])
    x, t = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(1)), torch.tensor([0.7, 0.4])
    got = _guided(lambda c: m.velocity(x, t, c), cond, m.encode_unconditional(), 4.0, t)
    own = type(cond)(cond.negative_hidden, None, cond.negative_mask, cond.image)
    vc, vu = m.velocity(x, t, cond).float(), m.velocity(x, t, own).float()
    torch.testing.assert_close(got, vu + 4.0 * (vc - vu), atol=1e-6, rtol=0)
    shared = m.encode_unconditional().against(type(cond)(cond.hidden, None, cond.mask, cond.image))
    assert (m.velocity(x, t, shared).float() - vu).abs().max() > 1e-3
    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "grpo"
    assert main(_train_args(qe, clip, out, "sol_rl", "objective=flow_grpo")) == 0
    two_iterations(out)


# --- Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline): one or several sources a prompt -----------------------------


@pytest.fixture(scope="module")
def qp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwenimage_edit(tmp_path_factory.mktemp("qwenplus") / "qp", plus=True)


@pytest.fixture
def plus_at_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Plus pipeline puts each source at 1024 x 1024 pixels for its VAE (the engine at the edit's R x R); here
    that area is the tiny edit's. Its text encoder's condition size (384 x 384) is the pipeline's in both."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as mod

    monkeypatch.setattr(mod, "VAE_IMAGE_SIZE", SIZE * SIZE)


def _two_source_set(tmp_path: Path, lines: int = 4) -> Path:
    """A prompt set whose lines each carry two bundled sources."""
    src = load_prompts("edit/train")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"put the shape of picture 2 beside {str(src[i]).split()[-1]}",
                                        "images": [str(src[i].images[0]), str(src[i + 1].images[0])]}) + "\n"
                            for i in range(lines)))  # fmt: skip
    return path


def _plus_edit(pipe: Any, prompt: ConditionedPrompt, seed: int, steps: int, **kw: Any) -> torch.Tensor:
    srcs = [pipe.image_processor.resize(im, SIZE, SIZE) for im in prompt.open_images()]
    return pipe(prompt=str(prompt), image=srcs, height=SIZE, width=SIZE, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images.float()  # fmt: skip


def test_the_2509_edit_of_two_sources_is_the_stock_pipelines(qp, plus_at_size, tmp_path):
    """Two prompts of two sources each: without guidance and with it (the rescale off), FP32 equal to the stock
    QwenImageEditPlusPipeline's, one prompt a call; each source's tokens count (the second zeroed, the edit differs);
    one source a prompt works as well (the bundled set)."""
    prompts = load_prompts(str(_two_source_set(tmp_path, 2)))
    m = load_model("qwenimage_edit_plus", qp, "cpu", torch.float32, resolution=SIZE)
    cond = m.encode_prompts(prompts)
    assert cond.image.shape == (2, 32, SIZE // 8, SIZE // 8) and cond.negative_hidden is not None
    pipe = _stock(qp)
    ours = m.decode(sample(m, cond, [3, 11], 3, solver="euler"))
    theirs = torch.cat([_plus_edit(pipe, p, s, 3, true_cfg_scale=1.0) for p, s in zip(prompts, [3, 11], strict=True)])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    second_blind = type(cond)(cond.hidden, None, cond.mask, torch.cat([cond.image[:, :16], 0 * cond.image[:, 16:]], 1))
    assert (m.decode(sample(m, second_blind, [3, 11], 3, solver="euler")) - ours).abs().max() > 1e-3
    guided = m.decode(sample(m, cond[:1], [5], 2, guidance_scale=4.0, uncond=m.encode_unconditional(), solver="euler"))
    with no_norm_rescale():
        stock = _plus_edit(pipe, prompts[0], 5, 2, true_cfg_scale=4.0, negative_prompt=" ")
    torch.testing.assert_close(guided, stock, atol=1e-5, rtol=0)
    one = load_prompts("edit/train")[:1]
    torch.testing.assert_close(m.decode(sample(m, m.encode_prompts(one), [7], 2, solver="euler")),
                               _plus_edit(pipe, one[0], 7, 2, true_cfg_scale=1.0), atol=1e-5, rtol=0)  # fmt: skip


def test_source_counts_that_do_not_fit_the_editor_are_refused_before_any_weights_load(qe, clip, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    """Qwen-Image-Edit takes one source a line: a two-source set is refused at the start of `solrl train`, naming
    the line; the 2509 editor takes any number, as many on every line: a set mixing them is refused the same way."""
    from solrl_engine import models
    from solrl_engine.cli import main

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models.ModelSpec, "build", no_load)
    pairs = _two_source_set(tmp_path)
    with pytest.raises(SystemExit, match=r"model=qwenimage_edit takes 1 image\(s\) per prompt; prompt 1 .* has 2"):
        main(_train_args(qe, clip, tmp_path / "a", "sol_rl", f"train_prompts={pairs}"))
    mixed = tmp_path / "mixed.jsonl"
    one = load_prompts("edit/train")[0]
    mixed.write_text(pairs.read_text() + json.dumps({"prompt": str(one), "image": str(one.images[0])}) + "\n")
    args = _train_args(qe, clip, tmp_path / "b", "sol_rl", f"train_prompts={mixed}")
    args[1] = f"{ROOT}/configs/qwenimage_edit.py:qwenimage_edit_plus_sol_rl_edit"
    with pytest.raises(SystemExit, match="model=qwenimage_edit_plus takes as many images on every line; prompt 5 .* "
                                         "has 1 where the first has 2"):  # fmt: skip
        main(args)


def test_a_2509_batch_mixing_source_counts_or_a_plain_prompt_is_refused(qp, tmp_path):
    m = load_model("qwenimage_edit_plus", qp, "cpu", torch.float32, resolution=SIZE)
    pairs, single = load_prompts(str(_two_source_set(tmp_path, 1))), load_prompts("edit/train")[:1]
    with pytest.raises(ValueError, match=r"one batch carry \[1, 2\] sources each.*as many sources"):
        m.encode_prompts(pairs + single)
    with pytest.raises(ValueError, match="Qwen-Image-Edit-2509 edits take one or more source images a prompt"):
        m.encode_prompts(["make it red"])


def test_solrl_train_edits_two_sources_and_the_stock_2509_pipeline_loads_the_lora(qp, clip, tmp_path, monkeypatch,
                                                                                   plus_at_size):  # fmt: skip
    """Two sol_rl iterations on a two-source set (guidance 4.0); the adapter loaded by QwenImageEditPlusPipeline
    draws what the engine draws with it."""
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    pairs = _two_source_set(tmp_path)
    args = _train_args(qp, clip, tmp_path / "run", "sol_rl", "save_every=1", f"train_prompts={pairs}",
                       f"eval_prompts={pairs}")  # fmt: skip
    args[1] = f"{ROOT}/configs/qwenimage_edit.py:qwenimage_edit_plus_sol_rl_edit"
    assert main(args) == 0
    out = tmp_path / "run"
    two_iterations(out)
    prompt = load_prompts(str(pairs))[0]
    pipe = _stock(qp)
    stock_pipeline_draws_the_lora(pipe, lambda: _plus_edit(pipe, prompt, 5, 3, true_cfg_scale=1.0),
                                  load_model("qwenimage_edit_plus", qp, "cpu", torch.float32, resolution=SIZE),
                                  out / "lora", euler(prompt))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_the_2509_editor_on_two_sources(family, qp, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    pairs = _two_source_set(tmp_path)
    args = _train_args(qp, clip, tmp_path / family, family, f"train_prompts={pairs}", f"eval_prompts={pairs}")
    args[1] = f"{ROOT}/configs/qwenimage_edit.py:qwenimage_edit_plus_{family}_edit"
    assert main(args) == 0
    two_iterations(tmp_path / family)


def test_the_explorer_regenerates_2509_edits_one_prompt_a_call(qp, clip, plus_at_size, tmp_path):
    """The stock Plus pipeline edits one prompt a call: with batch_size=1 each regenerated edit is its own."""
    from solrl_engine.explore import Explorer
    from solrl_engine.rewards import load_reward

    prompts = load_prompts(str(_two_source_set(tmp_path, 2)))
    pipe = _stock(qp)
    reward = load_reward("clip_direction:1.0,preserve:0.5", {"clip_direction": {"model": str(clip)}})
    ex = Explorer(pipe, reward, n=3, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZE, batch_size=4,
                  guidance_scale=1.0)  # fmt: skip
    sel = ex.select(prompts)
    regen = sel.regenerate(pipe, steps=2, batch_size=1, true_cfg_scale=1.0)
    sel_seeds = [s for seeds in sel.seeds for s in seeds]
    assert regen.images.shape == (4, 3, SIZE, SIZE) and len(sel_seeds) == 4
    torch.testing.assert_close(regen.images[:1], _plus_edit(pipe, prompts[0], sel_seeds[0], 2, true_cfg_scale=1.0),
                               atol=1e-5, rtol=0)  # fmt: skip
