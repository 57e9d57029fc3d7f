"""The update's sizes from the device (rl/sizing.py): train_batch_size=auto and gradient_checkpointing=auto, resolved
once at start from the memory plan, per-block recompute, the resolved values recorded, re-resolved on resume.

A GPU's memory is simulated on the CPU (memplan.device_memory_gib), at sizes the bundled model's plan makes bind."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from solrl_engine.cli import main
from solrl_engine.rl import memplan, sizing
from solrl_engine.rl.config import ConfigError, load_config
from solrl_engine.rl.memplan import HEADROOM, memory_plan, resolve_update_sizes
from solrl_engine.rl.sizing import choose, rows_per_slot
from solrl_engine.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes")


def _cfg(small_model: str, out: Path | str = "", **kw: object):
    base = dict(model_path=small_model, n=6, k=4, prompts_per_iter=2, iterations=1, preview_steps=2, full_steps=4,
                eval_every=1, eval_prompt_count=2, eval_seeds=1, save_every=1, lora_rank=4, lora_alpha=8, lr=1e-2,
                rollout_batch_size=16, train_batch_size="auto", gradient_checkpointing="auto", timestep_fraction=0.5,
                eval_train_prompt_count=0, explore_precision="nvfp4", policy_dtype="float32", device="cpu",
                output=str(out))  # fmt: skip
    base.update(kw)
    return load_config(SPEC, [f"{k}={v}" for k, v in base.items()])


def test_choose_prefers_the_largest_micro_batch_without_recompute_then_the_fewest_blocks():
    # the update holds 10 GiB besides activations; one sample 1 GiB, 0.2 with all 10 blocks recomputed
    args = dict(fixed=10.0, plain=1.0, recomputed=0.2, blocks=10, rows=48)
    assert choose(budget=100.0, **args) == (48, 0)  # every row of a slot in one micro-batch
    assert choose(budget=30.0, **args) == (20, 0)  # 10 + 20 x 1 = 30
    assert choose(budget=10.5, **args) == (1, 7)  # one sample needs 11: 10 + (1 - 7 x 0.08) = 10.44
    assert choose(budget=10.1, **args) is None  # 10.2 even with every block recomputed
    assert choose(budget=15.0, train_batch=8, **args) == (8, 5)  # a given micro-batch: recompute as needed
    assert choose(budget=15.0, recompute=10, **args) == (25, 10)  # a given recompute: the largest micro-batch
    assert choose(budget=5.0, train_batch=1, recompute=0, **args) is None


def test_rows_per_slot_is_a_ranks_share_of_one_group():
    cfg = load_config(SPEC, ["prompts_per_iter=8", "k=8", "updates_per_iter=3"])
    assert rows_per_slot(cfg, 1) == 22 and rows_per_slot(cfg, 2) == 11 and rows_per_slot(cfg, 64) == 1


def _one_sample(cfg, world: int = 1) -> tuple[float, float, float, int]:
    """(update memory besides activations, one sample's activations plain / all recomputed, blocks) of the plan."""
    plan = memory_plan(sizing.UpdateSizes(1, False, "").apply(cfg), world, 1000.0)
    plain, ckpt = plan.update_activations_gib["without"], plan.update_activations_gib["gradient_checkpointing"]
    return plan.total("update") - plain, plain, ckpt, plan.blocks


def test_auto_sizes_from_the_device_memory(small_model):
    cfg = _cfg(small_model)
    fixed, plain, ckpt, n = _one_sample(cfg)
    assert n == 1 and plain > ckpt > 0
    rows = rows_per_slot(cfg, 1)
    big = resolve_update_sizes(cfg, 1, 1000.0)
    assert (big.train_batch_size, big.recompute) == (rows, False) and "micro-batch 8 of 8" in big.reason
    mid = resolve_update_sizes(cfg, 1, (fixed + 3.5 * plain) / HEADROOM)
    assert (mid.train_batch_size, mid.recompute) == (3, False)
    tight = resolve_update_sizes(cfg, 1, (fixed + (plain + ckpt) / 2) / HEADROOM)
    assert (tight.train_batch_size, tight.recompute) == (1, True)  # one block in all: recompute it
    gib = (fixed + (plain + ckpt) / 2) / HEADROOM  # the update fits (the rollouts' phase is another matter here)
    assert memory_plan(tight.apply(cfg), 1, gib).total("update") <= HEADROOM * gib
    given = resolve_update_sizes(_cfg(small_model, train_batch_size=2), 1, (fixed + 2.5 * plain) / HEADROOM)
    assert (given.train_batch_size, given.recompute) == (2, False)  # auto recompute around a given micro-batch
    with pytest.raises(ConfigError, match="micro-batch of one sample does not fit the update"):
        resolve_update_sizes(cfg, 1, fixed / HEADROOM)  # before any weight loads
    with pytest.raises(ConfigError, match="train_batch_size=8 does not fit"):
        resolve_update_sizes(_cfg(small_model, train_batch_size=8), 1, (fixed + plain) / HEADROOM)
    # an explicit value always wins; a CPU (no device memory) takes the defaults
    assert resolve_update_sizes(_cfg(small_model, train_batch_size=5, gradient_checkpointing="true"), 1, 1e-9
                                ).apply(cfg).train_batch_size == 5  # fmt: skip
    cpu = resolve_update_sizes(cfg, 1, None)
    assert (cpu.train_batch_size, cpu.recompute) == (16, False) and "CPU" in cpu.reason


def test_no_plan_falls_back_to_the_defaults_with_a_warning(small_model, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("no fake tensors today")

    monkeypatch.setattr(memplan, "memory_plan", broken)
    with caplog.at_level(logging.WARNING, logger="solrl_engine.rl"):
        got = resolve_update_sizes(_cfg(small_model), 1, 80.0)
    assert (got.train_batch_size, got.recompute) == (16, False) and "no memory plan" in caplog.text


def test_partial_recompute_runs_the_chosen_blocks_and_changes_no_result(small_model, tmp_path, monkeypatch):
    """Three of six blocks recomputed: each training forward checkpoints exactly those, and the run's adapters equal a
    run without recompute bit for bit (FP32, the same micro-batch); another micro-batch changes its loss and gradient
    norm by rounding only (AdamW's steps would magnify that rounding in near-zero gradients, so not the adapters)."""
    calls: list[int] = []
    real = torch.utils.checkpoint.checkpoint

    def counted(fn, *args, **kw):  # noqa: ANN001, ANN202
        calls.append(id(fn.__self__))
        return real(fn, *args, **kw)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    from solrl_engine.models.tiny import TinyConfig, TinyT2I

    torch.manual_seed(0)
    six = tmp_path / "six"
    TinyT2I(TinyConfig(num_layers=6, heads=2, head_dim=16, text_dim=32, text_layers=1)).save(six)
    runs = {}
    for name, tb, gc in (("recompute", 1, 3), ("plain", 1, False), ("batch4", 4, False)):
        tr = Trainer(_cfg(str(six), tmp_path / name, train_batch_size=tb, gradient_checkpointing=gc), progress=False)
        calls.clear()
        tr.run()
        blocks = tr.model.transformer.transformer_blocks
        if gc:
            assert set(calls) == {id(b) for b in blocks[:3]}  # the first three, and only they
            assert len(calls) == 3 * 8 * 2  # per block: 8 samples x 2 timestep slots, one sample a micro-batch
        else:
            assert calls == []
        runs[name] = ([json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()],
                      tr.adapters.state_dict())  # fmt: skip
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert (saved["train_batch_size"], saved["gradient_checkpointing"]) == (tb, gc)
    (ra, sa), (_rb, sb), (rc, _) = runs["recompute"], runs["plain"], runs["batch4"]
    for key in sa:
        for n in sa[key]:
            assert torch.equal(sa[key][n], sb[key][n]), (key, n)
    for a, c in zip(ra, rc, strict=True):
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(c["grad_norm"], rel=1e-5)


def test_the_trainer_resolves_at_start_records_it_and_re_resolves_on_resume(small_model, tmp_path, monkeypatch,
                                                                         caplog):  # fmt: skip
    out = tmp_path / "run"
    small = _cfg(small_model, rollout_batch_size=2)  # (the rollouts' activations stay below the update's)
    fixed, plain, _, _ = _one_sample(small)
    assert max(memory_plan(small, 1, 1000.0).total(w) for w in ("rollout", "start", "refresh")) < fixed + 2 * plain
    monkeypatch.setattr(memplan, "device_memory_gib", lambda device: (fixed + 2.5 * plain) / HEADROOM)
    tr = Trainer(_cfg(small_model, out, rollout_batch_size=2), progress=False)
    assert (tr.cfg.train_batch_size, tr.cfg.gradient_checkpointing) == (2, False)
    tr.run()
    saved = json.loads((out / "config.json").read_text())
    assert (saved["train_batch_size"], saved["gradient_checkpointing"]) == (2, False)
    monkeypatch.setattr(memplan, "device_memory_gib", lambda device: 1000.0)  # a larger GPU
    with caplog.at_level(logging.INFO, logger="solrl_engine.rl"):
        again = Trainer(_cfg(small_model, out, iterations=2, rollout_batch_size=2), progress=False)
        again.run(resume=True)
    assert again.cfg.train_batch_size == 8 and again.iteration == 2
    assert "resuming with train_batch_size=8 (the checkpoint ran with train_batch_size=2)" in caplog.text


def test_solrl_plan_prints_the_resolved_sizes(small_model, capsys):
    assert main(["plan", SPEC, "--set", f"model_path={small_model}", "--set", "train_batch_size=auto",
                 "--gpu-memory", "80"]) == 0  # fmt: skip
    out = capsys.readouterr().out  # the preset's 8 prompts x K = 8 on one GPU: 64 rows a timestep slot
    assert "update sizes: auto micro-batch 64 of 64 rows a slot, auto recompute of 0 of 1 blocks" in out


@pytest.mark.parametrize(("key", "value", "match"), [
    ("train_batch_size", "0", "train_batch_size = 0: must be a number of samples >= 1, or auto"),
    ("train_batch_size", "many", "train_batch_size = 'many'"),
    ("gradient_checkpointing", "-1", "gradient_checkpointing = -1: true"),
    ("gradient_checkpointing", "sometimes", "gradient_checkpointing = 'sometimes'"),
])  # fmt: skip
def test_bad_sizes_are_refused_naming_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SPEC, [f"{key}={value}"])
