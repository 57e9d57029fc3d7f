"""The examples under examples/ run as a user would run them, on a tiny SD3 pipeline saved here."""

from __future__ import annotations

import ast
import math
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
    """What the example prints, parsed: 2 prompts x K = 4 distinct seeds, the top K/2 then the bottom K/2 by
    proxy reward, finite full-precision rewards, and rank correlations in [-1, 1]."""
    out = _run("explore_select.py", "--pipeline", str(sd3))
    vals = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    seeds = ast.literal_eval(vals["selected seeds (top 2, bottom 2)"])
    proxy = ast.literal_eval(vals["proxy rewards"])
    full = ast.literal_eval(vals["full-precision rewards"])
    fid = ast.literal_eval(vals["proxy fidelity"])
    assert len(seeds) == 2 and all(len(r) == 4 == len(set(r)) for r in seeds)
    assert all(min(r[:2]) >= max(r[2:]) for r in proxy)
    assert len(full) == 2 and all(len(r) == 4 and all(map(math.isfinite, r)) for r in full)
    assert {"spearman", "kendall"} <= set(fid) and all(-1 <= fid[k] <= 1 for k in ("spearman", "kendall"))


def test_grpo_loop_example(sd3):
    out = _run("grpo_loop.py", "--pipeline", str(sd3), "--iterations", "2")
    lines = [x for x in out.splitlines() if x.startswith("iter ")]
    assert len(lines) == 2 and all("quantized layers refreshed" in x for x in lines)
    assert " 0 quantized" not in out
