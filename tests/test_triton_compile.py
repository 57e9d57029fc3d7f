"""Every Triton launch the engine makes compiles for the GPU, checked on a CPU with the real compiler
(bench/compile_kernels.py). The interpreter, which runs every numerics test, accepted two things the
first lent H100 refused at its first quantized layer: a plain Python float read as a global, and (Triton
3.6) a constexpr float turning a scale into fp64. The bit-exact kernels' PTX must hold no contracted
multiply-add: a GPU build fuses a * b + c by default, where the reference rounds twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("SOLRL_SKIP_COMPILE_CHECK") == "1", reason="SOLRL_SKIP_COMPILE_CHECK")


def _gpu_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SOLRL_SIMULATE_SM")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU default the kernels must opt out of (and quiet)
    return env


def test_every_launch_compiles_for_sm90a_and_sm100a(tmp_path):
    out = tmp_path / "compile.json"
    cmd = [sys.executable, str(ROOT / "bench" / "compile_kernels.py"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_gpu_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] and not rec["failures"]
    assert {r["arch"] for r in rec["rows"]} == {"sm_90a", "sm_100a", "sm_80"}
    names = {r["launch"].split("(")[0] for r in rec["rows"]}
    assert {"_fp8_rowwise_kernel", "_int8_rowwise_kernel", "_quantize_kernel", "_w4a4_kernel", "_w4a16_kernel",
            "_int8_gemm_kernel", "_int8_attention_kernel", "_fp8_attention_kernel", "_adaln_quantize_kernel",
            "_gelu_quantize_kernel", "_glu_quantize_kernel", "_rms_quantize_kernel"} <= names  # fmt: skip
    # the INT8 GEMM on every architecture it serves (Ampere's mma, Hopper's wgmma, Blackwell), and on sm_80 only the
    # kernels that serve Ampere (the INT8 GEMM and attention, the producers that emit INT8 codes)
    assert {r["arch"] for r in rec["rows"] if r["launch"].startswith("_int8_gemm_kernel")} == {"sm_80", "sm_90a",
                                                                                               "sm_100a"}
    assert {r["launch"].split("(")[0] for r in rec["rows"] if r["arch"] == "sm_80"} == {
        "_int8_gemm_kernel", "_int8_attention_kernel", "_adaln_quantize_kernel", "_gelu_quantize_kernel",
        "_glu_quantize_kernel", "_rms_quantize_kernel"}
    assert all(r["cubin_bytes"] > 0 for r in rec["rows"])
    # the tensor cores each low-precision dot really issues (an upcast FP8 or INT8 dot would show f16 here): FP8
    # attention's both dots in E4M3 (Hopper's wgmma, Blackwell's f8f6f4 kind), INT8's Q K^T and GEMM in s8
    mma: dict[tuple[str, str], set[str]] = {}
    for r in rec["rows"]:
        mma.setdefault((r["launch"].split("(")[0], r["arch"]), set()).update(r["mma"])
    assert mma[("_fp8_attention_kernel", "sm_90a")] and all(
        i.endswith(".f32.e4m3.e4m3") for i in mma[("_fp8_attention_kernel", "sm_90a")])
    assert mma[("_fp8_attention_kernel", "sm_100a")] == {"tcgen05.mma.cta_group::1.kind::f8f6f4"}
    assert any(i.endswith(".s32.s8.s8") for i in mma[("_int8_attention_kernel", "sm_90a")])
    assert mma[("_int8_gemm_kernel", "sm_90a")] and all(i.endswith(".s32.s8.s8")
                                                         for i in mma[("_int8_gemm_kernel", "sm_90a")])
    assert any(".s8.s8" in i for i in mma[("_int8_gemm_kernel", "sm_80")])


_TOY = '''
import triton
import triton.language as tl

SCALE = 0.5
SCALE_C = tl.constexpr(0.5)


@triton.jit
def mul_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m)
    out = a * tl.load(b_ptr + offs, mask=m) + tl.load(c_ptr + offs, mask=m)
    tl.store(out_ptr + offs, out * SCALE_C, mask=m)


@triton.jit
def global_float_kernel(a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(a_ptr + offs, tl.load(a_ptr + offs, mask=offs < n) * SCALE, mask=offs < n)
'''


_PROBE = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import pytest, torch
import compile_kernels as ck
import toy_kernels

with ck.recording() as rec:
    x = torch.empty(64)
    toy_kernels.mul_add_kernel[(1,)](x, x, x, x, 64, BLOCK=64)
    toy_kernels.mul_add_kernel[(1,)](x, x, x, x, 64, BLOCK=64, enable_fp_fusion=False)
    toy_kernels.global_float_kernel[(1,)](x, 64, BLOCK=64)
fused, exact, bad = rec
assert fused.signature["a_ptr"] == "*fp32" and fused.signature["n"] == "i32" and fused.constexprs == {"BLOCK": 64}
assert ck.compile_launch(fused, 90)["fma"] >= 1
assert ck.compile_launch(exact, 90)["fma"] == 0
with pytest.raises(Exception, match="global variable SCALE"):
    ck.compile_launch(bad, 90)
print("probe ok")
"""


def test_the_check_sees_fused_multiply_adds_and_refused_globals(tmp_path):
    """The checker itself: a*b+c compiles to an FMA unless fusion is off, and a plain float global is refused,
    as on the GPU (the interpreter runs both). In a fresh process: the interpreter is off there."""
    (tmp_path / "toy_kernels.py").write_text(_TOY)
    (tmp_path / "probe.py").write_text(_PROBE)
    cmd = [sys.executable, str(tmp_path / "probe.py"), str(tmp_path), str(ROOT / "bench")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_gpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "probe ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
