"""The kernel benchmark script runs end to end (tiny CPU sizes) and writes its JSON record."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_bench_writes_json(tmp_path, dtype):
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = mod.main(["--device", "cpu", "--shapes", "32x64", "--dtype", dtype, "--reps", "60", "--out", str(tmp_path)])
    rec = json.loads(path.read_text())
    assert rec["info"]["device"] == "cpu" and rec["info"]["torch"]
    r = rec["results"][0]
    assert r["shape"] == [32, 64]
    for op in ("copy", "nvfp4_quantize_static_amax", "nvfp4_fake_quantize_static_amax", "fp8_quantize_rowwise"):
        assert r[op]["median_ms"] > 0 and r[op]["ratio_to_copy"] > 0
    assert r["nvfp4_quantize_static_amax"]["backend"] == "reference"
