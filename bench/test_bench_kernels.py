"""Kernel microbenchmarks under pytest-benchmark, each group with its baseline in the same run:

    pytest bench/ --benchmark-only --benchmark-json out.json

- quantize ops (NVFP4 quantize / fake-quant, FP8 row-wise) against a copy of the same input and an FP32
  matmul of the tiny model's MLP size (bench/kernels.py's ops, same names);
- GEMMs: the NVFP4 / FP8 linears against torch.mm in BF16 and FP32;
- a QuantLinear of each recipe against nn.Linear in FP32 and BF16 (what the explore copy swaps in).

CPU-sized (the tiny model's image-stream MLP: 1024 tokens x 128 -> 512); on a GPU the same shapes
run there. Skipped unless --benchmark-only is given, so a plain `pytest bench/` stays quick; the main
`python -m pytest` run never collects bench/ (testpaths = tests).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

pytest.importorskip("pytest_benchmark", reason="pip install pytest-benchmark (the dev extra)")

from solrl_engine import kernels  # noqa: E402
from solrl_engine.nn import QuantLinear  # noqa: E402
from solrl_engine.quant import fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
M, K, N = 1024, 128, 512  # tokens x in -> out of the tiny model's MLP up-projection


@pytest.fixture(autouse=True)
def _benchmark_only(request: pytest.FixtureRequest) -> None:
    """Microbenchmarks are slow as tests and prove nothing there: run them with --benchmark-only."""
    if not request.config.getoption("benchmark_only", default=False):
        pytest.skip("a microbenchmark: run `pytest bench/ --benchmark-only`")


def _sync(fn: Callable[[], object]) -> Callable[[], object]:
    if DEVICE.type != "cuda":
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


def _x(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g).to(DEVICE, dtype)


QUANT_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "copy": lambda x, amax, dst: dst.copy_(x),  # the bandwidth baseline
    "fp32_matmul": lambda x, amax, dst: x.float() @ dst.float().t()[:, :N],  # the compute baseline
    "nvfp4_quantize_static_amax": lambda x, amax, dst: kernels.nvfp4_quantize(x, amax),
    "nvfp4_fake_quantize_static_amax": lambda x, amax, dst: kernels.nvfp4_fake_quantize(x, amax),
    "fp8_quantize_rowwise": lambda x, amax, dst: kernels.fp8_quantize_rowwise(x),
}


@pytest.mark.parametrize("op", list(QUANT_OPS))
def test_quantize_op(benchmark, op: str) -> None:
    x = _x(M, K, torch.bfloat16)
    amax, dst = x.float().abs().amax(), torch.empty_like(x)
    if op == "fp32_matmul":
        dst = _x(N, K, torch.bfloat16)
    benchmark.group = f"quantize {M}x{K} bf16"
    kernel = {"nvfp4_quantize_static_amax": "nvfp4_quantize", "nvfp4_fake_quantize_static_amax": "nvfp4_fake_quantize",
              "fp8_quantize_rowwise": "fp8_quantize_rowwise"}.get(op)  # fmt: skip
    benchmark.extra_info.update(device=DEVICE.type, backend=kernels.select(kernel, DEVICE) if kernel else None)
    benchmark(_sync(lambda: QUANT_OPS[op](x, amax, dst)))


@pytest.mark.parametrize("path", ["mm_fp32", "mm_bf16", "nvfp4_linear_w4a4", "nvfp4_linear_w4a16", "fp8_linear_w8a8"])
def test_gemm(benchmark, path: str) -> None:
    x32, w32 = _x(M, K, torch.float32), _x(N, K, torch.float32) * 0.02
    x, w = x32.bfloat16(), w32.bfloat16()
    wq, w8 = kernels.nvfp4_quantize(w), fp8.quantize_rowwise(w)
    fns: dict[str, Callable[[], object]] = {
        "mm_fp32": lambda: torch.mm(x32, w32.t()),
        "mm_bf16": lambda: torch.mm(x, w.t()),
        "nvfp4_linear_w4a4": lambda: kernels.nvfp4_linear(x, wq, None, True),
        "nvfp4_linear_w4a16": lambda: kernels.nvfp4_linear(x, wq, None, False),
        "fp8_linear_w8a8": lambda: kernels.fp8_linear(x, w8, None, True),
    }
    benchmark.group = f"gemm {M}x{N}x{K}"
    benchmark.extra_info.update(device=DEVICE.type, backend=kernels.select("nvfp4_linear", DEVICE))
    benchmark(_sync(fns[path]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", ["nn.Linear", "nvfp4", "nvfp4_weight_only", "fp8", "fp8_weight_only", "bf16"])
def test_quant_linear_vs_linear(benchmark, recipe: str, dtype: str) -> None:
    """The explore copy's layer against the policy's, at the policy's dtype: what explore_precision=auto
    measures (solrl_engine.explore.choice.probe_explore_timings) before choosing."""
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    lin = nn.Linear(K, N).to(DEVICE, dt)
    mod = lin if recipe == "nn.Linear" else QuantLinear.from_linear(lin, recipe)
    x = _x(M, K, dt)
    benchmark.group = f"linear {M}x{K}->{N} {dtype}"
    benchmark.extra_info.update(device=DEVICE.type)
    with torch.no_grad():
        benchmark(_sync(lambda: mod(x)))
