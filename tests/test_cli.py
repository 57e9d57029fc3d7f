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
