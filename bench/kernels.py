"""Quantization kernel microbenchmark: NVFP4 quantize / fake-quant and FP8 row-wise quantize,
each against a device-to-device copy of the same input measured in the same run.

    python bench/kernels.py                       # GPU: 8192x8192 + DiT shapes; CPU: tiny smoke sizes
    python bench/kernels.py --shapes 4096x3072 --out bench/results

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

GPU_SHAPES = ["8192x8192", "4096x3072", "4096x12288", "16384x2432"]  # square, FLUX/SD3.5-L-like DiT
CPU_SHAPES = ["256x1024"]


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


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="*", help="MxK shapes (default: GPU or CPU set)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
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
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = str(info.get("name", device.type)).replace(" ", "_").replace("/", "_") if device.type == "cuda" else "cpu"
    path = out_dir / f"{dt.date.today().isoformat()}-{tag}-kernels.json"
    path.write_text(json.dumps({"bench": "kernels", "info": info, "results": results}, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
