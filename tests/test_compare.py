"""The before/after picture every run leaves (OUT/compare.png) and `solrl eval --compare-base`: the base
model and the trained adapter on the same prompts and seeds, side by side, with each image's reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from solrl_engine.cli import main
from solrl_engine.evaluation import Comparison, EvalResult, compare_figure, spread
from solrl_engine.rl.heldout import compare_adapters
from solrl_engine.viz import pair_grid

ROOT = Path(__file__).resolve().parents[1]
SETS = ["n=6", "k=4", "prompts_per_iter=2", "preview_steps=2", "full_steps=4", "iterations=2", "eval_every=2",
        "eval_prompt_count=5", "eval_seeds=1", "eval_train_prompt_count=0", "save_every=2", "lora_rank=4",
        "lora_alpha=8", "lr=5e-2", "rollout_batch_size=16", "train_batch_size=4", "timestep_fraction=0.5",
        "explore_precision=nvfp4"]  # fmt: skip


def _sets(small_model: str) -> list[str]:
    return [f"--set={s}" for s in [f"model_path={small_model}", *SETS]]


def test_pair_grid_sizes_tiles_for_the_resolution():
    caps = ["0.5", "0.6"]
    small = pair_grid(torch.rand(2, 3, 32, 32), torch.rand(2, 3, 32, 32), caps, caps, ["a", "b"], tile=192)
    big = pair_grid(torch.rand(2, 3, 1024, 1024), torch.rand(2, 3, 1024, 1024), caps, caps, ["a", "b"], tile=192)
    assert small.size == big.size  # 32 px upscaled 6x, 1024 px downscaled: the same 192 px tiles
    assert 4 * 192 < small.width < 4 * 192 + 100  # two pairs of two tiles in a row, with gaps
    img = torch.zeros(1, 3, 32, 32)
    img[..., :16] = 1.0  # left half white: nearest upscaling keeps the edge sharp
    g = pair_grid(img, img, ["x"], ["y"], ["p"], header="", tile=192)
    row = [g.getpixel((14 + x, 20 + 20))[0] for x in range(0, 192, 8)]  # first tile (gap 14, labels 20)
    assert row[:12] == [255] * 12 and row[12:] == [0] * 12
    with pytest.raises(ValueError, match="per pair"):
        pair_grid(torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8), caps, caps, ["only one"])


def test_the_picture_spreads_its_prompts_over_the_set():
    assert spread(64, 8) == [0, 8, 16, 24, 32, 40, 48, 56]  # the held-out set's kinds in proportion
    assert spread(5, 8) == [0, 1, 2, 3, 4] and spread(9, 2) == [0, 4]


def test_the_comparison_gain_is_paired_and_its_line_names_the_picture():
    prompts = [f"prompt {i}" for i in range(12)]
    base = EvalResult(prompts, [0] * 12, torch.rand(12, 3, 8, 8), torch.linspace(0, 1, 12))
    trained = EvalResult(prompts, [0] * 12, torch.rand(12, 3, 8, 8), torch.linspace(0, 1, 12) + 0.1)
    cmp = Comparison(base, trained)
    assert cmp.gain[0] == pytest.approx(0.1) and cmp.gain[1] == pytest.approx(0.0, abs=1e-6)
    assert "x.png" in cmp.line("x.png") and "+0.100" in cmp.line("x.png")  # names the file and the gain
    fig = compare_figure(cmp, "h", max_pairs=8)
    assert fig.height > 0 and fig.width > 0


def test_a_run_ends_with_compare_png_of_the_base_and_its_ema_adapter(small_model, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes"), "--output", str(out),
                 *_sets(small_model), "--set=log_with=tensorboard"]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compare_png"] == str(out / "compare.png") and (out / "compare.png").exists()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"before/after: {out / 'compare.png'}")
    assert f"paired gain {summary['heldout_gain_final']:+.3f} +- {summary['heldout_gain_stderr_final']:.3f}" in last
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert "eval/compare" in acc.Tags()["images"]

    # --compare-base: the same picture for any adapter, its base evaluated on the same prompts and seeds
    ev = tmp_path / "eval"
    args = ["eval", str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes"), "--max-prompts", "3", "--seeds", "2",
            "--output", str(ev), *_sets(small_model)]  # fmt: skip
    assert main([*args, "--lora", str(out / "lora_ema"), "--compare-base"]) == 0
    res = json.loads((ev / "eval.json").read_text())
    assert (ev / "compare.png").exists() and res["n"] == 6
    assert res["paired_gain"] == pytest.approx(res["reward_mean"] - res["base_reward_mean"], abs=1e-6)
    recs = [json.loads(x) for x in (ev / "samples.jsonl").read_text().splitlines()]
    assert all("base_reward" in r for r in recs) and any(r["reward"] != r["base_reward"] for r in recs)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"before/after: {ev / 'compare.png'}")
    with pytest.raises(SystemExit, match="--lora"):
        main([*args, "--compare-base"])


def test_the_base_in_the_picture_is_the_base_the_run_started_from(small_model, tmp_path):
    """compare.png regenerates the base with the adapters off: the same rewards as the run's first
    evaluation (iteration 0: the untrained adapter), image for image."""
    from solrl_engine.rl.config import load_config
    from solrl_engine.rl.trainer import Trainer

    sets = [s.removeprefix("--set=") for s in _sets(small_model)] + [f"output={tmp_path}"]
    tr = Trainer(load_config(str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes"), sets), progress=False)
    tr.run()
    cmp = compare_adapters(tr.rollouts, tr.adapters, tr.eval_prompts)
    assert torch.equal(cmp.base.rewards, tr.eval_base)  # eval_seeds=1: one image per prompt, same order
    assert not torch.equal(cmp.trained.rewards, cmp.base.rewards)
    assert cmp.gain[0] == pytest.approx(tr.gains[-1][1], abs=1e-6)  # the last evaluation was of this EMA
