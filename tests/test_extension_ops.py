"""The CUDA extension's ops as the dispatcher sees them: the schemas csrc/torch_bindings.cpp
registers, with the fake (shape) implementations torch.compile traces through, checked on CPU."""

import re
from pathlib import Path

import torch

from solrl_engine.kernels import dispatch

BINDINGS = Path(__file__).resolve().parents[1] / "csrc" / "torch_bindings.cpp"


def _schemas() -> list[str]:
    return re.findall(r'm\.def\("([^"]+)"\)', BINDINGS.read_text())


def test_bindings_register_every_op_they_implement():
    text = BINDINGS.read_text()
    names = [s.split("(")[0] for s in _schemas()]
    assert names == ["nvfp4_quantize", "nvfp4_gemm_sm100"]
    assert "TORCH_LIBRARY(solrl_C, m)" in text and "TORCH_LIBRARY_IMPL(solrl_C, CUDA, m)" in text
    assert all(f'm.impl("{n}", &{n});' in text for n in names)


def test_fake_implementations_match_the_schemas():
    lib = torch.library.Library("solrl_C", "DEF")  # what importing solrl_engine._C registers, minus the kernels
    try:
        for schema in _schemas():
            lib.define(schema)
        dispatch._register_fakes()
        ops = torch.ops.solrl_C
        x = torch.empty(3, 5, 64, device="meta")
        q, s, g = ops.nvfp4_quantize(x, None, False, 0)
        assert q.shape == (3, 5, 32) and q.dtype == torch.uint8 and s.shape == (3, 5, 4) and g.shape == ()
        _, sw, _ = ops.nvfp4_quantize(x, None, True, 0)
        assert sw.shape == (128 * 4,)  # 15 rows padded to 128, 4 block-columns padded to 4
        a = torch.empty(7, 32, dtype=torch.uint8, device="meta")
        b = torch.empty(24, 32, dtype=torch.uint8, device="meta")
        d = ops.nvfp4_gemm_sm100(a, sw, b, sw, torch.empty((), device="meta"), None, 0)
        assert d.shape == (7, 24) and d.dtype == torch.bfloat16
    finally:
        lib._destroy()


def test_triton_kernels_install_as_solrl_triton():
    """The repository's triton_kernels/ folder is importable as `solrl_triton` (the Triton project
    ships its own `triton_kernels`, which vLLM and SGLang import), and the dispatch seam uses that name."""
    import importlib.util

    spec = importlib.util.find_spec("solrl_triton")
    assert spec is not None and Path(spec.origin).parent.name == "triton_kernels"
    setup = (BINDINGS.parents[1] / "setup.py").read_text()
    assert 'package_dir={"solrl_triton": "triton_kernels"}' in setup
    assert dispatch.triton_module("nvfp4").__name__ == "solrl_triton.nvfp4"
