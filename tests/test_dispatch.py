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
