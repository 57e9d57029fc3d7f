"""FLUX.1 Kontext (image editing) through the engine, on a tiny random-weight FluxKontextPipeline of the real classes
saved and loaded as a user's weights are, with the bundled editing prompt set (conditioned prompts: an instruction
and a source image per line): the engine's sample equals the stock pipeline's for a seed and a source, the source
changes the edit, every family trains through `solrl train` on the editing rewards, the exported LoRA loads into
the stock pipeline, and a prompt set that does not fit the model is refused before any weight loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_pipelines import SIZES, build_clip_reward, build_flux_kontext, linear_rows
from trained import euler, stock_pipeline_draws_the_lora, two_iterations

from solrl_engine.data import ConditionedPrompt, load_prompts
from solrl_engine.models import load_model, model_spec
from solrl_engine.sampling.sampler import sample

SIZE = SIZES["flux"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux_kontext(tmp_path_factory.mktemp("kontext") / "fk")


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip_reward(tmp_path_factory.mktemp("fkclip") / "clip")


def _stock(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model("flux_kontext", path, "cpu", dtype, resolution=SIZE)


def _edit(pipe: Any, prompt: ConditionedPrompt, seed: int, steps: int) -> torch.Tensor:
    """The stock pipeline's edit of a conditioned prompt, the source resized to the edit's size (the engine's)."""
    src = pipe.image_processor.resize(prompt.open_images()[0], SIZE, SIZE)
    return pipe(prompt=str(prompt), image=src, height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False,
                num_inference_steps=steps, guidance_scale=2.5, generator=torch.Generator().manual_seed(seed),
                output_type="pt").images.float()  # fmt: skip


def test_the_engines_edit_is_the_stock_pipelines_for_a_seed_and_a_source(fk):
    """Two instructions on two bundled sources (128 px, resized to the edit's 64): FP32 equal to the stock
    pipeline's to 1e-5; the source's tokens change the edit (zeroed, the image differs)."""
    prompts = load_prompts("edit/train")[:2]
    assert all(isinstance(p, ConditionedPrompt) for p in prompts)
    m = _model(fk)
    cond = m.encode_prompts(prompts)
    assert cond.image is not None and cond.image.shape == (2, 16, SIZE // 8, SIZE // 8)
    ours = m.decode(sample(m, cond, [3, 11], 3, solver="euler"))
    pipe = _stock(fk)
    theirs = torch.cat([_edit(pipe, p, s, 3) for p, s in zip(prompts, [3, 11], strict=True)])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    blind = type(cond)(cond.hidden, cond.pooled, None, torch.zeros_like(cond.image))
    assert (m.decode(sample(m, blind, [3, 11], 3, solver="euler")) - ours).abs().max() > 1e-3
    assert model_spec("flux_kontext").conditioned and model_spec("flux_kontext").guidance_scale == 2.5


def test_tokens_per_sample_counts_the_source_tokens_the_transformer_reads(fk):
    """The latent's and the source's tokens (what the memory plan and the auto explore probe size with)."""
    m = _model(fk)
    assert m.tokens_per_sample == 2 * (SIZE // 16) ** 2
    assert m.tokens_per_sample in linear_rows(m, load_prompts("edit/train")[0])


def test_one_instruction_on_two_sources_is_two_prompts_to_the_cache(fk):
    a, b = load_prompts("edit/train")[:2]
    same_text = [ConditionedPrompt(str(a), a.images), ConditionedPrompt(str(a), b.images)]
    m = _model(fk)
    cond = m.encode_prompts(same_text)
    assert torch.equal(cond.hidden[0], cond.hidden[1]) and not torch.equal(cond.image[0], cond.image[1])
    with pytest.raises(ValueError, match="FLUX.1 Kontext edits one image per prompt.*conditioned"):
        m.encode_prompts(["make it red"])


def _train_args(fk: Path, clip: Path, out: Path, family: str, *extra: str) -> list[str]:
    n = 2 if family == "diffusionnft" else 4  # diffusionnft trains on every rollout: n = k
    sets = [f"model_path={fk}", f"resolution={SIZE}", f"reward_args=clip_direction.model={clip}", f"n={n}", "k=2",
            "prompts_per_iter=2", "iterations=2", "preview_steps=1", "full_steps=2", "eval_prompt_count=2",
            "eval_seeds=1", "eval_every=2", "save_every=2", "rollout_batch_size=8", "train_batch_size=2",
            "lora_rank=4", "lora_alpha=8", "lr=1e-2", "explore_precision=nvfp4", "device=cpu", "decode_batch_size=4",
            *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/flux_kontext.py:flux_kontext_{family}_edit", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def test_solrl_train_edits_and_exports_a_lora_the_stock_pipeline_loads(fk, clip, tmp_path, monkeypatch):
    """Two sol_rl iterations on the bundled editing set with the editing rewards (CLIP direction and preservation,
    both read each prompt's source); the exported adapter, loaded by FluxKontextPipeline.load_lora_weights, draws
    what the engine draws with it for a seed and a source."""
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / "run"
    assert main(_train_args(fk, clip, out, "sol_rl", "save_every=1")) == 0
    recs = two_iterations(out)
    assert "heldout_reward" in recs[-1] and (out / "eval_00002.png").exists()
    prompt = load_prompts("edit/test")[0]
    pipe = _stock(fk)
    stock_pipeline_draws_the_lora(pipe, lambda: _edit(pipe, prompt, 5, 3), _model(fk), out / "lora",
                                  euler(prompt))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["naive_scaling", "compile", "naive_quant", "diffusionnft"])
def test_every_other_family_trains_the_editor(family, fk, clip, tmp_path, monkeypatch):
    from solrl_engine import hw
    from solrl_engine.cli import main

    monkeypatch.setattr(hw, "cxx_compiler", lambda *a, **k: None)
    out = tmp_path / family
    assert main(_train_args(fk, clip, out, family)) == 0
    two_iterations(out)


def test_a_prompt_set_that_does_not_fit_the_model_is_refused_before_any_weights_load(fk, clip, tmp_path,
                                                                                    monkeypatch):  # fmt: skip
    """An editor given text prompts, and a text-to-image model given an editing set: refused at the start of
    `solrl train`, naming the key, the set and the fix, before a model loads."""
    from solrl_engine import models
    from solrl_engine.cli import main

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models.ModelSpec, "build", no_load)
    with pytest.raises(SystemExit, match="train_prompts='sample/train': model=flux_kontext takes an image per "
                                         "prompt"):  # fmt: skip
        main(_train_args(fk, clip, tmp_path / "a", "sol_rl", "train_prompts=sample/train"))
    with pytest.raises(SystemExit, match="eval_prompts='edit/test': its prompts carry images, which model=flux "):
        main(["train", f"{ROOT}/configs/flux1.py:flux1_sol_rl_clipscore", "--output", str(tmp_path / "b"),
              "--set", "eval_prompts=edit/test", "--set", "device=cpu"])  # fmt: skip


def test_the_explorer_regenerates_edits_through_the_stock_pipeline(fk, clip):
    """Other trainers' path with an editing set: NVFP4 previews, then the selected seeds regenerated by the stock
    FluxKontextPipeline with each instruction's source (resized to the edit's size, kept there): each edit is the
    pipeline's for that source and seed called alone."""
    from solrl_engine.explore import Explorer
    from solrl_engine.rewards import load_reward

    prompts = load_prompts("edit/train")[:2]
    pipe = _stock(fk)
    reward = load_reward("clip_direction:1.0,preserve:0.5", {"clip_direction": {"model": str(clip)}})
    ex = Explorer(pipe, reward, n=3, k=2, preview_steps=2, explore_precision="nvfp4", resolution=SIZE, batch_size=4)
    sel = ex.select(prompts)
    regen = sel.regenerate(pipe, steps=2, batch_size=4)
    assert regen.images.shape == (4, 3, SIZE, SIZE) and regen.rewards.shape == (2, 2)
    for row, (prompt, seed) in enumerate([(p, s) for p, seeds in zip(prompts, sel.seeds, strict=True) for s in seeds]):
        torch.testing.assert_close(regen.images[row : row + 1], _edit(pipe, prompt, seed, 2), atol=1e-5, rtol=0)
