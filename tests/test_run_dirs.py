"""Run directories nobody can lose (docs/checkpoints.md, "Starting, stopping and resuming a run"): a start
validates everything before it moves anything (--overwrite moves the old run aside, never deletes it), --resume
insists on a verified checkpoint, one process writes a run directory at a time (a killed run's lock is taken
over), a torn metrics.jsonl is cut back on resume, adapters are checked against their manifest wherever they
are read, a signal stops a run with a documented exit code and the command that resumes it, and bad settings
get one line naming the key or the file. "Unchanged" is checked by the SHA-256 of every file under OUT."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_trust import ROOT, SPEC, _argv, _records, _same_records, _trainer

from solrl_engine.cli import main
from solrl_engine.rl import ConfigError, load_config
from solrl_engine.rl.export import WEIGHT_NAME
from solrl_engine.rl.guards import NonFiniteError
from solrl_engine.store.checkpoint import MANIFEST

ITERS = 4  # the finished run keeps checkpoints iter_000003 and iter_000004


@pytest.fixture(scope="module")
def finished(small_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished, uninterrupted run: each test works on a copy of it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(_argv(small_model, out, iterations=ITERS)) == 0
    return out


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _tree(out: Path) -> dict[str, str]:
    """Every entry under OUT: a file's SHA-256, "dir" for a directory. Equal trees: nothing was changed."""
    if not out.exists():
        return {}
    return {str(p.relative_to(out)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*"))}  # fmt: skip


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def _spawn(argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`solrl ...` in a child process, from this tree (not an installed copy); output in tmp_path."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    out, err = open(tmp_path / "stdout.txt", "w"), open(tmp_path / "stderr.txt", "w")  # noqa: SIM115
    return subprocess.Popen([sys.executable, "-m", "solrl_engine.cli", *argv], stdout=out, stderr=err, env=env,
                            cwd=ROOT)  # fmt: skip


def _wait_for(pred, proc: subprocess.Popen, tmp_path: Path, timeout: float = 180) -> None:  # noqa: ANN001
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        assert time.time() - t0 < timeout, "timed out waiting for the run"
        time.sleep(0.05)


def _records_so_far(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


# --- 1. nothing is moved before the whole start is validated ---------------------------------------


def test_overwrite_validates_the_whole_start_before_it_moves_the_old_run_aside(small_model, finished, tmp_path):
    out = _copy(finished, tmp_path)
    before = _tree(out)
    for bad, said in ((["--set", "reward=nope"], "unknown reward 'nope'"),
                      (["--set", f"train_prompts={tmp_path / 'missing.txt'}"], "missing.txt")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(_argv(small_model, out, "--overwrite") + bad)
        assert said in _one_line(e)
        assert _tree(out) == before, bad  # the old run is whole: checkpoints, adapters, metrics
    assert main(_argv(small_model, out, "--overwrite", iterations=1)) == 0
    (aside,) = out.glob("replaced-*")  # moved aside whole, byte for byte; the new run starts from nothing
    assert _tree(aside) == before
    assert [r["iter"] for r in _records(out)] == [1]


# --- 2. --resume means resume --------------------------------------------------------------------


def test_resume_without_a_verified_checkpoint_stops_and_touches_nothing(small_model, finished, tmp_path):
    out = _copy(finished, tmp_path)
    shutil.rmtree(out / "checkpoints")  # removed to save space
    before = _tree(out)
    with pytest.raises(SystemExit) as e:
        main(_argv(small_model, out, "--resume"))
    msg = _one_line(e)
    assert str(out) in msg and "no checkpoint" in msg and "--overwrite" in msg
    assert _tree(out) == before
    typo = tmp_path / "rnu"
    with pytest.raises(SystemExit) as e:
        main(_argv(small_model, typo, "--resume"))
    assert str(typo) in _one_line(e) and "does not exist" in str(e.value)
    assert not typo.exists()
    with pytest.raises(SystemExit) as e:
        main(_argv(small_model, out, "--resume", "--overwrite"))
    assert "--resume" in _one_line(e) and "--overwrite" in str(e.value)
    assert _tree(out) == before


def test_auto_resume_starts_a_new_run_or_resumes_the_one_there(small_model, finished, tmp_path):
    """For job scripts that are requeued after preemption: the same command starts, then resumes."""
    out = tmp_path / "run"
    assert main(_argv(small_model, out, "--auto-resume", iterations=2)) == 0  # nothing there: a new run
    assert main(_argv(small_model, out, "--auto-resume", iterations=ITERS)) == 0  # resumed at iteration 2
    _same_records(_records(finished), _records(out))
    assert not list(out.glob("replaced-*"))


# --- 3. one writer per run directory ---------------------------------------------------------------


def test_a_second_start_fails_at_once_naming_the_holder_and_a_killed_runs_lock_is_taken_over(
    small_model, tmp_path, caplog
):  # fmt: skip
    out = tmp_path / "run"
    # the first run, held inside its first checkpoint write (the files stand still meanwhile)
    first = _spawn(_argv(small_model, out), tmp_path, {"SOLRL_CHECKPOINT_PAUSE_S": "120"})
    try:
        _holds_the_directory(first, out, small_model, tmp_path, caplog)
    finally:
        first.kill()
        first.wait()


def _holds_the_directory(first: subprocess.Popen, out: Path, small_model: str, tmp_path: Path, caplog) -> None:  # noqa: ANN001, F811
    _wait_for(lambda: (out / "checkpoints" / ".tmp_iter_000001" / "PAUSED").exists(), first, tmp_path)
    before = _tree(out)
    for extra in ((), ("--resume",), ("--overwrite",), ("--auto-resume",)):
        t0 = time.time()
        with pytest.raises(SystemExit) as e:
            main(_argv(small_model, out, *extra))
        msg = _one_line(e)
        assert str(out) in msg and f"pid {first.pid}" in msg, (extra, msg)
        assert _tree(out) == before, extra
        assert time.time() - t0 < 30  # at once: no model is loaded first
    with pytest.raises(OSError, match=f"pid {first.pid}"):  # the Python API takes the same lock
        _trainer(small_model, out).run(resume=True)
    assert _tree(out) == before
    first.kill()  # SIGKILL: no handler runs, its lock dies with it
    first.wait()
    with caplog.at_level("WARNING"):
        assert main(_argv(small_model, out, "--overwrite", iterations=1)) == 0
    assert f"pid {first.pid}" in caplog.text  # the dead run's lock, taken over and named
    assert [r["iter"] for r in _records(out)] == [1]
    assert not (out / ".solrl.lock").exists()  # a run that ends leaves no lock behind


# --- 4. appended files survive a torn write; rewritten files are replaced atomically ----------------


def test_a_torn_metrics_line_is_cut_back_to_the_checkpoint_on_resume(small_model, finished, tmp_path, caplog):
    out = _copy(finished, tmp_path)
    shutil.rmtree(out / "checkpoints" / f"iter_{ITERS:06d}")  # stopped after the 4th record, before its checkpoint
    m = out / "metrics.jsonl"
    m.write_bytes(m.read_bytes() + b'{"iter": 5, "family": "sol_rl", "reward_mea')  # then a disk filled mid-append
    with caplog.at_level("WARNING"):
        assert main(_argv(small_model, out, "--resume")) == 0
    assert "metrics.jsonl" in caplog.text and "torn" in caplog.text and f"iteration {ITERS - 1}" in caplog.text
    _same_records(_records(finished), _records(out))  # as if it had never stopped


def test_files_the_run_rewrites_are_replaced_atomically(small_model, finished, tmp_path, monkeypatch):
    from solrl_engine.store import safe

    p = tmp_path / "summary.json"
    p.write_text('{"old": 1}')

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safe.os, "fsync", full_disk)
        with pytest.raises(OSError, match="No space"):
            safe.write_atomic(p, '{"new": 2}')
    assert p.read_text() == '{"old": 1}' and sorted(os.listdir(tmp_path)) == ["summary.json"]  # old file whole
    # the run and `solrl eval` write their JSON files that way: by a rename into place
    renamed: list[str] = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(Path(b).name), real(a, b))[1])
    out = _copy(finished, tmp_path)
    assert main(_argv(small_model, out, "--resume", iterations=ITERS + 1)) == 0
    assert {"metrics.jsonl", "summary.json"} <= set(renamed), renamed
    assert main(_argv(small_model, tmp_path / "new", iterations=1)) == 0
    assert "config.json" in renamed
    ev = ["eval", SPEC, "--max-prompts", "1", "--seeds", "1", "--output", str(tmp_path / "ev"),
          "--set", f"model_path={small_model}", "--set", "full_steps=2", "--set", "preview_steps=1"]  # fmt: skip
    assert main(ev) == 0 and "eval.json" in renamed


# --- 5. adapters verified wherever they are read ----------------------------------------------------


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def _eval_argv(small_model: str, lora: Path, out: Path) -> list[str]:
    return ["eval", SPEC, "--lora", str(lora), "--max-prompts", "1", "--seeds", "1", "--output", str(out),
            "--set", f"model_path={small_model}", "--set", "full_steps=2", "--set", "preview_steps=1"]  # fmt: skip


def test_solrl_eval_and_the_library_refuse_a_damaged_adapter(small_model, finished, tmp_path):
    out = _copy(finished, tmp_path)
    ema = out / "lora_ema"
    _flip(ema / WEIGHT_NAME)  # 64 bytes flipped, MANIFEST.json beside it
    with pytest.raises(SystemExit) as e:
        main(_eval_argv(small_model, ema, tmp_path / "ev"))
    assert str(ema) in _one_line(e) and "SHA-256" in str(e.value)
    assert not (tmp_path / "ev").exists()
    (ema / WEIGHT_NAME).write_bytes((finished / "lora_ema" / WEIGHT_NAME).read_bytes()[:1000])  # truncated
    with pytest.raises(SystemExit) as e:
        main(_eval_argv(small_model, ema, tmp_path / "ev"))
    assert "truncated" in _one_line(e)
    (ema / MANIFEST).unlink()  # truncated and no manifest to say so: still one line, no SafetensorError traceback
    with pytest.raises(SystemExit) as e:
        main(_eval_argv(small_model, ema, tmp_path / "ev"))
    assert str(ema) in _one_line(e) and WEIGHT_NAME in str(e.value)
    # the library's loader checks the same way; an adapter without a manifest (diffusers' own export) loads
    from solrl_engine.models import load_model
    from solrl_engine.rl.export import load_lora

    model = load_model("tiny", small_model, torch.device("cpu"), torch.float32)
    _flip(out / "lora" / WEIGHT_NAME)
    with pytest.raises(ValueError, match="SHA-256"):
        load_lora(model.transformer, out / "lora")
    (out / "lora_best" / MANIFEST).unlink()
    load_lora(model.transformer, out / "lora_best")
    assert main(_eval_argv(small_model, out / "lora_best", tmp_path / "ev")) == 0


def test_resume_rewrites_a_damaged_exported_adapter(small_model, finished, tmp_path, caplog):
    from solrl_engine.store.checkpoint import verify

    out = _copy(finished, tmp_path)
    _flip(out / "lora_ema" / WEIGHT_NAME)
    with caplog.at_level("WARNING"):
        assert main(_argv(small_model, out, "--resume")) == 0  # resumed at its end: nothing to train
    assert "lora_ema" in caplog.text and "SHA-256" in caplog.text
    assert verify(out / "lora_ema", kind="export").status == "ok"
    # the same tensors and metadata as the adapter the run exported (not the same bytes: safetensors writes its
    # metadata from a hash map, whose order varies between writes)
    from safetensors import safe_open

    def content(path: Path) -> tuple[dict, dict]:
        with safe_open(str(path / WEIGHT_NAME), "pt") as f:
            return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()

    (meta, got), (want_meta, want) = content(out / "lora_ema"), content(finished / "lora_ema")
    assert meta == want_meta and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


# --- 6. signals and exit codes -----------------------------------------------------------------------


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGHUP, 129), (signal.SIGINT, 130)], ids=["SIGHUP", "SIGINT"])
def test_a_signal_stops_with_a_checkpoint_its_exit_code_and_how_to_resume(small_model, tmp_path, sig, code):
    out = tmp_path / "run"
    proc = _spawn(_argv(small_model, out, iterations=60), tmp_path)
    try:
        _wait_for(lambda: _records_so_far(out) >= 1, proc, tmp_path)
        proc.send_signal(sig)
        assert proc.wait(timeout=180) == code
    finally:
        proc.kill()
        proc.wait()
    last = (tmp_path / "stdout.txt").read_text().strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signal.Signals(sig).name}") and "--resume" in last and str(out) in last
    assert "paired gain" not in last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == signal.Signals(sig).name and summary["iterations"] < 60
    assert (out / "checkpoints" / f"iter_{summary['iterations']:06d}").exists()


def test_a_stop_during_start_up_is_one_line_and_changes_nothing(small_model, finished, tmp_path, monkeypatch,
                                                                capsys):  # fmt: skip
    from solrl_engine.rl import trainer

    out = _copy(finished, tmp_path)
    before, handler = _tree(out), signal.getsignal(signal.SIGTERM)

    def ctrl_c(self, cfg, progress=True):  # noqa: ANN001, ANN202 - Ctrl-C while the model loads
        raise KeyboardInterrupt

    def sigterm(self, cfg, progress=True):  # noqa: ANN001, ANN202
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            pytest.fail("SIGTERM during start-up would end the process without a word")
        signal.raise_signal(signal.SIGTERM)

    for init, code, name in ((ctrl_c, 130, "SIGINT"), (sigterm, 143, "SIGTERM")):
        monkeypatch.setattr(trainer.Trainer, "__init__", init)
        try:
            rc = main(_argv(small_model, out, "--overwrite"))
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C during start-up ended in a traceback")
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == code and f"stopped by {name} during start-up" in err[-1] and "nothing" in err[-1], err[-3:]
        assert _tree(out) == before
    assert signal.getsignal(signal.SIGTERM) == handler  # put back as it was


# --- 7. bad settings: one line naming the key or the file --------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_device_cuda_without_a_gpu_is_one_line(small_model, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(_argv(small_model, tmp_path / "run", device="cuda"))
    assert "device" in _one_line(e) and "cuda" in str(e.value) and "cpu" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_config_path_that_is_not_a_python_file_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("tiny_sol_rl_shapes\n")
    for spec, said in ((f"{tmp_path}:tiny_sol_rl_shapes", "is a directory"),
                       (f"{tmp_path / 'notes.txt'}:tiny_sol_rl_shapes", ".py")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["train", spec, "--output", str(tmp_path / "run")])
        assert said in _one_line(e) and spec.rsplit(":", 1)[0] in str(e.value)
    assert not (tmp_path / "run").exists()


def test_solrl_eval_refuses_zero_seeds_or_prompts(tmp_path):
    for flag in ("--seeds", "--max-prompts"):
        with pytest.raises(SystemExit) as e:
            main(["eval", SPEC, flag, "0", "--output", str(tmp_path / "ev")])
        assert flag in _one_line(e) and ">= 1" in str(e.value)
    assert not (tmp_path / "ev").exists()


def test_learning_rate_and_eval_prompt_count_are_checked_with_the_config(small_model, tmp_path):
    for bad in ("lr=-1e-3", "lr=0", "lr=inf", "lr=nan", "eval_prompt_count=0"):
        key = bad.split("=")[0]
        with pytest.raises(ConfigError, match=rf"{key} = "):
            load_config(SPEC, [bad])
        with pytest.raises(SystemExit) as e:
            main(_argv(small_model, tmp_path / "run", **{key: bad.split("=")[1]}))
        assert _one_line(e).startswith("config error") and key in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_non_finite_adapter_names_the_checkpoint_that_stays_or_that_there_is_none(small_model, tmp_path):
    tr = _trainer(small_model, tmp_path / "run")
    tr.out.mkdir()
    tr.adapters.ema[0].fill_(float("inf"))  # as lr=inf leaves it
    with pytest.raises(NonFiniteError) as e:
        tr._checkpoint(True)
    assert "no checkpoint" in str(e.value) and "stays" not in str(e.value)
    tr.adapters.ema[0].fill_(0.0)
    tr._checkpoint(True)
    tr.adapters.ema[0].fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="iter_000000.*stays"):
        tr._checkpoint(True)


def test_a_prompt_file_that_is_not_utf8_is_named(small_model, tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes("a red circle\nun cercle rouge \u00e0 gauche\n".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        main(_argv(small_model, tmp_path / "run", train_prompts=str(bad)))
    assert str(bad) in _one_line(e) and "UTF-8" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_an_empty_output_is_refused(small_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = _argv(small_model, tmp_path, iterations=1)
    argv[argv.index("--output") + 1] = ""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert "--output" in _one_line(e)
    assert not (tmp_path / "runs").exists()


def test_exported_adapters_get_the_mode_of_every_other_file(finished):
    mode = stat.S_IMODE((finished / "config.json").stat().st_mode)
    for d in ("lora", "lora_ema", "lora_best"):
        assert stat.S_IMODE((finished / d / WEIGHT_NAME).stat().st_mode) == mode, d
