"""The `solrl` console script."""

import subprocess
import sys

from solrl_engine.cli import main


def test_help_lists_commands(capsys):
    assert main([]) == 0
    assert "version" in capsys.readouterr().out


def test_version_reports_versions_and_backends(capsys):
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "backend      reference available" in out and "explore" in out


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
