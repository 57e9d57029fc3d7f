"""Kernel microbenchmark. Quantize ops (NVFP4 quantize / fake-quant, FP8 row-wise) against a
device-to-device copy of the same input, and GEMMs (NVFP4 W4A4 and weight-only, FP8 `_scaled_mm`,
Transformer Engine's NVFP4 linear when installed) against cuBLAS BF16 `torch.mm`, each baseline
measured in the same run.

    python bench/kernels.py                       # GPU: 8192x8192 + DiT shapes; CPU: tiny smoke sizes
    python bench/kernels.py --shapes 4096x3072 --gemms 8192x8192x8192 16x8192x8192 --out bench/results

Writes <out>/<date>-<device>-kernels.json with the device, versions, shapes, raw medians (ms),
effective bandwidth (GB/s) and the ratio to copy bandwidth. Bytes are the op's logical traffic
(inputs read once, outputs written once), so ratio 1.0 means "as fast as a copy of those bytes".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from solrl_engine import kernels
from solrl_engine.kernels.dispatch import triton_module

GPU_SHAPES = ["8192x8192", "4096x3072", "4096x12288", "16384x2432"]  # square, FLUX/SD3.5-L-like DiT
CPU_SHAPES = ["256x1024"]
# MxNxK: the 8192^3 ceiling test, small-M weight-only, and DiT linears (FLUX 512px: 1024+512 tokens
# x batch; SD3.5-L 1024px MLP; SANA-1.6B 1024px MLP)
GPU_GEMMS = ["8192x8192x8192", "16x8192x8192", "1x8192x8192", "12288x3072x3072", "16384x9728x2432", "8192x5600x2240"]


def _time_gpu(fn: Callable[[], object], reps: int) -> list[float]:
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="all")
    return list(ms)


def _time_cpu(fn: Callable[[], object], reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(max(3, reps // 20)):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _device_info(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "device": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"sm_{p.major}{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
        try:
            drv = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            info["driver"] = drv.stdout.strip().splitlines()[0] if drv.returncode == 0 else None
        except (OSError, IndexError):
            info["driver"] = None
        info["cuda"] = torch.version.cuda
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def bench_shape(m: int, k: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict[str, object]:
    """Median ms and bandwidth of each op on an m x k input, plus the copy baseline."""
    timer = _time_gpu if device.type == "cuda" else _time_cpu
    n = m * k
    es = torch.tensor([], dtype=dtype).element_size()
    # Inputs larger than L2 are rotated so that no timing reads a hot cache; never time zeros.
    copies = max(1, min(8, (256 * 2**20) // max(1, n * es))) if device.type == "cuda" else 1
    xs = [torch.randn(m, k, device=device).to(dtype) for _ in range(copies)]
    dst = torch.empty_like(xs[0])
    amax = xs[0].float().abs().amax()
    it = {"i": 0}

    def nxt() -> torch.Tensor:
        it["i"] = (it["i"] + 1) % copies
        return xs[it["i"]]

    # name -> (callable, logical bytes moved, dispatch op it exercises)
    ops: dict[str, tuple[Callable[[], object], int, str | None]] = {
        "copy": (lambda: dst.copy_(nxt()), 2 * n * es, None),
        "nvfp4_quantize_static_amax": (
            lambda: kernels.nvfp4_quantize(nxt(), amax),
            n * es + n // 2 + n // 16,
            "nvfp4_quantize",
        ),
        "nvfp4_quantize_with_amax_pass": (
            lambda: kernels.nvfp4_quantize(nxt()),
            2 * n * es + n // 2 + n // 16,
            "nvfp4_quantize",
        ),
        "nvfp4_fake_quantize_static_amax": (
            lambda: kernels.nvfp4_fake_quantize(nxt(), amax),
            2 * n * es,
            "nvfp4_fake_quantize",
        ),
        "fp8_quantize_rowwise": (
            lambda: kernels.fp8_quantize_rowwise(nxt()),
            n * es + n + 4 * m,
            "fp8_quantize_rowwise",
        ),
    }
    res: dict[str, object] = {"shape": [m, k], "dtype": str(dtype).replace("torch.", "")}
    copy_gbps = None
    for name, (fn, nbytes, op) in ops.items():
        ms = timer(fn, reps)
        med = statistics.median(ms)
        gbps = nbytes / (med * 1e-3) / 1e9
        if name == "copy":
            copy_gbps = gbps
        res[name] = {
            "median_ms": med,
            "runs": len(ms),
            "bytes": nbytes,
            "gb_per_s": gbps,
            "ratio_to_copy": gbps / copy_gbps if copy_gbps else None,
            "backend": kernels.select(op, device) if op else None,
        }
    return res


def _te_linear(k: int, n: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | str:
    """Transformer Engine's Linear under its NVFP4 block-scaling recipe, or why it is unavailable."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except Exception as e:  # noqa: BLE001 - any import failure: not installed or not built for this GPU
        return f"transformer_engine unavailable ({type(e).__name__}: {e}); pip install -e '.[te]'"
    if not hasattr(te_recipe, "NVFP4BlockScaling"):
        return "this transformer_engine has no NVFP4BlockScaling recipe"
    lin = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
    rec = te_recipe.NVFP4BlockScaling()

    def run(x: torch.Tensor) -> torch.Tensor:
        with te.fp8_autocast(enabled=True, fp8_recipe=rec):
            return lin(x)

    try:
        run(torch.randn(16, k, device=device, dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - e.g. NVFP4 needs Blackwell in this TE version
        return f"transformer_engine NVFP4 linear failed here ({type(e).__name__}: {e})"
    return run


def bench_gemm(m: int, n: int, k: int, device: torch.device, reps: int) -> dict[str, object]:
    """Median ms and TFLOP/s of each GEMM path on y = x W^T, and the ratio to cuBLAS BF16 throughput."""
    from solrl_engine.quant import fp8

    timer = _time_gpu if device.type == "cuda" else _time_cpu
    x = torch.randn(m, k, device=device).bfloat16()
    w = (torch.randn(n, k, device=device) * 0.02).bfloat16()
    xq, wq = kernels.nvfp4_quantize(x), kernels.nvfp4_quantize(w)
    w8 = fp8.quantize_rowwise(w)
    x8 = kernels.fp8_quantize_rowwise(x)
    flops = 2 * m * n * k
    ops: dict[str, Callable[[], object]] = {"bf16_mm": lambda: torch.mm(x, w.t())}
    notes: dict[str, str] = {}
    if device.type == "cuda":
        gemm = triton_module("gemm")

        ops["nvfp4_w4a4_gemm"] = lambda: gemm.w4a4_gemm(
            xq.qdata, xq.scale, xq.global_scale, wq.qdata, wq.scale, wq.global_scale
        )
        ops["nvfp4_w4a16_gemm"] = lambda: gemm.w4a16_gemm(x, wq.qdata, wq.scale, wq.global_scale)
        one = torch.ones((), device=device)

        def dequant_then_cublas() -> torch.Tensor:
            """The alternative design: decode both operands (global scale 1: exact in BF16) in a
            bandwidth-bound pass, then cuBLAS. A timing reference for the fused kernel."""
            a = kernels.nvfp4_dequantize(type(xq)(xq.qdata, xq.scale, one), torch.bfloat16)
            b = kernels.nvfp4_dequantize(type(wq)(wq.qdata, wq.scale, one), torch.bfloat16)
            return torch.mm(a, b.t(), out_dtype=torch.float32) * (xq.global_scale * wq.global_scale)

        ops["nvfp4_dequant_then_cublas"] = dequant_then_cublas
        if kernels.tensor_cores(device, "fp8") is None and k % 16 == 0 and n % 16 == 0:
            ops["fp8_scaled_mm"] = lambda: torch._scaled_mm(
                x8.data, w8.data.t(), scale_a=x8.scale, scale_b=w8.scale.reshape(1, -1), out_dtype=torch.bfloat16
            )
    ops["nvfp4_linear_w4a4"] = lambda: kernels.nvfp4_linear(x, wq, None, True)  # quantize x + GEMM
    ops["fp8_linear_w8a8"] = lambda: kernels.fp8_linear(x, w8, None, True)  # quantize x + GEMM
    te_run = _te_linear(k, n, device) if device.type == "cuda" else "GPU only"
    if callable(te_run):
        ops["te_nvfp4_linear"] = lambda: te_run(x)
    else:
        notes["te_nvfp4_linear"] = te_run
    res: dict[str, object] = {"gemm": [m, n, k], "notes": notes}
    base = None
    for name, fn in ops.items():
        ms = timer(fn, reps)
        med = statistics.median(ms)
        base = base or med
        tflops = flops / (med * 1e-3) / 1e12
        res[name] = {"median_ms": med, "runs": len(ms), "tflops": tflops, "ratio_to_bf16": base / med}
    res["nvfp4_linear_backend"] = kernels.select("nvfp4_linear", device)
    return res


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="*", help="MxK shapes (default: GPU or CPU set)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gemms", nargs="*", help="MxNxK GEMMs (default: GPU set; none on CPU)")
    ap.add_argument("--reps", type=int, default=200, help="ms of timed runs per op on GPU (do_bench rep)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = args.shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    info = _device_info(device)
    results = []
    print(f"{'shape':>12} {'op':<32} {'median ms':>10} {'GB/s':>9} {'x copy':>7}")
    for s in shapes:
        m, k = (int(v) for v in s.lower().split("x"))
        r = bench_shape(m, k, device, dtype, args.reps)
        results.append(r)
        for name, v in r.items():
            if isinstance(v, dict):
                ratio = f"{v['ratio_to_copy']:.2f}" if v["ratio_to_copy"] is not None else "-"
                print(f"{s:>12} {name:<32} {v['median_ms']:>10.4f} {v['gb_per_s']:>9.1f} {ratio:>7}")
    gemms = args.gemms if args.gemms is not None else (GPU_GEMMS if device.type == "cuda" else [])
    gemm_results = []
    if gemms:
        print(f"{'gemm':>16} {'path':<20} {'median ms':>10} {'TFLOP/s':>9} {'x bf16':>7}")
    for s in gemms:
        m, n, k = (int(v) for v in s.lower().split("x"))
        r = bench_gemm(m, n, k, device, args.reps)
        gemm_results.append(r)
        for name, v in r.items():
            if isinstance(v, dict) and "median_ms" in v:
                print(f"{s:>16} {name:<20} {v['median_ms']:>10.4f} {v['tflops']:>9.1f} {v['ratio_to_bf16']:>7.2f}")
        for name, why in r["notes"].items():
            print(f"{s:>16} {name:<20} skipped: {why}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = str(info.get("name", device.type)).replace(" ", "_").replace("/", "_") if device.type == "cuda" else "cpu"
    path = out_dir / f"{dt.date.today().isoformat()}-{tag}-kernels.json"
    path.write_text(json.dumps({"bench": "kernels", "info": info, "results": results, "gemms": gemm_results}, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
