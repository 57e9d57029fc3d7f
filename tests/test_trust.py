"""Scale and trust on CPU: resume after SIGKILL anywhere (mid-iteration, mid-checkpoint) reproduces an
uninterrupted run's metrics bit for bit; SIGTERM stops with a checkpoint and exit code 143; an existing run is never
clobbered; bad input (non-finite rewards, wrong reward shapes, an unwritable or full output) gets a
clear error and loses nothing; the proxy-drift guard warns and falls back, and a normal run never
triggers it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from solrl_engine.cli import main
from solrl_engine.rl import ConfigError, load_config
from solrl_engine.rl.guards import NonFiniteError
from solrl_engine.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SPEC = str(ROOT / "configs/tiny.py:tiny_sol_rl_shapes")
TIME_KEYS = {"time_explore_s", "time_regen_s", "time_train_s", "time_total_s", "time_reward_hidden_s",
             "time_reward_exposed_s"}


def _sets(small_model: str, **kw: object) -> list[str]:
    base = dict(model_path=small_model, n=6, k=4, prompts_per_iter=2, iterations=4, preview_steps=2, full_steps=4,
                eval_every=2, eval_prompt_count=2, eval_seeds=1, save_every=1, lora_rank=4, lora_alpha=8, lr=1e-2,
                rollout_batch_size=16, train_batch_size=4, timestep_fraction=0.5, eval_train_prompt_count=0,
                explore_precision="nvfp4")  # fmt: skip  (auto is timed: separate runs could choose apart)
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


def _argv(small_model: str, out: Path, *extra: str, **kw: object) -> list[str]:
    args = ["train", SPEC, "--output", str(out), *extra]
    for s in _sets(small_model, **kw):
        args += ["--set", s]
    return args


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _same_records(a: list[dict], b: list[dict]) -> None:
    assert [r["iter"] for r in a] == [r["iter"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        strip = lambda r: {k: v for k, v in r.items() if k not in TIME_KEYS}  # noqa: E731
        assert strip(ra) == strip(rb)


@pytest.fixture(scope="module")
def reference(small_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """An uninterrupted run to compare every interrupted one with."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_argv(small_model, out)) == 0
    return _records(out)


def _spawn(small_model: str, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`solrl train` in a child process, from this tree (not an installed copy)."""
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return subprocess.Popen([sys.executable, "-m", "solrl_engine.cli", *_argv(small_model, out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path, **(env or {})}, cwd=ROOT)  # fmt: skip


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 120) -> None:  # noqa: ANN001
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        assert time.time() - t0 < timeout, "timed out waiting for the run"
        time.sleep(0.05)


def test_sigkill_mid_checkpoint_write_then_resume_is_bit_identical(small_model, reference, tmp_path):
    out = tmp_path / "run"
    proc = _spawn(small_model, out, {"SOLRL_CHECKPOINT_PAUSE_S": "60"})
    _wait_for(lambda: (out / "checkpoints" / ".tmp_iter_000001" / "PAUSED").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoints" / "iter_000001").exists()  # the half-written one never became a checkpoint
    with pytest.raises(SystemExit, match="no checkpoint to resume"):  # --resume insists on one
        main(_argv(small_model, out, "--resume"))
    assert main(_argv(small_model, out, "--auto-resume")) == 0  # a job script's way: none yet, so it starts over
    _same_records(reference, _records(out))


def test_sigkill_mid_iteration_then_resume_is_bit_identical(small_model, reference, tmp_path):
    out = tmp_path / "run"
    proc = _spawn(small_model, out)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(_records(out)) >= 2, proc)
    time.sleep(0.3)  # somewhere inside iteration 3 (or its checkpoint)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert main(_argv(small_model, out, "--resume")) == 0
    _same_records(reference, _records(out))


def test_sigterm_stops_after_the_iteration_with_a_checkpoint(small_model, reference, tmp_path):
    out = tmp_path / "run"
    proc = _spawn(small_model, out)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(_records(out)) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143  # 128 + SIGTERM: not the 0 of a finished run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["iterations"] < 4 and summary["stopped_by"] == "SIGTERM"
    assert (out / "checkpoints" / f"iter_{summary['iterations']:06d}").exists()
    assert main(_argv(small_model, out, "--resume")) == 0
    _same_records(reference, _records(out))


def test_an_existing_run_is_never_clobbered(small_model, tmp_path):
    out = tmp_path / "run"
    assert main(_argv(small_model, out, iterations=1)) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(SystemExit, match="--resume.*--overwrite"):
        main(_argv(small_model, out, iterations=1))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing in OUT changed
    assert main(_argv(small_model, out, "--overwrite", iterations=1)) == 0
    assert [r["iter"] for r in _records(out)] == [1]
    assert len(list(out.glob("replaced-*/metrics.jsonl"))) == 1  # the old run, moved aside


def test_resume_with_another_config_is_refused_naming_what_differs(small_model, tmp_path):
    out = tmp_path / "run"
    assert main(_argv(small_model, out, iterations=1)) == 0
    with pytest.raises(SystemExit, match=r"lr \(checkpoint 0.01, now 0.5\)"):
        main(_argv(small_model, out, "--resume", iterations=2, lr=0.5))
    assert main(_argv(small_model, out, "--resume", iterations=2)) == 0  # more iterations is fine


def test_unwritable_or_full_output_fails_before_training(small_model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SystemExit, match="cannot write to the output directory"):
        main(_argv(small_model, blocker / "run"))
    import shutil

    from solrl_engine.store import checkpoint

    real = shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=10 * 2**20))
    with pytest.raises(SystemExit, match="MiB free"):
        main(_argv(small_model, tmp_path / "full"))
    assert not (tmp_path / "full" / "metrics.jsonl").exists()


def _trainer(small_model: str, out: Path, **kw: object) -> Trainer:
    return Trainer(load_config(SPEC, _sets(small_model, output=out, **kw)), progress=False)


def _poison(tr: Trainer, when: int) -> None:
    """The reward returns NaN for one sample on its `when`-th call."""
    inner, calls = tr.rollouts.reward, [0]

    def reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        calls[0] += 1
        r = inner(images, prompts)
        if calls[0] == when:
            r = r.clone()
            r[1] = float("nan")
        return r

    tr.rollouts.reward = reward


def test_nonfinite_rewards_skip_the_update_or_abort_naming_prompt_and_seed(small_model, tmp_path):
    tr = _trainer(small_model, tmp_path / "skip", iterations=3)
    _poison(tr, when=2)  # call 1: the first evaluation, 2: iteration 1's explore rewards
    tr.run()
    recs = _records(tmp_path / "skip")
    assert "explore rewards" in recs[0]["skipped"] and "seed" in recs[0]["skipped"] and "prompt" in recs[0]["skipped"]
    assert recs[-1]["nonfinite_skipped"] == 1 and all("reward_mean" in r for r in recs[1:])
    ab = _trainer(small_model, tmp_path / "abort", iterations=3, nonfinite_policy="abort")
    _poison(ab, when=4)  # iteration 1 (calls 2, 3) passes and checkpoints; iteration 2's explore rewards (4) fail
    with pytest.raises(NonFiniteError, match="seed"):
        ab.run()
    ck = sorted((tmp_path / "abort" / "checkpoints").glob("iter_*"))
    assert [p.name for p in ck] == ["iter_000001"]  # the last good checkpoint, nothing after it


def test_a_reward_of_the_wrong_shape_or_dtype_fails_loudly(small_model, tmp_path):
    tr = _trainer(small_model, tmp_path / "r")
    tr.rollouts.reward = lambda images, prompts: torch.zeros(len(prompts), 2)
    with pytest.raises(TypeError, match=r"must return a float Tensor\[12\]"):
        tr.step()
    tr.rollouts.reward = lambda images, prompts: torch.zeros(len(prompts), dtype=torch.long)
    with pytest.raises(TypeError, match="float"):
        tr.step()


def test_proxy_drift_guard_warns_falls_back_and_a_normal_run_never_triggers_it(small_model, tmp_path, caplog):
    tr = _trainer(small_model, tmp_path / "noisy", iterations=4, proxy_floor=0.9, proxy_window=2,
                  proxy_fallback="bf16")  # fmt: skip
    inner, gen = tr.rollouts.reward, torch.Generator().manual_seed(0)
    tr.rollouts.reward = lambda images, prompts: inner(images, prompts) + torch.randn(len(prompts), generator=gen)
    with caplog.at_level("WARNING"):
        tr.run()
    recs = _records(tmp_path / "noisy")
    assert "proxy drift" in caplog.text and "proxy_fallback=bf16" in caplog.text
    assert recs[1]["proxy_guard"] == "fallback:bf16" and recs[2]["explore_mode"] == "bf16"
    assert all(r["proxy_window_mean"] < 0.9 for r in recs[1:])
    # the bundled model at its quickstart settings: rank fidelity ~0.88, far above the default floor 0.5
    cfg = load_config(SPEC, ["iterations=3", "eval_prompt_count=2", "eval_seeds=1", "eval_every=3", "proxy_window=2",
                             "prompts_per_iter=1", "eval_train_prompt_count=0", "explore_precision=nvfp4",
                             f"output={tmp_path / 'normal'}"])  # fmt: skip
    caplog.clear()
    with caplog.at_level("WARNING"):
        Trainer(dataclasses.replace(cfg), progress=False).run()
    normal = _records(tmp_path / "normal")
    assert all(r["explore_mode"] == "quantized" and r["proxy_guard"] is None for r in normal)
    assert "proxy drift" not in caplog.text


def test_trust_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="nonfinite_policy"):
        load_config(SPEC, ["nonfinite_policy=ignore"])
    with pytest.raises(ConfigError, match="proxy_fallback"):
        load_config(SPEC, ["proxy_fallback=fp8"])


def test_nonfinite_velocities_in_the_update_skip_it_and_leave_the_adapter_clean(small_model, tmp_path):
    tr = _trainer(small_model, tmp_path / "v", iterations=1)
    before = [p.detach().clone() for p in tr.adapters.params("default")]
    velocity = tr.model.velocity

    def poisoned(x, t, cond, transformer=None):  # noqa: ANN001, ANN202 - NaN only where gradients flow
        v = velocity(x, t, cond, transformer=transformer)
        return v * float("nan") if torch.is_grad_enabled() else v

    tr.model.velocity = poisoned
    rec = tr.step()
    assert "velocities" in rec["skipped"] and "seed" in rec["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(before, tr.adapters.params("default"), strict=True))
