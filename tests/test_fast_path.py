"""The explore forward's speed contract, proven on a CPU: under BF16 autocast every quantized layer of
the real model classes runs its fast kernel and writes the autocast dtype, at a simulated device
capability (SOLRL_SIMULATE_SM: dispatch treats the CPU as that GPU wherever the fast op has a CPU
implementation: torch._scaled_mm, torch._int_mm, Triton in the interpreter). The record read back is
what computed each call (kernels.dispatch.ran), not what was chosen."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import HAS_TRITON
from tiny_pipelines import SIZES, build_flux, build_sana, build_sd3
from torch import nn

from solrl_engine import kernels
from solrl_engine.explore.copy import ExploreCopy
from solrl_engine.models import load_model, model_spec
from solrl_engine.nn import QuantLinear, fast_path, quantize_model, reset_fast_path

BUILDERS = {"sd3": build_sd3, "flux": build_flux, "sana": build_sana}
# the fast GEMM of each explore format and the GPU generation it needs (nvfp4: the Triton W4A4 GEMM of
# Hopper; Blackwell's cuBLASLt FP4 _scaled_mm has no CPU implementation, so sm_100 also runs Triton here)
FAST = {"fp8": ("90", "cuda: cuBLASLt FP8 row-wise _scaled_mm"),
        "int8": ("80", "cuda: torch._int_mm INT8 GEMM + scale epilogue"),
        "nvfp4": ("90", "triton: NVFP4 quantize + W4A4 GEMM")}  # fmt: skip


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fastpath")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def _forward(name: str, path: Path, recipe: str) -> tuple[ExploreCopy, torch.Tensor]:
    """One denoiser forward of the explore copy of a saved tiny pipeline (loaded in BF16, as on a GPU)
    under CPU BF16 autocast: what a rollout step does."""
    model = load_model(name, path, "cpu", torch.bfloat16, resolution=SIZES[name])
    copy = ExploreCopy(model.transformer, recipe, changes=model_spec(name).explore_rule)
    assert copy.report.quantized, f"the {name} rule quantizes no layer of the tiny model"
    # CUDA autocast runs LayerNorm in FP32 and hands its output on as is; CPU autocast keeps BF16. Every
    # other quantized layer gets an FP32 input here, as the layers after a norm do on a GPU.
    layers = [m for m in copy.transformer.modules() if isinstance(m, QuantLinear)]
    for m in layers[::2]:
        m.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:]))
    cond = model.encode_prompts(["a red apple"])  # one sample: the Triton interpreter pays per row
    x = torch.randn(1, *model.latent_shape)  # FP32 latents, as the sampler keeps them
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        v = model.velocity(x, torch.tensor([0.7]), cond, transformer=copy.transformer)
    return copy, v


@pytest.mark.skipif(not HAS_TRITON, reason="the Triton kernels need triton (pip install -e '.[dev]')")
@pytest.mark.parametrize("recipe", sorted(FAST))
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_quantized_layer_runs_its_fast_kernel_under_autocast(name, recipe, pipes, monkeypatch):
    sm, impl = FAST[recipe]
    monkeypatch.setenv("SOLRL_SIMULATE_SM", sm)
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    copy, v = _forward(name, pipes[name], recipe)
    rec = fast_path(copy.transformer)
    assert len(rec.layers) == len(copy.report.quantized)
    assert rec.fast == list(rec.layers) and not rec.reference and not rec.not_run, rec.summary()
    assert rec.implementations() == {impl: len(rec.layers)}
    # FP32 inputs (after a norm) are quantized from FP32 and, as BF16 ones, written in the autocast dtype
    runs = [r for r in rec.layers.values() if r is not None]
    assert {r.dtype for r in runs} == {"float32", "bfloat16"}
    assert {r.out_dtype for r in runs} == {"bfloat16"}, "a quantized layer ignored autocast's dtype"
    assert v.dtype == torch.bfloat16 and torch.isfinite(v).all()
    assert rec.summary().startswith(f"{len(rec.layers)}/{len(rec.layers)} quantized layers on the fast path")


def test_fp32_inputs_reach_the_fast_kernel_and_come_out_in_the_autocast_dtype(monkeypatch):
    """The H100 defect: a LayerNorm's FP32 output feeding an FP8 layer fell to the reference and
    handed FP32 to the next layers. Here an FP32 LayerNorm output feeds each format's layer."""
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "90")
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    torch.manual_seed(0)
    class FP32LayerNorm(nn.LayerNorm):  # what CUDA autocast does to a LayerNorm (CPU autocast keeps BF16)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                return super().forward(x.float())

    for recipe in ("fp8", "int8"):
        m = nn.Sequential(nn.Linear(64, 128), FP32LayerNorm(128), nn.Linear(128, 64))
        quantize_model(m, recipe)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(torch.randn(33, 64))
        runs = fast_path(m).layers
        assert runs["2"].dtype == "float32" and runs["2"].out_dtype == "bfloat16" and runs["2"].fast
        assert y.dtype == torch.bfloat16
        with torch.no_grad():  # without autocast a layer writes its input's dtype, as nn.Linear does
            assert m(torch.randn(3, 64)).dtype == torch.float32


def test_a_reference_call_on_a_gpu_warns_once_naming_the_layer_and_the_fix(monkeypatch, caplog):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "80")  # Ampere: no FP8 tensor cores, the FP8 GEMM is the reference
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48))
    rep = quantize_model(m, "fp8")
    assert "sm_80 has no FP8 tensor cores" in rep.layers[0].kernel
    with caplog.at_level(logging.WARNING, logger="solrl_engine.kernels"), torch.no_grad():
        for _ in range(3):
            m(torch.randn(20, 64))
    warned = [r.getMessage() for r in caplog.records if "slow reference" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith("0#") and "torch.float32" in warned[0]
    assert "(20, 64)" in warned[0] and "QuantReport" in warned[0]
    rec = fast_path(m)
    assert rec.reference == ["0", "2"] and "0/2 quantized layers on the fast path" in rec.summary()
    assert "on the reference: 0, 2" in rec.summary()
    reset_fast_path(m)
    assert fast_path(m).not_run == ["0", "2"]


def test_the_cpu_without_simulation_runs_the_reference_and_says_so(monkeypatch):
    monkeypatch.delenv("SOLRL_SIMULATE_SM", raising=False)
    monkeypatch.delenv("SOLRL_BACKEND", raising=False)
    m = nn.Sequential(nn.Linear(32, 32))
    quantize_model(m, "int8")
    m(torch.randn(4, 32))
    rec = fast_path(m)
    assert rec.reference == ["0"] and rec.layers["0"].impl == "reference" and rec.layers["0"].device == "cpu"
    assert not kernels.gpu_like("cpu") and kernels.device_capability("cpu") is None


def test_simulated_capability_is_validated(monkeypatch):
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "sm_90")
    assert kernels.simulated_capability() == (9, 0) and kernels.gpu_like("cpu")
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "100")
    assert kernels.device_capability("cpu") == (10, 0)
    monkeypatch.setenv("SOLRL_SIMULATE_SM", "hopper")
    with pytest.raises(ValueError, match="SOLRL_SIMULATE_SM='hopper' is not a compute capability"):
        kernels.simulated_capability()
