"""Checkpoints you can trust: no pickles (a planted payload never runs), checksums and fsync, a resume
that verifies the newest checkpoint and falls back to the previous one with the same metrics and
adapters as an uninterrupted run, a clear error that touches nothing when none verifies, old-format
checkpoints resumed or refused with the conversion command, and `solrl verify`'s table."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trust import _argv, _records, _same_records

from solrl_engine.cli import main
from solrl_engine.rl.export import WEIGHT_NAME
from solrl_engine.store import checkpoint
from solrl_engine.store.checkpoint import MANIFEST, STATE, TENSORS, CheckpointError

ITERS = 4  # the run keeps iter_000003 and iter_000004 (keep_checkpoints=2)


@pytest.fixture(scope="module")
def finished(small_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished, uninterrupted run: each test damages a copy of it and resumes."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(_argv(small_model, out)) == 0
    return out


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _ck(out: Path, it: int) -> Path:
    return out / "checkpoints" / f"iter_{it:06d}"


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def _damage(path: Path, how: str) -> str:
    """Damage a file as bit rot, a torn copy or a lost file would; returns what the warning must say."""
    if how == "flip":
        _flip(path)
        return "SHA-256 differs"
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        return "truncated"
    path.unlink()
    return "is missing"


def _mtimes(out: Path) -> dict[Path, int]:
    """Every entry under OUT and its mtime. OUT's own mtime is left out: a start takes the run's lock
    (OUT/.solrl.lock, docs/checkpoints.md) before it checks anything, and a refused start removes it again."""
    return {p: p.stat().st_mtime_ns for p in out.rglob("*")}


def _same_adapters(a: Path, b: Path) -> None:
    for d in ("lora", "lora_ema"):
        wa, wb = load_file(a / d / WEIGHT_NAME), load_file(b / d / WEIGHT_NAME)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), d


@pytest.mark.parametrize(("how", "name"), [("flip", TENSORS), ("truncate", TENSORS), ("delete", STATE)])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(small_model, finished, tmp_path, caplog, how,
                                                                    name):  # fmt: skip
    out = _copy(finished, tmp_path)
    said = _damage(_ck(out, ITERS) / name, how)
    with caplog.at_level("WARNING"):
        assert main(_argv(small_model, out, "--resume")) == 0
    warned = [r.getMessage() for r in caplog.records if "iter_000004 is damaged" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0] and said in warned[0], caplog.text
    assert "falling back to" in caplog.text and "iter_000003" in caplog.text
    # from iteration 3 the run is what an uninterrupted run was: metrics and exported adapters
    _same_records(_records(finished), _records(out))
    _same_adapters(finished, out)
    assert checkpoint.verify(_ck(out, ITERS)).status == "ok"  # rewritten whole


def test_every_checkpoint_damaged_is_a_clear_error_that_touches_nothing(small_model, finished, tmp_path):
    out = _copy(finished, tmp_path)
    _flip(_ck(out, 4) / TENSORS)
    _damage(_ck(out, 3) / STATE, "truncate")
    before = _mtimes(out)
    with pytest.raises(SystemExit) as err:
        main(_argv(small_model, out, "--resume"))
    msg = str(err.value)
    assert msg.startswith("error: no checkpoint in") and "nothing safe to resume from" in msg
    assert f"iter_000004: {TENSORS}" in msg and f"iter_000003: {STATE}" in msg and "--overwrite" in msg
    assert "Traceback" not in msg and "safetensors_rust" not in msg
    assert _mtimes(out) == before  # nothing in OUT changed
    # the Python API stops before its first write too
    from test_trust import _trainer

    tr = _trainer(small_model, out)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        tr.run(resume=True)
    assert _mtimes(out) == before


class _Payload:
    """Unpickling this creates `marker`: what a hostile state.pt in a shared run directory would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def _plant(ck: Path, marker: Path) -> None:
    ck.mkdir(parents=True, exist_ok=True)
    torch.save({"iteration": 9, "adapters": _Payload(marker)}, ck / "state.pt")
    (ck / "COMPLETE").write_text("9")


def test_a_planted_pickle_never_runs(small_model, finished, tmp_path, capsys):
    out, marker = _copy(finished, tmp_path), tmp_path / "code-ran"
    _plant(_ck(out, 4), marker)  # beside a manifest: never read, the manifest says what the checkpoint is
    _plant(_ck(out, 9), marker)  # an old-format "newest checkpoint": refused, naming how to convert it
    before = _mtimes(out)
    with pytest.raises(SystemExit, match=r"refused.*python -m solrl_engine.store.checkpoint convert .*iter_000009"):
        main(_argv(small_model, out, "--resume", iterations=5))
    assert _mtimes(out) == before and not marker.exists()
    assert main(["verify", str(out)]) == 1
    table = capsys.readouterr().out
    assert "checkpoints/iter_000009  refused" in table and not marker.exists()
    shutil.rmtree(_ck(out, 9))
    assert main(_argv(small_model, out, "--resume", iterations=5)) == 0  # resumes from the verified iter_000004
    assert [r["iter"] for r in _records(out)] == [1, 2, 3, 4, 5] and not marker.exists()
    torch.load(_ck(out, 4) / "state.pt", weights_only=False)  # the payload is live: unpickling it runs
    assert marker.exists()


def _to_old_format(ck: Path) -> None:
    """Rewrite a checkpoint as earlier versions did: one pickled state.pt and a COMPLETE marker."""
    state = checkpoint.load(ck)
    for f in (TENSORS, STATE, MANIFEST):
        (ck / f).unlink()
    torch.save(state, ck / "state.pt")
    (ck / "COMPLETE").write_text(str(state["iteration"]))


def test_an_old_format_checkpoint_resumes_and_converts(small_model, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    shutil.rmtree(_ck(out, 4))
    _to_old_format(_ck(out, 3))
    assert main(["verify", str(out)]) == 0
    assert "checkpoints/iter_000003  old" in capsys.readouterr().out
    assert main(_argv(small_model, out, "--resume")) == 0  # read with weights_only=True
    _same_records(_records(finished), _records(out))
    _same_adapters(finished, out)
    # the conversion command the refusal names, on a trusted old checkpoint
    old = tmp_path / "old" / "iter_000003"
    shutil.copytree(_ck(finished, 3), old)
    _to_old_format(old)
    assert checkpoint._main(["convert", str(old)]) == 0
    assert not (old / "state.pt").exists() and checkpoint.verify(old).status == "ok"
    a, b = checkpoint.load(old), checkpoint.load(_ck(finished, 3))
    assert a["seed_rng"] == b["seed_rng"] and torch.equal(a["gen"], b["gen"]) and a["config"] == b["config"]


def test_solrl_verify_reports_each_case(finished, tmp_path, capsys):
    assert main(["verify", str(finished)]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[:-1]}
    assert {k: v for k, v in rows.items() if k != checkpoint.BEST_LORA} == {
        "checkpoints/iter_000004": "ok", "checkpoints/iter_000003": "ok", "lora": "ok", "lora_ema": "ok"}  # fmt: skip
    out = _copy(finished, tmp_path)
    _flip(_ck(out, 4) / TENSORS)
    _damage(out / "lora_ema" / WEIGHT_NAME, "truncate")
    (out / "lora" / MANIFEST).unlink()  # as an earlier version exported it
    _to_old_format(_ck(out, 3))
    assert main(["verify", str(out)]) == 1
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "damaged" in rows["checkpoints/iter_000004"] and TENSORS in rows["checkpoints/iter_000004"]
    assert "old" in rows["checkpoints/iter_000003"]
    assert "damaged" in rows["lora_ema"] and WEIGHT_NAME in rows["lora_ema"] and "truncated" in rows["lora_ema"]
    assert "unverifiable" in rows["lora"]
    with pytest.raises(SystemExit, match="no checkpoints/"):
        main(["verify", str(tmp_path)])


def test_the_best_adapter_is_sealed_with_its_info_file(finished):
    best = finished / checkpoint.BEST_LORA
    if not best.exists():
        pytest.skip("no evaluation of this run beat the base model")
    files = json.loads((best / MANIFEST).read_text())["files"]
    assert set(files) == {WEIGHT_NAME, checkpoint.BEST_INFO}
    assert checkpoint.verify(best, kind="export").status == "ok"


def test_state_round_trips_through_json_and_safetensors_without_pickle(tmp_path):
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    rng = random.Random(5)
    state = {"opt": opt.state_dict(), "rng": rng.getstate(), "gen": torch.Generator().manual_seed(3).get_state(),
             "evals": [(2, 0.5, float("nan"))], "odd keys": {"$tensor": 1, 7: "x"}, "w": lin.weight,
             "tied": lin.weight, "none": None}  # fmt: skip
    ck = checkpoint.save(tmp_path, 1, state)
    assert sorted(os.listdir(ck)) == [MANIFEST, STATE, TENSORS]
    back = checkpoint.load(ck)
    again = random.Random()
    again.setstate(back["rng"])  # needs the tuples back
    assert again.random() == rng.random()
    assert back["odd keys"] == {"$tensor": 1, 7: "x"} and back["none"] is None and back["evals"][0][:2] == (2, 0.5)
    assert torch.equal(back["w"], lin.weight) and torch.equal(back["tied"], lin.weight)
    assert back["opt"]["param_groups"] == opt.state_dict()["param_groups"]
    opt.load_state_dict(back["opt"])
    with pytest.raises(TypeError, match="at odd/1 is a _Payload, which only pickle could store"):
        checkpoint.save(tmp_path, 2, {"odd": [1, _Payload(tmp_path / "m")]})
    assert not (tmp_path / "iter_000002").exists() and not (tmp_path / "m").exists()


def test_every_file_and_the_directory_are_fsynced_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self: Path, target: Path) -> Path:
        events.append(("rename", f"{self} -> {target}"))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, {"x": torch.ones(3), "n": 1})
    tmp = str(root / ".tmp_iter_000001")
    i = next(i for i, e in enumerate(events) if e[0] == "rename")
    synced = [p for kind, p in events[:i] if kind == "fsync"]
    assert set(synced) == {f"{tmp}/{TENSORS}", f"{tmp}/{STATE}", f"{tmp}/{MANIFEST}", tmp}
    assert synced.index(f"{tmp}/{MANIFEST}") > max(synced.index(f"{tmp}/{TENSORS}"), synced.index(f"{tmp}/{STATE}"))
    assert events[i] == ("rename", f"{tmp} -> {root / 'iter_000001'}") and events[i + 1] == ("fsync", str(root))


def test_every_rank_resumes_from_rank_zeros_choice(tmp_path):
    """Under torchrun rank 0 verifies and broadcasts: a rank that sees other bytes still takes its choice."""
    root = tmp_path / "checkpoints"
    for it in (1, 2):
        checkpoint.save(root, it, {"it": it})
    assert checkpoint.verify(_ck(tmp_path, 2)).status == "ok"
    _flip(_ck(tmp_path, 2) / STATE, n=4)  # a file that changes after a check is checked again

    class Rank:
        def __init__(self, rank: int, box: list) -> None:
            self.world, self.main, self.box = 2, rank == 0, box

        def broadcast_object(self, obj: object) -> object:
            if self.main:
                self.box.append(obj)
            return self.box[0]

    box: list = []
    assert checkpoint.resume_point(root, Rank(0, box)) == _ck(tmp_path, 1)
    shutil.rmtree(_ck(tmp_path, 1))  # rank 1's own pick would now fail; it follows rank 0
    assert checkpoint.resume_point(root, Rank(1, box)) == _ck(tmp_path, 1)
    bad: list = [(None, "no checkpoint in x verifies")]
    with pytest.raises(CheckpointError, match="no checkpoint in x verifies"):
        checkpoint.resume_point(root, Rank(1, bad))


def test_pretraining_resumes_from_verified_checkpoints_and_old_files(tmp_path):
    from solrl_engine.pretrain import LEGACY_CHECKPOINT, _resume_state

    assert _resume_state(tmp_path) is None
    torch.save({"step": 30, "rng": random.Random(0).getstate(), "model": {"w": torch.ones(2)}},
               tmp_path / LEGACY_CHECKPOINT)  # fmt: skip  (an earlier version's checkpoint.pt)
    assert _resume_state(tmp_path)["step"] == 30
    checkpoint.save(tmp_path / "checkpoints", 60, {"step": 60})
    checkpoint.save(tmp_path / "checkpoints", 90, {"step": 90})
    _flip(_ck(tmp_path, 90) / STATE, n=2)
    assert _resume_state(tmp_path)["step"] == 60  # the newest that verifies, before the old file
    marker = tmp_path / "code-ran"
    shutil.rmtree(tmp_path / "checkpoints")
    torch.save({"step": 1, "model": _Payload(marker)}, tmp_path / LEGACY_CHECKPOINT)
    with pytest.raises(CheckpointError, match=r"refused.*convert .*checkpoint\.pt"):
        _resume_state(tmp_path)
    assert not marker.exists()


def test_the_cost_bench_measures_each_operation(tmp_path):
    """bench/checkpoint_cost.py on one SD3.5-Large block: the LoRA shapes it builds and what it records."""
    import importlib.util

    path = Path(__file__).parents[1] / "bench/checkpoint_cost.py"
    spec = importlib.util.spec_from_file_location("checkpoint_cost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--reps", "1", "--sd3-blocks", "1", "--sd3-rank", "4", "--skip-tiny",
                      "--output", str(tmp_path / "cost.json")])  # fmt: skip
    (case,) = res["cases"].values()
    # a single block is SD3.5-L's last (its context stream ends: no to_add_out), so 7 attention projections
    # of 2432 x 2432, rank 4: A and B, 3 adapters + 2 AdamW moments, FP32 (37 more blocks of 8: 303 layers)
    floats = 7 * 4 * (2432 + 2432) * 5
    assert floats * 4 < case["bytes"][TENSORS] < floats * 4 * 1.01
    assert set(case["median_s"]) == {"save_verified_fsync", "save_verified_no_fsync", "verify", "load",
                                     "save_pickle_torch_save", "export_one_adapter"}  # fmt: skip
    assert json.loads((tmp_path / "cost.json").read_text())["cases"] == json.loads(json.dumps(res["cases"]))
