"""torchrun --nproc_per_node 2 (gloo) on the bundled model's architecture: the same selected seeds,
global advantage statistics, metrics and final adapter as a one-process run of the same config (two
optimizer steps per iteration, each on a random half of the global batch that spans both ranks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_branches import tolerance

from solrl_engine.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _args(small_model: str, out: Path, dtype: torch.dtype, mode: str = "lora") -> list[str]:
    sets = [f"model_path={small_model}", "n=6", "k=4", "prompts_per_iter=4", "iterations=2", "preview_steps=2",
            "full_steps=4", "eval_every=2", "eval_prompt_count=3", "eval_seeds=1", "save_every=1", "lora_rank=4",
            "lora_alpha=8", "lr=1e-2", "rollout_batch_size=16", "train_batch_size=4",
            "timestep_fraction=0.5", "explore_precision=nvfp4", "updates_per_iter=2",
            "eval_train_prompt_count=3", f"policy_dtype={str(dtype).removeprefix('torch.')}"]  # fmt: skip
    if mode.startswith("full"):  # every weight trained (rl/full.py), at a full FT's rate
        sets += ["train_mode=full", "lr=1e-3"]
    if mode in ("fsdp", "full-fsdp", "fsdp-xs", "full-fsdp-xs"):  # FSDP2-sharded over the ranks (rl/sharding.py)
        sets += ["sharding=fsdp"]  # (one process: the same paths, nothing to shard over)
    if mode.endswith("-xs"):  # the explore copy's blocks split over the ranks too, gathered in its forwards
        sets += ["explore_sharding=shard"]
    if mode.startswith("full-fsdp"):  # gradient checkpointing: each block recomputed (and gathered) in backward
        sets += ["gradient_checkpointing=true"]
    if mode == "full-hsdp":  # HSDP: groups of one rank ("nodes" of one GPU), replicated across the two
        sets += ["sharding=hsdp", "shard_group_size=1"]
    if mode == "flow_grpo":  # another objective: SDE regenerations, their states split over the ranks
        sets += ["objective=flow_grpo", "kl_beta=0.04", "clip_range=0.2"]
    args = ["train", str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes"), "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.mark.parametrize(("dtype", "mode"), [(torch.float32, "lora"), (torch.bfloat16, "lora"),
                                             (torch.float32, "full"), (torch.float32, "fsdp"),
                                             (torch.float32, "full-fsdp"), (torch.float32, "full-hsdp"),
                                             (torch.float32, "flow_grpo"), (torch.float32, "fsdp-xs"),
                                             (torch.float32, "full-fsdp-xs")],
                         ids=["fp32", "bf16", "full-fp32", "fsdp-fp32", "full-fsdp-fp32",
                              "full-hsdp-fp32", "flow-grpo-fp32", "fsdp-explore-sharded-fp32",
                              "full-fsdp-explore-sharded-fp32"])  # fmt: skip
def test_torchrun_two_ranks_match_one_process(small_model, tmp_path, dtype, mode):
    """Both policy dtypes the CPU's detection can pick (set explicitly: the ranks are other processes),
    with tolerances set by the dtype (tests/cpu_branches.py): BF16 sums in another order differ by
    a few of its rounding steps; full fine-tuning (train_mode=full), every weight's gradient summed; and
    sharding=fsdp, the base weights FSDP2-sharded (each rank holds half; its micro-batch counts differ and are
    padded, the end-of-run picture is sampled on both ranks); and full fine-tuning sharded (every weight, its
    gradients reduce-scattered and summed, AdamW's state and the old / reference / EMA sets in shards)."""
    one, two = tmp_path / "one", tmp_path / "two"
    tol = tolerance(dtype)
    assert main(_args(small_model, one, dtype, mode)) == 0
    # `solrl` from this tree (not an installed copy) on every rank
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "solrl_engine.cli",
           *_args(small_model, two, dtype, mode)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    if mode in ("fsdp", "full-fsdp", "fsdp-xs", "full-fsdp-xs"):  # what ran: each rank holds half of the weights
        held = re.findall(r"sharding=fsdp: 1 blocks over 2 ranks; this rank holds ([\d.]+) of ([\d.]+) MiB of "
                          + ("trained" if mode.startswith("full") else "base"), out.stderr)
        assert len(held) == 2 and all(float(a) < 0.6 * float(b) for a, b in held), out.stderr[-2000:]
    if mode.endswith("-xs"):  # and half of the explore copy's blocks, gathered for each forward and refresh
        held = re.findall(r"explore_sharding=shard: the explore copy's \d+ blocks over 2 ranks; this rank holds "
                          r"([\d.]+) of ([\d.]+) MiB", out.stderr)
        assert len(held) == 2 and all(float(a) < 0.6 * float(b) for a, b in held), out.stderr[-2000:]
    if mode in ("fsdp", "full-fsdp", "full-hsdp"):  # every rank's start-up staged (on a CPU nothing needs moving)
        assert out.stderr.count("staged start-up: the base loaded on the CPU") == 2, out.stderr[-2000:]
    if mode == "full-hsdp":  # what ran: a 2-D mesh, each rank a group of one holding everything, two replicas
        held = re.findall(r"sharding=hsdp: 1 blocks over groups of 1 of the 2 ranks; this rank holds ([\d.]+) of "
                          r"([\d.]+) MiB of trained", out.stderr)
        assert len(held) == 2 and all(a == b for a, b in held), out.stderr[-2000:]
    assert not (two / ".solrl.lock").exists()  # rank 0 held the run's lock for the job, and let it go
    # writing the LoRA imports SD3's pipeline, whose SigLIP processor transformers warns about without
    # torchvision: nothing a user of the run can act on, so it stays off the progress bar
    assert "requires torchvision" not in out.stderr
    a = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in b] == [1, 2] and [r["world_size"] for r in b] == [2, 2]
    for ra, rb in zip(a, b, strict=True):
        assert ra["selection_digest"] == rb["selection_digest"]  # the same seeds selected for every prompt
        for key in ("reward_mean", "reward_std", "loss", "policy_loss", "kl", "grad_norm", "proxy_spearman"):
            assert rb[key] == pytest.approx(ra[key], **tol), key
        # previews differ by float rounding only (activation scales see a different batch)
        assert rb["explore_reward_mean"] == pytest.approx(ra["explore_reward_mean"], rel=1e-2, abs=1e-4)
    assert b[-1]["heldout_reward"] == pytest.approx(a[-1]["heldout_reward"], **tol)
    assert b[-1]["train_prompt_reward"] == pytest.approx(a[-1]["train_prompt_reward"], **tol)
    from safetensors.torch import load_file

    name = FILES[mode]
    wa, wb = load_file(one / name), load_file(two / name)
    assert wa.keys() == wb.keys()
    for k in wa:
        if dtype == torch.float32:
            # Flow-GRPO (coupled SDE previews since 2026-11-29, so other seeds than ODE previews select): the
            # two runs' weights differ by up to 4e-6 (lora_B, |w| ~0.02), where ODE previews' stayed within 1e-6;
            # the selection, losses and rewards agree within the tolerances above
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5 if mode == "flow_grpo" else 1e-6)
        else:  # Adam steps from BF16 gradients: an element whose gradient is near zero may step otherwise,
            # and lora_B, zero at the start, is only four steps long (1-2% apart measured; 5% allowed)
            assert (wb[k] - wa[k]).norm() <= 5e-2 * wa[k].norm(), k


FILES = {"lora": "lora/pytorch_lora_weights.safetensors", "fsdp": "lora/pytorch_lora_weights.safetensors",
         "flow_grpo": "lora/pytorch_lora_weights.safetensors",
         "full": "transformer/diffusion_pytorch_model.safetensors",
         "full-fsdp": "transformer/diffusion_pytorch_model.safetensors",
         "full-hsdp": "transformer/diffusion_pytorch_model.safetensors",
         "fsdp-xs": "lora/pytorch_lora_weights.safetensors",
         "full-fsdp-xs": "transformer/diffusion_pytorch_model.safetensors"}  # what each mode exports


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "solrl_engine.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


@pytest.mark.parametrize(("first", "mode"), [(2, "lora"), (1, "lora"), (2, "fsdp"), (1, "fsdp"), (2, "full-fsdp"),
                                            (1, "full-fsdp"), (2, "full-hsdp")],
                         ids=["2-then-1", "1-then-2", "fsdp-2-then-1", "fsdp-1-then-2", "full-fsdp-2-then-1",
                              "full-fsdp-1-then-2", "full-hsdp-2-then-1"])  # fmt: skip
def test_a_checkpoint_resumes_on_another_number_of_ranks(small_model, tmp_path, first, mode):
    """A run checkpointed at iteration 1 by `first` processes resumes on the other count and ends with the
    metrics and adapter of a one-process run that never stopped (the run depends on `seed`, not on the
    world size; the checkpoint holds the global state: rank 0 writes it, every rank reads it). Sharded
    (sharding=fsdp) too: the adapters are whole on every rank, so its checkpoint is the same format; and sharded
    full fine-tuning, whose ranks write their shards of every weight set and of AdamW's state through
    torch.distributed.checkpoint (sealed in the same manifest), resharded on load. (Not across sharding
    settings: a sharded LoRA policy samples unmerged, an unsharded one through a merged copy.)"""
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(_args(small_model, whole, torch.float32, mode)) == 0
    part = _args(small_model, split, torch.float32, mode) + ["--set", "iterations=1"]
    rest = _args(small_model, split, torch.float32, mode) + ["--resume"]
    for args, procs in ((part, first), (rest, 3 - first)):
        if procs == 1:
            assert main(args) == 0
        else:
            out = _torchrun(args, tmp_path)
            assert out.returncode == 0, out.stderr[-4000:]
        if mode in ("full-fsdp", "full-hsdp") and args is part:  # DCP shards, sealed with rank 0's state
            _check_sharded_checkpoint(split / "checkpoints" / "iter_000001", procs, tmp_path)
    a = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in b] == [1, 2] and [r["world_size"] for r in b] == [first, 3 - first]
    tol = tolerance(torch.float32)
    for ra, rb in zip(a, b, strict=True):
        assert ra["selection_digest"] == rb["selection_digest"]
        for key in ("reward_mean", "reward_std", "loss", "policy_loss", "kl", "grad_norm", "proxy_spearman"):
            assert rb[key] == pytest.approx(ra[key], **tol), (rb["iter"], key)
    assert b[-1]["heldout_reward"] == pytest.approx(a[-1]["heldout_reward"], **tol)
    from safetensors.torch import load_file

    wa, wb = load_file(whole / FILES[mode]), load_file(split / FILES[mode])
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)


def _check_sharded_checkpoint(ck: Path, ranks: int, tmp: Path) -> None:
    """A sharded full fine-tuning checkpoint: torch.distributed.checkpoint's files, one per rank, beside rank 0's
    state, every one in the manifest; the weights are not in rank 0's tensors file; a flipped byte in a shard
    fails verification, so a resume falls back instead of loading it."""
    import shutil

    from safetensors import safe_open

    from solrl_engine.store import checkpoint

    shards = sorted(p.name for p in ck.glob("*.distcp"))
    assert len(shards) == ranks and (ck / ".metadata").is_file(), sorted(p.name for p in ck.iterdir())
    listed = set(json.loads((ck / "MANIFEST.json").read_text())["files"])
    assert {*shards, ".metadata", "state.json", "tensors.safetensors"} <= listed
    with safe_open(str(ck / "tensors.safetensors"), "pt") as f:
        assert not any(k.startswith(("adapters/", "opt/")) for k in f.keys())
    assert checkpoint.verify(ck).status == "ok"
    bad = tmp / "damaged" / ck.name
    shutil.copytree(ck, bad)
    data = bytearray((bad / shards[0]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / shards[0]).write_bytes(bytes(data))
    v = checkpoint.verify(bad)
    assert v.status == "damaged" and shards[0] in v.detail
    # DCP reads its index with pickle: ours unpickles only the index's types, so a planted one never runs
    import pickle

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (Path.touch, (tmp / "pwned",))

    (bad / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata is refused"):
        checkpoint.dcp_reader(bad).read_metadata()
    assert not (tmp / "pwned").exists()
    # a dotted name inside an allowed module reaches its imports (metadata.os.getcwd): refused too
    mod, name = b"torch.distributed.checkpoint.metadata", b"os.getcwd"
    dotted = b"\x80\x04\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(name)]) + name + b"\x93)R."
    assert pickle.loads(dotted)  # what plain pickle (DCP's own reader) would do: call it
    (bad / ".metadata").write_bytes(dotted)
    with pytest.raises(checkpoint.CheckpointError, match="os.getcwd is not part of a checkpoint index"):
        checkpoint.dcp_reader(bad).read_metadata()
    assert type(checkpoint.dcp_reader(ck).read_metadata()).__name__ == "Metadata"


def test_the_config_refuses_what_a_sharded_run_cannot_do():
    from solrl_engine.rl.config import ConfigError, RLConfig

    with pytest.raises(ConfigError, match="sharding.*none.*fsdp"):
        RLConfig(model="tiny", sharding="zero3").validate()
    with pytest.raises(ConfigError, match="family.*sharded policy.*sol_rl or naive_scaling"):
        RLConfig(model="tiny", sharding="fsdp", family="compile").validate()
    RLConfig(model="tiny", sharding="fsdp").validate()  # LoRA, sol_rl: accepted
    RLConfig(model="tiny", sharding="fsdp", train_mode="full").validate()  # full fine-tuning sharded: accepted
    RLConfig(model="tiny", sharding="hsdp", shard_group_size=4).validate()
    with pytest.raises(ConfigError, match="shard_group_size.*sharding=hsdp"):
        RLConfig(model="tiny", sharding="fsdp", shard_group_size=4).validate()


def test_a_sharded_model_without_repeated_blocks_is_refused_with_the_fix():
    from solrl_engine.rl.distributed import Dist
    from solrl_engine.rl.sharding import shard_policy

    with pytest.raises(ValueError, match="repeated_blocks"):
        shard_policy(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("NoSuchBlock",), [], Dist(0, 2), torch.device("cpu"))
