"""The dispatch seam: defaults, the SOLRL_BACKEND override, fallback with one logged line."""

from __future__ import annotations

import logging

import pytest
import torch

from solrl_engine import kernels
from solrl_engine.kernels import dispatch
from solrl_engine.quant import nvfp4

CPU = torch.device("cpu")


def test_every_op_has_a_reference():
    ops = dispatch.ops()
    assert {"nvfp4_quantize", "nvfp4_fake_quantize", "nvfp4_dequantize", "fp8_quantize_rowwise"} <= set(ops)
    assert all("reference" in b for b in ops.values())


def test_default_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    assert kernels.select("nvfp4_quantize", CPU) == "reference"


def test_unknown_backend_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SOLRL_BACKEND", "tpu")
    with pytest.raises(ValueError, match="SOLRL_BACKEND='tpu'.*reference"):
        kernels.select("nvfp4_quantize", CPU)


def test_unavailable_backend_falls_back_and_logs_once(monkeypatch, caplog):
    monkeypatch.setenv("SOLRL_BACKEND", "cuda")
    dispatch._warn_once.cache_clear()
    x = torch.randn(4, 32)
    with caplog.at_level(logging.WARNING, logger="solrl_engine.kernels"):
        a = kernels.nvfp4_quantize(x)
        b = kernels.nvfp4_quantize(x)
    msgs = [r.getMessage() for r in caplog.records if "cannot run nvfp4_quantize" in r.getMessage()]
    assert len(msgs) == 1 and "using reference" in msgs[0]
    want = nvfp4.quantize(x)
    assert torch.equal(a.qdata, want.qdata) and torch.equal(b.qdata, want.qdata)


def test_triton_on_cpu_without_interpreter_is_explained(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = dispatch.unavailable_reason("triton", CPU)
    assert reason is not None and "TRITON_INTERPRET=1" in reason


def test_backend_report_lists_all_backends():
    rep = kernels.backend_report("cpu")
    assert set(rep) == set(kernels.BACKENDS) and rep["reference"] == "available"


def test_unknown_op_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown op"):
        kernels.select("int3_gemm", CPU)


def test_register_requires_a_reference():
    with pytest.raises(ValueError, match="reference"):
        dispatch.register("x", {"triton": lambda: None})


def test_choose_names_the_choice_and_why_the_others_were_passed_over(monkeypatch):
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    assert kernels.choose("nvfp4_linear", CPU, k=256, n=64) == ("reference", "reference (default)")
    monkeypatch.setenv("SOLRL_BACKEND", "cuda")
    backend, why = kernels.choose("nvfp4_linear", CPU, k=256, n=64)
    assert backend == "reference" and "passed over: cuda: the CUDA extension runs on CUDA tensors" not in why
    assert why.startswith("reference (default); passed over: cuda: FP4 tensor-core GEMMs run on CUDA devices")
    monkeypatch.setenv("SOLRL_BACKEND", "cutlass")  # only nvfp4_linear has a cutlass implementation
    assert "cutlass: not implemented for this op" in kernels.choose("nvfp4_quantize", CPU)[1]


def test_shape_rules_are_asked_before_a_backend_is_chosen():
    from solrl_engine.kernels import nvfp4 as knvfp4

    assert "K % 32 == 0" in knvfp4._cuda_fits(CPU, k=48, n=64)
    assert "weight-only" in knvfp4._cuda_fits(CPU, k=256, n=64, quantize_input=False)
    assert "TE recipe only" in knvfp4._cuda_fits(CPU, k=256, n=64, rht=True)
    assert knvfp4._cuda_fits(CPU, k=256, n=64) is None
    assert "N % 8 == 0" in knvfp4._cutlass_fits(CPU, k=256, n=20)


def test_each_quantized_layer_records_its_gemm_in_the_report(monkeypatch):
    from torch import nn

    from solrl_engine.nn import quantize_model

    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    m = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    rep = quantize_model(m, "nvfp4")
    assert [d.kernel for d in rep.layers] == ["reference (default)"] * 2
    assert "GEMM of 2 layer(s): reference (default)" in rep.summary()
    monkeypatch.setenv("SOLRL_BACKEND", "triton")  # a changed request is seen by the next forward
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton: Triton kernels need a CUDA device" in m[0].choose_kernel()[1]


def test_the_triton_kernels_import_from_a_checkout_that_is_not_installed(tmp_path):
    """A lent GPU machine runs a bare copy with PYTHONPATH=. and nothing installed: `solrl_triton` exists only
    through setup.py's package_dir there, so the dispatch seam loads the triton_kernels/ folder under that name.
    `python -S` runs no .pth file, so the editable install of the test environment is invisible."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import importlib.util, solrl_engine.kernels.dispatch as d\n"
        "print(importlib.util.find_spec('solrl_triton'))\n"
        "print(d.unavailable_reason('triton', __import__('torch').device('cpu')))\n"
        "m = d.triton_module('fp8'); print(m.__name__, m.__file__)\n"
    )
    site = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{root}:{site}", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    spec, reason, mod = out.stdout.splitlines()[-3:]
    assert spec == "None" and reason == "None"  # not installed, and still available
    assert mod == f"solrl_triton.fp8 {root / 'triton_kernels' / 'fp8.py'}"


@pytest.mark.parametrize("sm", ["", "80", "90", "100"])
@pytest.mark.parametrize("want", ["", "reference", "triton", "cuda", "cutlass"])
def test_choose_and_select_walk_one_order(monkeypatch, sm, want):
    """Where every implementation fits the shapes, the layer's choice is the backend a call selects: both
    walk SOLRL_BACKEND's request, cuda and triton where the device is GPU-like, then the reference."""
    monkeypatch.setenv("SOLRL_SIMULATE_SM", sm)
    monkeypatch.setenv("SOLRL_BACKEND", want)
    producers = {"adaln_quantize": {"k": 256, "x_dtype": torch.bfloat16, "modulation_dtype": torch.bfloat16,
                                    "fp32_norm": False, "fmt": "fp8"},
                 "gelu_quantize": {"k": 256, "x_dtype": torch.bfloat16, "fmt": "int8"},
                 "glu_quantize": {"k": 256, "x_dtype": torch.bfloat16, "fmt": "fp8"},
                 "rms_quantize": {"k": 256, "dtypes": (torch.bfloat16,), "fmt": "int8"}}  # fmt: skip
    for op in dispatch.ops():
        shape = ({"k": 256, "n": 64} if op.endswith("_linear") else {"d": 64} if op.endswith("_attention")
                 else producers.get(op, {}))  # fmt: skip
        assert kernels.choose(op, CPU, **shape)[0] == kernels.select(op, CPU), op


def test_select_says_once_which_backend_it_took_instead(monkeypatch, caplog):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    monkeypatch.setenv("SOLRL_BACKEND", "cutlass")
    dispatch._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="solrl_engine.kernels"):
        assert kernels.select("fp8_linear", CPU) == "cuda"
        assert kernels.select("nvfp4_linear", CPU) == "triton"
    assert [r.getMessage() for r in caplog.records] == [
        "SOLRL_BACKEND=cutlass cannot run fp8_linear on cpu: it has no implementation of this op; using cuda.",
        "SOLRL_BACKEND=cutlass cannot run nvfp4_linear on cpu: FP4 tensor-core GEMMs run on CUDA devices, not cpu "
        "(simulated sm_90: no CPU implementation); using triton.",
    ]


def test_the_linears_keep_their_op_names():
    """The per-format modules register their custom ops under the names compiled graphs and records carry."""
    for op in ("nvfp4_linear", "fp8_linear", "int8_linear"):
        assert hasattr(torch.ops.solrl, op)
    assert {"nvfp4_linear", "fp8_linear", "int8_linear", "nvfp4_quantize_into_", "hadamard_rotate",
            "int8_quantize_rowwise", "int8_scale_epilogue"} <= set(dispatch.ops())  # fmt: skip
