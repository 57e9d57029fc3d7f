"""A run resolved once (rl/runtime.resolve -> RunPlan): what the trainer, `solrl plan` and the GPU session read
instead of re-deriving. The explore pass as it can resolve at start comes from explore.plan.foresee, and the memory
plan counts the largest of those copies without reading explore_precision itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from solrl_engine.explore import choice
from solrl_engine.explore.plan import ExploreSettings, foresee
from solrl_engine.models import model_spec
from solrl_engine.rl import memplan
from solrl_engine.rl.config import RLConfig
from solrl_engine.rl.runtime import Target, resolve

ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes")
SIZED = {"train_batch_size": 16, "gradient_checkpointing": False}  # (the sizing has its own tests)


def _precisions(plan_or_specs) -> list[str]:
    specs = plan_or_specs.explore if hasattr(plan_or_specs, "explore") else plan_or_specs
    return [e.precision for e in specs]


def test_auto_is_foreseen_as_the_formats_of_the_gpu_it_runs_on_and_the_policy():
    """sm_100: NVFP4 first; sm_90: FP8 and INT8; sm_80: INT8; no tensor cores: the policy only. A GPU of unknown
    architecture: every GPU format. A set precision: itself, with the family's rule for its format."""
    tiny, auto = model_spec("tiny"), ExploreSettings()
    assert _precisions(foresee(auto, tiny, (10, 0))) == ["nvfp4", "fp8", "int8", choice.POLICY]
    assert _precisions(foresee(auto, tiny, (9, 0))) == ["fp8", "int8", choice.POLICY]
    assert _precisions(foresee(auto, tiny, (8, 0))) == ["int8", choice.POLICY]
    assert _precisions(foresee(auto, tiny, (7, 5))) == [choice.POLICY]
    assert _precisions(foresee(auto, tiny, None)) == ["nvfp4", "fp8", "int8", choice.POLICY]
    assert _precisions(foresee(auto, tiny, None, gpu=False)) == [*choice.EXPLORE_CANDIDATES, choice.POLICY]
    (one,) = foresee(ExploreSettings("int8"), tiny, (10, 0))
    assert one.precision == "int8" and one.rule == {**tiny.explore_rule, **tiny.explore_rule_by_format.get("int8", {})}
    # NVFP4's options are dropped from the 8-bit candidates, as `plan` drops them when auto chooses 8 bits
    rht = {e.precision: e for e in foresee(ExploreSettings(rht=16), tiny, (10, 0))}
    assert rht["nvfp4"].rule.get("rht") == 16 and "rht" not in rht["fp8"].rule and rht["fp8"].dropped == ("rht",)
    (te,) = foresee(ExploreSettings("te_nvfp4"), tiny, (10, 0))
    assert te.storage == "nvfp4" and te.built_from_whole_copy and not one.built_from_whole_copy


def test_the_memory_plan_counts_the_largest_copy_it_is_given():
    """The plan reads the specs, not explore_precision: an FP8 copy stores more than an NVFP4 one, and auto on
    a Blackwell GPU is planned as its largest candidate (8 bits), with auto's probe counted."""
    cfg = RLConfig(name="t", model="tiny", **SIZED)
    tiny = model_spec("tiny")

    def copy_row(explore):
        plan = memplan.memory_plan(cfg, gpu_gib=80.0, explore=explore)
        return {r.part: r for r in plan.rows}

    fp8 = copy_row(foresee(ExploreSettings("fp8"), tiny, None))
    nvfp4 = copy_row(foresee(ExploreSettings("nvfp4"), tiny, None))
    assert fp8["explore copy"].gib > nvfp4["explore copy"].gib
    assert "auto's timing probe" not in fp8
    b200 = copy_row(foresee(ExploreSettings(), tiny, (10, 0)))
    assert b200["explore copy"].gib == pytest.approx(max(fp8["explore copy"].gib, copy_row(
        foresee(ExploreSettings("int8"), tiny, None))["explore copy"].gib))  # fmt: skip
    assert "the largest of nvfp4, fp8, int8" in b200["explore copy"].note and "auto's timing probe" in b200
    assert "explore copy" not in copy_row(())  # the policy explores: no copy


def test_resolve_on_this_cpu_and_for_a_gpu_it_is_told_about(monkeypatch):
    """On a CPU: the documented default sizes, no memory plan, every CPU candidate foreseen. For a GPU named by
    its memory and capability: sizes from its memory, the plan made with the foreseen copies, and its check
    refuses what does not fit (memory_check=false does not)."""
    cfg = RLConfig(name="t", model="tiny", device="cpu")
    here = resolve(cfg)
    assert here.target.device.type == "cpu" and here.memory is None and here.target.describe() == "this CPU"
    assert (here.cfg.train_batch_size, here.cfg.gradient_checkpointing) == (16, False)
    assert _precisions(here) == [*choice.EXPLORE_CANDIDATES, choice.POLICY]
    assert here.update.kl_beta == cfg.kl_beta and here.rollouts.full_steps == cfg.full_steps
    here.check()  # nothing to check on a CPU
    h100 = resolve(cfg, Target.gpu(80.0, 2, (9, 0)))
    assert h100.dtype == torch.bfloat16 and h100.memory is not None and h100.memory.fits
    assert _precisions(h100) == ["fp8", "int8", choice.POLICY] and h100.cfg.train_batch_size != "auto"
    assert h100.memory.update_sizes == h100.sizes.reason and "2 x 80 GiB GPUs (sm_90)" in h100.lines()[0]
    h100.check()
    naive = resolve(RLConfig(name="t", model="tiny", family="naive_scaling"), Target.gpu(80.0))
    assert naive.explore == () and "explore copy" not in {r.part for r in naive.memory.rows}
    tiny_gpu = resolve(RLConfig(name="t", model="tiny", **SIZED), Target.gpu(0.05))
    with pytest.raises(memplan.ConfigError, match="memory plan does not fit"):
        tiny_gpu.check()
    off = resolve(RLConfig(name="t", model="tiny", memory_check=False, **SIZED), Target.gpu(0.05))
    assert off.memory is None  # no plan made where nobody reads it
    off.check()
    shown = resolve(RLConfig(name="t", model="tiny", memory_check=False, **SIZED), Target.gpu(0.05), show=True)
    assert shown.memory is not None and not shown.memory.fits


def test_the_trainer_reads_its_plan_and_ends_with_a_foreseen_explore(small_model, tmp_path, monkeypatch):
    """The trainer's sizes, update settings and rollout settings are its plan's; auto's timed answer at start is one
    of the precisions the plan foresaw."""
    from solrl_engine.rl.trainer import Trainer

    monkeypatch.setattr(choice, "probe_explore_timings", lambda *a, **k: {"policy": 1.0, "nvfp4": 5.0, "fp8": 0.5})
    cfg = RLConfig(name="p", model="tiny", model_path=small_model, device="cpu", policy_dtype="float32",
                   n=4, k=2, prompts_per_iter=2, preview_steps=2, full_steps=3, iterations=1, eval_prompt_count=2,
                   eval_seeds=1, rollout_batch_size=8, output=str(tmp_path / "run"))  # fmt: skip
    tr = Trainer(cfg, progress=False)
    assert tr.cfg is tr.plan.cfg and tr.update_settings is tr.plan.update and tr.rollouts.settings is tr.plan.rollouts
    assert tr.cfg.train_batch_size == 16 and tr.explore_spec.precision == "fp8"
    assert tr.explore_spec.precision in _precisions(tr.plan)


def test_solrl_plan_prints_what_it_resolved_for_the_gpu_it_is_told_about(tmp_path, capsys):
    from solrl_engine.cli import main

    assert main(["plan", SPEC, "--gpu-memory", "141", "--sm", "90", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "run plan for tiny_sol_rl_shapes on 1 x 141 GiB GPU (sm_90)" in out
    assert "explore: one of fp8, int8, policy" in out and "planned as fp8, the largest of fp8, int8" in out
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["fits"] and d["run"]["capability"] == [9, 0] and d["run"]["gpu_gib"] == 141
    assert [e["precision"] for e in d["run"]["explore"]] == ["fp8", "int8", "policy"]
    with pytest.raises(SystemExit, match="compute capability"):
        main(["plan", SPEC, "--sm", "h100"])
    assert main(["plan", SPEC, "--gpu-memory", "80", "--sm", "10.0"]) == 0  # torch's spelling
    assert "on 1 x 80 GiB GPU (sm_100)" in capsys.readouterr().out


def test_a_format_or_attention_the_gpu_cannot_run_fast_is_refused_at_plan_time_naming_what_it_runs():
    """explore_precision=fp8 on an A100 (no FP8 GEMM there: every layer would run the reference) and INT8 attention
    on a Turing GPU are refused before anything loads, with the reason and the formats the GPU runs; NVFP4 on Hopper
    (Triton's in-kernel decode), INT8 on Ampere, auto and bf16 anywhere, and anything on a CPU are not; a family
    that explores with the policy is never asked."""
    from solrl_engine.rl.config import ConfigError

    def plan(sm: tuple[int, int], **changes: object) -> object:
        cfg = RLConfig(model="tiny", device="cpu", **{**SIZED, **changes})  # type: ignore[arg-type]
        return resolve(cfg, Target.gpu(80, 1, sm))

    with pytest.raises(ConfigError, match=r"explore_precision = 'fp8': sm_80 runs no FP8 E4M3 GEMM fast \(needs "
                                          r"sm_89\+\); this GPU runs int8, auto"):
        plan((8, 0), explore_precision="fp8")
    with pytest.raises(ConfigError, match=r"explore_precision = 'nvfp4': sm_80 .* this GPU runs int8"):
        plan((8, 0), explore_precision="nvfp4")
    with pytest.raises(ConfigError, match=r"explore_attention = 'int8': sm_75 has no INT8 tensor cores .* choose bf16"):
        plan((7, 5), explore_attention="int8")
    for sm, prec in (((9, 0), "nvfp4"), ((8, 0), "int8"), ((7, 5), "auto"), ((7, 5), "bf16"), ((9, 0), "fp8")):
        plan(sm, explore_precision=prec)
    plan((8, 0), explore_attention="int8")
    plan((8, 0), explore_precision="fp8", family="diffusionnft", n=24)  # the policy explores: no copy to run
    resolve(RLConfig(model="tiny", device="cpu", explore_precision="fp8", **SIZED), Target.here(RLConfig(model="tiny",
                                                                                                     device="cpu")))
