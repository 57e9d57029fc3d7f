"""The examples under examples/ run as a user would run them, on a tiny SD3 pipeline saved here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiny_pipelines import build_sd3

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sd3(tmp_path_factory.mktemp("ex") / "sd3")


def _run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_explore_select_example(sd3):
    out = _run("explore_select.py", "--pipeline", str(sd3))
    assert "selected seeds" in out and "full-precision rewards" in out and "spearman" in out


def test_grpo_loop_example(sd3):
    out = _run("grpo_loop.py", "--pipeline", str(sd3), "--iterations", "2")
    lines = [x for x in out.splitlines() if x.startswith("iter ")]
    assert len(lines) == 2 and all("quantized layers refreshed" in x for x in lines)
    assert " 0 quantized" not in out
