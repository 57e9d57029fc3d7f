"""Hostile and careless inputs: a run directory planted with links, FIFOs, devices and forged manifests or
indexes, a model directory passed as --output, NaN weights and rewards, bad values that used to pass, and
prompts that fail late. Each probe is answered with one clear line; nothing outside the run is touched,
nothing is lost, no non-finite number is ranked, written as JSON or ends with exit 0."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from test_trust import SPEC, _argv

from solrl_engine.cli import main
from solrl_engine.rl import ConfigError, load_config
from solrl_engine.store import checkpoint, rundir
from solrl_engine.store.checkpoint import MANIFEST, STATE, TENSORS
from solrl_engine.store.safe import Unsafe, fresh_dir, json_text, read_regular, replacing, write_atomic

ITERS = 2


@pytest.fixture(scope="module")
def finished(small_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run (checkpoints iter_000001 and iter_000002): each test works on a copy."""
    out = tmp_path_factory.mktemp("hostile") / "run"
    assert main(_argv(small_model, out, iterations=ITERS)) == 0
    return out


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out


def _victim(tmp_path: Path, mode: int = 0o600) -> Path:
    """A file outside every run, that no probe may change."""
    v = tmp_path / "victim.txt"
    v.write_text("precious\n")
    os.chmod(v, mode)
    return v


def _untouched(v: Path, mode: int = 0o600) -> None:
    assert v.read_text() == "precious\n" and stat.S_IMODE(v.stat().st_mode) == mode


def _strict_json(text: str) -> object:
    def refuse(c: str) -> None:
        raise AssertionError(f"{c} in JSON")

    return json.loads(text, parse_constant=refuse)


# --- 1. links are never followed: the lock, temporary files, replaced files -------------------------------


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path):
    v = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.LOCK).symlink_to(v)
    with pytest.raises(Unsafe, match="not a regular file"), rundir.hold(out):
        pass
    _untouched(v)
    (out / rundir.LOCK).unlink()
    os.mkfifo(out / rundir.LOCK)  # a FIFO is refused too, without blocking
    with pytest.raises(Unsafe, match="not a regular file"), rundir.hold(out):
        pass


def test_the_cli_refuses_a_planted_lock_in_one_line(small_model, tmp_path):
    v = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.LOCK).symlink_to(v)
    with pytest.raises(SystemExit, match=r"error: .*\.solrl\.lock is not a regular file.*Remove it"):
        main(_argv(small_model, out))
    _untouched(v)


def test_write_atomic_never_writes_through_a_link_and_keeps_permissions(tmp_path):
    v = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".tmp_config.json").symlink_to(v)  # the name the old write_atomic used
    (out / "summary.json").symlink_to(v)  # a replaced file that is a link: the link goes, not the target
    write_atomic(out / "config.json", "{}")
    write_atomic(out / "summary.json", "{}")
    _untouched(v)
    assert not (out / "summary.json").is_symlink() and (out / "summary.json").read_text() == "{}"
    (out / "metrics.jsonl").write_text("")
    os.chmod(out / "metrics.jsonl", 0o640)
    write_atomic(out / "metrics.jsonl", "x\n")
    assert stat.S_IMODE((out / "metrics.jsonl").stat().st_mode) == 0o640  # kept, not reset to 0o644
    with replacing(out / "grid.png") as tmp:  # for writers that take a name (PIL, matplotlib)
        assert tmp.suffix == ".png" and tmp.name.startswith(".tmp_grid.png.") and tmp.exists()
        tmp.write_bytes(b"png")
    assert (out / "grid.png").read_bytes() == b"png"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".tmp_") and not p.is_symlink()) == []


def test_a_temporary_export_directory_left_as_a_link_is_removed_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "run" / ".tmp_lora"
    link.parent.mkdir()
    link.symlink_to(target)
    fresh_dir(link)
    assert link.is_dir() and not link.is_symlink() and not list(link.iterdir())
    assert (target / "keep.txt").read_text() == "mine"


def test_the_metrics_log_is_not_appended_through_a_link(tmp_path):
    from solrl_engine.store.safe import open_append

    v = _victim(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(v)
    with pytest.raises(Unsafe, match="not follow"):
        open_append(tmp_path / "metrics.jsonl")
    _untouched(v)


# --- 2. reads are bounded, of regular files inside the run -------------------------------------------


def test_a_manifest_linked_to_dev_zero_is_refused_at_once_and_the_resume_falls_back(finished, tmp_path):
    out = _copy(finished, tmp_path)
    newest = out / "checkpoints" / f"iter_{ITERS:06d}"
    (newest / MANIFEST).unlink()
    (newest / MANIFEST).symlink_to("/dev/zero")
    v = checkpoint.verify(newest)
    assert v.status == "damaged" and "symbolic link" in v.detail
    assert checkpoint.pick(out / "checkpoints", warn=False).name == f"iter_{ITERS - 1:06d}"
    assert main(["verify", str(out)]) == 1


def test_a_manifest_bigger_than_any_manifest_is_not_read(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(4096)
    with pytest.raises(Unsafe, match="more than such a file can"):
        read_regular(big, limit=1024)


@pytest.mark.parametrize("entry", [{"size": "12", "sha256": "ab"}, "abc", {"size": 1}, {"size": -1, "sha256": "x"}])
def test_a_manifest_with_wrong_typed_entries_is_damaged_in_one_line_and_skipped(finished, tmp_path, entry):
    out = _copy(finished, tmp_path)
    newest = out / "checkpoints" / f"iter_{ITERS:06d}"
    m = json.loads((newest / MANIFEST).read_text())
    m["files"][STATE] = entry
    (newest / MANIFEST).write_text(json.dumps(m))
    v = checkpoint.verify(newest)
    assert v.status == "damaged" and "not a size and a SHA-256" in v.detail and "\n" not in v.detail
    assert checkpoint.pick(out / "checkpoints", warn=False).name == f"iter_{ITERS - 1:06d}"


def test_a_fifo_or_a_link_in_place_of_a_checkpoint_file_is_damaged_without_blocking(finished, tmp_path):
    out = _copy(finished, tmp_path)
    v_out = _victim(tmp_path)
    newest = out / "checkpoints" / f"iter_{ITERS:06d}"
    (newest / TENSORS).unlink()
    os.mkfifo(newest / TENSORS)
    (newest / STATE).unlink()
    (newest / STATE).symlink_to(v_out)
    v = checkpoint.verify(newest)
    assert v.status == "damaged" and "not a regular file" in v.detail
    with pytest.raises(checkpoint.CheckpointError, match="not a regular file"):
        checkpoint.load(newest)
    _untouched(v_out)


def _sharded_checkpoint(root: Path, iteration: int, relative_path: str) -> Path:
    """A sealed checkpoint holding a DCP index whose one storage entry names `relative_path`."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    final = root / f"iter_{iteration:06d}"
    tmp = fresh_dir(final.with_name(f".tmp_{final.name}"))
    (tmp / "__0_0.distcp").write_bytes(b"\0" * 16)
    meta = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo(relative_path, 0, 16)})
    (tmp / checkpoint.DCP_METADATA).write_bytes(pickle.dumps(meta))
    return checkpoint.write(final, {"iteration": iteration, "sharded": "dcp"}, {"iteration": iteration},
                            prepared=True)  # fmt: skip


def test_a_sharded_index_that_climbs_out_is_refused_never_opened_and_the_resume_falls_back(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    good = _sharded_checkpoint(root, 1, "__0_0.distcp")
    assert checkpoint.verify(good).status == "ok"
    bad = _sharded_checkpoint(root, 2, "../../../../etc/passwd")
    v = checkpoint.verify(bad)
    assert v.status == "damaged" and ".metadata is refused" in v.detail and "etc/passwd" in v.detail
    assert checkpoint.pick(root, warn=False) == good  # one line of warning, then the older one
    with pytest.raises(checkpoint.CheckpointError, match="is refused"):
        checkpoint.dcp_reader(bad).read_metadata()


# --- 3. a run directory is recognised before anything moves; eval writes only its own folder -------------


@pytest.mark.parametrize("flag", ["--overwrite", "--auto-resume"])
def test_a_diffusers_model_directory_is_never_moved_aside(small_model, tmp_path, flag):
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text("{}")
    (model / "config.json").write_text("{}")
    (model / "transformer" / "config.json").write_text("{}")
    before = sorted(str(p.relative_to(model)) for p in model.rglob("*"))
    with pytest.raises(SystemExit, match="not a run directory of solrl-engine .*diffusers pipeline.*nothing was moved"):
        main(_argv(small_model, model, flag))
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*")) == before


def test_a_run_made_before_the_marker_is_still_recognised_by_its_checkpoints(finished, tmp_path):
    out = _copy(finished, tmp_path)
    assert (out / rundir.MARKER).is_file()  # every run writes it
    (out / rundir.MARKER).unlink()
    assert rundir.is_run(out) and rundir.check_start(out, "overwrite") == "overwrite"
    shutil.rmtree(out / "checkpoints")  # no marker, no checkpoint: not recognisably ours
    with pytest.raises(FileExistsError, match="no .solrl-run and no checkpoint"):
        rundir.check_start(out, "overwrite")


def test_eval_refuses_a_run_directory_before_loading_anything(finished, tmp_path):
    out = _copy(finished, tmp_path)
    before = (out / "compare.png").read_bytes()
    with pytest.raises(SystemExit, match=r"training run's directory.*--output .*run/eval"):
        main(["eval", SPEC, "--output", str(out), "--lora", str(out / "lora_ema")])
    assert (out / "compare.png").read_bytes() == before and not (out / "eval.json").exists()


# --- 4. no NaN or inf reaches a ranking, a file or an exit 0 --------------------------------------------


def test_an_evaluation_with_nan_rewards_exits_non_zero_and_writes_valid_json(small_model, tmp_path, monkeypatch,
                                                                           capsys):  # fmt: skip
    from solrl_engine.rewards.shapes import ShapesReward

    monkeypatch.setattr(ShapesReward, "__call__", lambda self, images, prompts: torch.full((len(prompts),), torch.nan))
    out = tmp_path / "eval"
    code = main(["eval", SPEC, "--set", f"model_path={small_model}", "--set", "full_steps=2", "--set",
                 "preview_steps=1", "--max-prompts", "2", "--seeds", "1", "--output", str(out)])  # fmt: skip
    assert code == 1
    assert "rewards are not finite" in capsys.readouterr().err
    summary = _strict_json((out / "eval.json").read_text())
    assert summary["reward_mean"] is None
    assert all(_strict_json(x)["reward"] is None for x in (out / "samples.jsonl").read_text().splitlines())
    assert _strict_json(json_text({"a": [float("inf"), 1.0]})) == {"a": [None, 1.0]}


@pytest.mark.parametrize("reward", ["shapes:nan", "shapes:inf", "shapes:0", "shapes:0.0"])
def test_reward_weights_that_cannot_train_are_refused_before_the_run(reward):
    with pytest.raises(ConfigError, match="not a finite number|every weight is 0"):
        load_config(SPEC, [f"reward={reward}"])
    assert load_config(SPEC, ["reward=shapes:-1.0"]).reward == "shapes:-1.0"  # a penalty term stays allowed


@pytest.fixture(scope="module")
def explorer(small_model):  # noqa: ANN201 - an Explorer on the bundled model's tiny twin
    from solrl_engine.explore import Explorer
    from solrl_engine.models import load_model
    from solrl_engine.rewards import load_reward

    model = load_model("tiny", small_model, "cpu", torch.float32)
    return Explorer(model, load_reward("shapes"), n=4, k=2, preview_steps=1, explore_precision="bf16")


def test_the_explorer_never_ranks_non_finite_rewards(explorer, monkeypatch):
    nan_at = lambda images, prompts: torch.tensor([1.0, float("nan"), 0.5, 0.2][: len(prompts)] * 1)  # noqa: E731
    monkeypatch.setattr(explorer, "reward", nan_at)
    monkeypatch.setattr(explorer.rollouts, "reward", nan_at)
    with pytest.raises(ValueError, match=r"1 of 4 preview rewards are NaN or inf .*seed 8.*nothing was ranked"):
        explorer.select(["a red circle"], [[7, 8, 9, 10]])
    sel = explorer.select(["a red circle"], [[7, 8, 9, 10]], nonfinite="defer")  # a trainer's own policy decides
    assert sel.nonfinite is not None and "seed 8" in sel.nonfinite


def test_the_explorer_checks_its_inputs_in_one_line(explorer):
    for bad, match in (("a red circle", "one string"), ([], "empty"), ([3], "of type int")):
        with pytest.raises(ValueError, match=match):
            explorer.select(bad)
    with pytest.raises(ValueError, match="4 seeds for each of the 1 prompts"):
        explorer.select(["a red circle"], [["x", 1, 2, 3]])
    sel = explorer.select(["a red circle"], [[1, 2, 3, 4]])
    for kw in ({"steps": 0}, {"batch_size": 0}, {"steps": 2.5}):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            sel.regenerate(object(), **kw)
    with pytest.raises(ValueError, match=r"shape \(3,\).*\[P, K\] = \(1, 2\)"):
        sel.fidelity(torch.zeros(3))
    with pytest.raises(ValueError, match="NaN or inf"):
        sel.fidelity(torch.tensor([[0.1, float("nan")]]))


# --- 5. every start validated before the first write -----------------------------------------------------


@pytest.mark.parametrize("setting, key", [
    ("ema_decay_max=1.5", "ema_decay_max"), ("old_decay_max=-0.1", "old_decay_max"),
    ("old_decay_rate=2", "old_decay_rate"),
    ("lora_alpha=0", "lora_alpha"), ("name=../../escape", "name"), ("name=a/b", "name"),
])  # fmt: skip
def test_values_out_of_range_are_refused_naming_the_key(setting, key):
    with pytest.raises(ConfigError, match=rf"{key} = .*: "):
        load_config(SPEC, [setting])


def test_a_bad_later_prompt_stops_the_start_before_anything_is_written(small_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na purple dodecahedron\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="purple dodecahedron.*outside the shapes grammar"):
        main(_argv(small_model, out, train_prompts=str(prompts)))
    assert not out.exists()  # the lock's directory, made by this start, is gone again


def test_a_two_expert_pipeline_without_its_high_noise_expert_is_refused():
    """(Two-expert Wan itself samples and trains: tests/test_wan_experts.py.)"""
    from types import SimpleNamespace

    from solrl_engine.models.experts import two_experts

    pipe = SimpleNamespace(transformer=None, transformer_2=torch.nn.Linear(1, 1),
                           config=SimpleNamespace(boundary_ratio=0.875))  # fmt: skip
    with pytest.raises(ValueError, match="no high-noise one \\(transformer\\): load both experts"):
        two_experts(pipe)


def test_too_little_disk_for_the_checkpoints_is_refused_before_the_first_write(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 2**20))
    with pytest.raises(OSError, match=r"only 1 MiB free .*need about 64 MiB.*nothing was written"):
        rundir.check_room(tmp_path / "run", 64 * 2**20)


def test_a_full_disk_mid_checkpoint_names_the_need_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, {"w": torch.zeros(4)})

    def full(path: Path, tensors: dict) -> dict:
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_tensors", full)
    with pytest.raises(checkpoint.DiskFull, match=r"is full .*iter_000002: it needs about \d+ MiB.*partial .* removed"):
        checkpoint.save(root, 2, {"w": torch.zeros(2**18)})
    assert [p.name for p in root.iterdir()] == ["iter_000001"]


# --- 6. messages a user can act on ------------------------------------------------------------------------


def test_a_corrupt_middle_metrics_line_is_reported_and_kept_aside(tmp_path):
    log = tmp_path / "metrics.jsonl"
    data = b'{"iter": 1}\n{"iter": 2, "x": GARBAGE\n{"iter": 3}\n{"iter": 4, "tor'
    log.write_bytes(data)
    keep, why = rundir.read_log(log, 3)
    assert [r["iter"] for r in keep] == [1, 3]
    assert "CORRUPT line 2" in why and "torn last line (line 4" in why
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == data and str(aside[0]) in why


def test_a_preset_tuned_for_nvfp4_takes_another_explore_precision():
    cfg = load_config(SPEC, ["explore_precision=fp8"])  # the quickstart preset sets explore_rht=128
    assert cfg.explore_precision == "fp8" and cfg.explore_rht == 0 and not cfg.explore_four_over_six
    with pytest.raises(ConfigError, match="explore_rht"):  # set by the user: refused with the reason
        load_config(SPEC, ["explore_precision=fp8", "explore_rht=16"])


def test_resolution_on_a_video_preset_means_the_clip_not_only_its_height():
    cfg = load_config(str(Path(SPEC).parent / "wan.py:wan13b_sol_rl_clipscore"), ["resolution=256"])
    assert cfg.resolution == 256 and cfg.width is None  # 256 x 256, not 256 x 832
    cfg = load_config(str(Path(SPEC).parent / "wan.py:wan13b_sol_rl_clipscore"), ["resolution=256", "width=448"])
    assert (cfg.resolution, cfg.width) == (256, 448)


@pytest.mark.parametrize("argv, match", [
    (["plan", SPEC, "--gpu-memory", "inf"], "--gpu-memory a size in GiB"),
    (["plan", SPEC, "--gpu-memory", "nan"], "--gpu-memory a size in GiB"),
    (["sample", "--prompt", "a red circle", "--seeds", "5-1"], "names no seed"),
])  # fmt: skip
def test_cli_values_that_used_to_pass_or_trace_back(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)


@pytest.mark.parametrize("command", [["plan", SPEC, "--json"], ["sample", "--prompt", "a red circle", "--out"],
                                     ["sample", "--prompt", "a red circle", "--json"], ["fidelity", SPEC, "--output"]])
def test_a_file_into_a_missing_folder_is_refused_before_any_work(tmp_path, command):
    with pytest.raises(SystemExit, match=r"^error: .*nope/out.json: the folder .* does not exist.*nothing was run"):
        main([*command, str(tmp_path / "nope" / "out.json")])


def test_a_stop_signal_during_the_last_iteration_completes_the_run(small_model, tmp_path, monkeypatch, capsys):
    import signal

    from solrl_engine.rl.trainer import Trainer

    step = Trainer.step

    def hup_in_the_last(self: Trainer) -> dict:
        if self.iteration == self.cfg.iterations - 1:
            os.kill(os.getpid(), signal.SIGHUP)  # handled at once, in this (the main) thread
        return step(self)

    monkeypatch.setattr(Trainer, "step", hup_in_the_last)
    assert main(_argv(small_model, tmp_path / "run", iterations=2, save_every=2, eval_every=2)) == 0
    out = capsys.readouterr().out
    assert "SIGHUP arrived during the last iteration" in out and "--resume" not in out


def test_sharding_without_torchrun_says_nothing_is_sharded(small_model, tmp_path, caplog):
    from test_trust import _sets

    from solrl_engine.rl.trainer import Trainer

    cfg = load_config(SPEC, [*_sets(small_model), "sharding=fsdp", f"output={tmp_path / 'run'}"])
    with caplog.at_level("WARNING", logger="solrl_engine.rl"):
        Trainer(cfg, progress=False)
    assert "sharding=fsdp in one process: there is nothing to shard over" in caplog.text


def test_a_disk_that_fills_mid_run_ends_in_one_line_with_the_resume_command(small_model, tmp_path, monkeypatch):
    real, calls = checkpoint.write_tensors, []

    def fills_on_the_second(path: Path, tensors: dict) -> dict:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(checkpoint, "write_tensors", fills_on_the_second)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"(?s)error: the disk of .* is full .*iter_000002: it needs about \d+ MiB.*"
                                         r"continue with: solrl train .*--resume"):  # fmt: skip
        main(_argv(small_model, out, iterations=3, save_every=1, eval_every=3))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_000001"]
