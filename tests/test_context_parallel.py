"""Context parallelism and sharded experts under torchrun (gloo), on a tiny two-expert WanPipeline of the real classes
(Wan2.2-A14B's layout) saved and loaded as a user's weights are: each forward's tokens split over a group of ranks
through diffusers' own hooks (Ulysses; ring needs a GPU attention kernel), composed with data parallelism and FSDP2,
equal a one-process run of the same config (the seeds selected, the losses, rewards, the held-out reward and both
experts' adapters), and a run checkpointed by two context-parallel ranks resumes in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_pipelines import SIZES, WAN_FRAMES, build_clip_reward, build_wan

from solrl_engine.cli import main

ROOT = Path(__file__).resolve().parents[1]
SIDE = SIZES["wan"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The pipeline, the CLIP reward and the one-process run every unsharded layout is compared with."""
    tmp = tmp_path_factory.mktemp("cp")
    wan22 = build_wan(tmp / "wan", two_experts=True)
    clip = build_clip_reward(tmp / "clip")
    one = tmp / "one"
    assert main(_args(wan22, clip, one)) == 0
    return wan22, clip, one


@pytest.fixture(scope="module")
def one_sharded(setup: tuple[Path, Path, Path]) -> Path:
    """The one-process run of sharding=fsdp, which the sharded layouts are compared with: a sharded LoRA policy
    samples its adapter unmerged, an unsharded one through a merged copy (FP32 rounding apart, enough to flip a
    close selection under other library versions)."""
    wan22, clip, one = setup
    out = one.with_name("one_fsdp")
    assert main(_args(wan22, clip, out, "sharding=fsdp")) == 0
    return out


def _args(wan22: Path, clip: Path, out: Path, *extra: str) -> list[str]:
    sets = [f"model_path={wan22}", f"resolution={SIDE}", f"width={SIDE}", f"frames={WAN_FRAMES}",
            f"reward_args=clipscore.model={clip}", "n=4", "k=2", "prompts_per_iter=2", "iterations=2",
            "preview_steps=1", "full_steps=2", "eval_prompt_count=2", "eval_seeds=1", "eval_every=2", "save_every=1",
            "rollout_batch_size=8", "train_batch_size=2", "lora_rank=4", "lora_alpha=8", "lr=1e-2",
            "explore_precision=int8", "device=cpu", "decode_batch_size=4", "reward_frames=3", "policy_dtype=float32",
            *extra]  # fmt: skip
    args = ["train", f"{ROOT}/configs/wan.py:wan13b_sol_rl_clipscore", "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def _torchrun(procs: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "-m", "solrl_engine.cli",
           *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _same_run(one: Path, other: Path, ranks: list[int]) -> None:
    from safetensors.torch import load_file

    from solrl_engine.rl.export import expert_weight_name

    a, b = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, other))
    assert [r["iter"] for r in b] == [1, 2] and [r["world_size"] for r in b] == ranks
    for ra, rb in zip(a, b, strict=True):
        assert ra["selection_digest"] == rb["selection_digest"]  # the same seeds selected for every prompt
        for key in ("reward_mean", "reward_std", "loss", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key
        # INT8 previews: row-wise activation scales, the same whatever part of the tokens or prompts a rank holds
        # (NVFP4's per-tensor scales see each rank's part, which moved the previews' mean by 1% and, on the floors'
        # library versions, flipped a close selection)
        assert rb["explore_reward_mean"] == pytest.approx(ra["explore_reward_mean"], rel=1e-3, abs=1e-5)
    assert b[-1]["heldout_reward"] == pytest.approx(a[-1]["heldout_reward"], rel=1e-4, abs=1e-6)
    for expert in ("transformer", "transformer_2"):
        wa, wb = (load_file(d / "lora" / expert_weight_name(expert)) for d in (one, other))
        assert wa.keys() == wb.keys()
        for k in wa:
            # Adam normalises each step: an element whose gradient is near zero may step a little otherwise when the
            # sums run in another order (7.6e-5 of the lr's 1e-2 seen once), the rest agree to rounding
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=5e-4)
            assert (wb[k] - wa[k]).abs().mean() < 2e-5, k


def test_two_ranks_splitting_each_clips_tokens_match_one_process(setup, tmp_path):
    """context_parallel=2: one data group of two ranks, each attention seeing half of a clip's 48 tokens."""
    wan22, clip, one = setup
    out = _torchrun(2, _args(wan22, clip, tmp_path / "cp", "context_parallel=2"), tmp_path)
    assert out.stderr.count("context_parallel=2 (ulysses)") == 2
    assert out.stderr.count("the first attention saw 24 tokens a sample on this rank") == 2
    assert "all_gather_tensor" not in out.stderr  # diffusers' deprecated-collective warning, once per forward
    _same_run(one, tmp_path / "cp", [2, 2])


def test_two_data_groups_of_two_context_parallel_ranks_with_fsdp_match_one_process(setup, one_sharded, tmp_path):
    """4 ranks: the data over 2 groups, each clip's tokens over the 2 ranks of a group, both experts' base weights
    FSDP-sharded over all 4. A micro-batch whose rows all drew one expert's timesteps leaves the other's LoRA without
    a gradient: summed over ranks it stays without one, so AdamW skips it as one process does (it used to get a zero
    gradient and step: 7e-3 apart in the high-noise adapter)."""
    wan22, clip, _ = setup
    out = _torchrun(4, _args(wan22, clip, tmp_path / "cp4", "context_parallel=2", "sharding=fsdp"), tmp_path)
    assert out.stderr.count("the data over 2 groups") == 4
    assert out.stderr.count("sharding=fsdp: 4 blocks over 4 ranks") == 4  # both experts' two blocks
    assert out.stderr.count("staged start-up: the base loaded on the CPU") == 4  # (rl/runtime.staged)
    _same_run(one_sharded, tmp_path / "cp4", [4, 4])


def test_sharded_experts_on_two_ranks_match_one_process(setup, one_sharded, tmp_path):
    wan22, clip, _ = setup
    out = _torchrun(2, _args(wan22, clip, tmp_path / "fsdp", "sharding=fsdp"), tmp_path)
    assert out.stderr.count("sharding=fsdp: 4 blocks over 2 ranks") == 2
    _same_run(one_sharded, tmp_path / "fsdp", [2, 2])


def test_a_context_parallel_checkpoint_resumes_in_one_process(setup, tmp_path):
    wan22, clip, one = setup
    split = tmp_path / "split"
    _torchrun(2, _args(wan22, clip, split, "context_parallel=2", "iterations=1"), tmp_path)
    assert main([*_args(wan22, clip, split), "--resume"]) == 0
    _same_run(one, split, [2, 1])


def test_what_context_parallelism_cannot_split_is_refused(setup, tmp_path):
    from solrl_engine.models import load_model
    from solrl_engine.rl.config import RLConfig
    from solrl_engine.rl.context_parallel import resolve_mode

    with pytest.raises(ValueError, match="context_parallel.*compiled sampler's captured graphs"):
        RLConfig(model="wan", family="compile", context_parallel=2).validate()
    with pytest.raises(ValueError, match="context_parallel.*built for LoRA runs"):
        RLConfig(model="wan", family="naive_scaling", train_mode="full", context_parallel=2).validate()
    with pytest.raises(ValueError, match="context_parallel_mode.*choose one of"):
        RLConfig(model="wan", context_parallel=2, context_parallel_mode="stripes").validate()
    wan22 = setup[0]
    m = load_model("wan", wan22, "cpu", torch.float32, resolution=SIDE, width=SIDE, frames=WAN_FRAMES)
    cpu = torch.device("cpu")
    assert resolve_mode(m.transformer, 2, "auto", cpu, 48) == "ulysses"
    with pytest.raises(ValueError, match="2 heads do not divide by it"):
        resolve_mode(m.transformer, 4, "ulysses", cpu, 48)
    with pytest.raises(ValueError, match="ring needs an attention kernel that returns the log-sum-exp.*ulysses"):
        resolve_mode(m.transformer, 4, "auto", cpu, 48)  # 2 heads: auto takes ring, which a CPU cannot run
    with pytest.raises(ValueError, match="47 tokens do not split evenly 2 ways"):
        resolve_mode(m.transformer, 2, "ulysses", cpu, 47)
    with pytest.raises(SystemExit, match="context_parallel = 2 does not divide the 1 ranks"):
        main(_args(wan22, setup[1], tmp_path / "x", "context_parallel=2"))


def test_the_memory_plan_splits_a_samples_activations_over_the_group(setup):
    from solrl_engine.rl import memplan
    from solrl_engine.rl.config import RLConfig

    def acts(cp: int) -> dict[str, float]:
        cfg = RLConfig(name="w", model="wan", model_path=str(setup[0]), resolution=SIDE, width=SIDE,
                       frames=WAN_FRAMES, train_batch_size=1, rollout_batch_size=2, context_parallel=cp)  # fmt: skip
        return {r.part: r for r in memplan.memory_plan(cfg, gpus=2).rows if r.part.endswith("activations")}

    one, two = acts(1), acts(2)
    with pytest.raises(ValueError, match="context_parallel = 2 does not divide 3 GPUs"):
        memplan.memory_plan(RLConfig(name="w", model="wan", model_path=str(setup[0]), resolution=SIDE, width=SIDE,
                                     frames=WAN_FRAMES, context_parallel=2), gpus=3)  # fmt: skip
    for part in ("update activations", "rollout activations"):
        assert two[part].gib == pytest.approx(one[part].gib / 2) and "its tokens over 2 ranks" in two[part].note
