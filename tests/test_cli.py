"""The `solrl` console script."""

import argparse
import re
import subprocess
import sys

from solrl_engine import kernels
from solrl_engine.cli import build_parser, main


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"version", "pretrain-tiny", "sample", "train", "eval", "fidelity", "verify"} <= set(sub.choices)
    for name in sub.choices:  # each listed in the help, on a line of its own
        assert re.search(rf"^    {re.escape(name)}(\s|$)", out, re.M), name


def test_version_reports_versions_and_backends(capsys):
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "explore" in out
    assert all(re.search(rf"^backend      {b:<9} ", out, re.M) for b in kernels.BACKENDS), out


def test_console_script_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "solrl_engine.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "solrl" in r.stdout


def test_sample_writes_grid_images_and_records(tmp_path):
    import json

    from PIL import Image

    grid = tmp_path / "grid.png"
    rec = tmp_path / "r.jsonl"
    args = ["sample", "--model", "tiny", "--prompt", "a red circle to the left of a blue square", "--seeds", "0-3"]
    args += ["--steps", "3", "--out", str(grid), "--save-dir", str(tmp_path / "imgs"), "--json", str(rec)]
    assert main(args) == 0
    assert Image.open(grid).size[0] > 4 * 32
    rows = [json.loads(line) for line in rec.read_text().splitlines()]
    assert [r["seed"] for r in rows] == [0, 1, 2, 3]
    assert all(0 <= r["reward"] <= 1 and Image.open(r["file"]).size == (32, 32) for r in rows)
    assert {r["prompt"] for r in rows} == {"a red circle to the left of a blue square"}


def test_sample_heldout_split_and_bad_prompt(tmp_path):
    import pytest

    assert (
        main(
            [
                "sample",
                "--split",
                "heldout",
                "--max-prompts",
                "2",
                "--seeds",
                "0,1",
                "--steps",
                "2",
                "--out",
                str(tmp_path / "g.png"),
            ]
        )
        == 0
    )
    with pytest.raises(SystemExit, match="grammar"):
        main(["sample", "--prompt", "a photo of a cat", "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="exactly one"):
        main(["sample", "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="range"):
        main(["sample", "--prompt", "a red circle", "--seeds", "a-b", "--out", str(tmp_path / "x.png")])


def test_train_config_errors_are_clear(capsys):
    import pytest

    with pytest.raises(SystemExit, match="config error.*even"):
        main(["train", "configs/tiny.py:tiny_sol_rl_shapes", "--set", "k=7"])
    with pytest.raises(SystemExit, match="did you mean 'iterations'"):
        main(["train", "configs/tiny.py:tiny_sol_rl_shapes", "--set", "iteration=3"])


def test_fidelity_cli_writes_its_report(tmp_path):
    import json

    out = tmp_path / "fid.json"
    args = ["fidelity", "configs/tiny.py:tiny_sol_rl_shapes", "--set", "full_steps=2", "--set", "preview_steps=1"]
    args += ["--prompts", "2", "--n", "6", "--k", "2", "--output", str(out)]
    assert main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["prompts"] == 2 and rep["n"] == 6 and -1 <= rep["spearman_mean"] <= 1
    assert len(rep["per_prompt"]) == 2 and rep["explore_recipe"] == "nvfp4+rht128+4o6"  # the preset's recipe
