"""Every Triton launch the engine makes, compiled by the real Triton compiler for sm_90a and sm_100a on a CPU.

Why: the CPU interpreter (TRITON_INTERPRET=1), which runs the kernels' numerics tests, accepts code the
compiler refuses: a plain Python float read as a global, a float64 constant meeting an fp32-only
intrinsic. The first lent H100 stopped at its first quantized layer on exactly these. This script
calls each launcher with CPU tensors while Triton's launch is replaced by a recorder (nothing runs), so
the argument types, constexprs, warps and stages are the ones a GPU run takes, then compiles each
recorded launch to a cubin (Triton's bundled ptxas), with its pointers specialized as 16-byte aligned, as
contiguous torch tensors are (Triton's other specialization, integers equal to 1, is not applied). It
also reads each bit-exact kernel's PTX: those must hold no contracted multiply-add (a GPU build fuses
a*b+c by default; the reference rounds twice), so they launch with enable_fp_fusion=False.

    python bench/compile_kernels.py                  # sm_90a and sm_100a, prints one line per launch
    python bench/compile_kernels.py --arch 90 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Kernels whose outputs are checked bit for bit against solrl_engine.quant (docs/design.md section 4):
# their PTX must not contract a*b+c into one rounding. The GEMMs' accumulation order differs from any
# reference anyway, so they keep the compiler's default.
BIT_EXACT = ("_fp8_rowwise_kernel", "_int8_rowwise_kernel", "_epilogue_kernel", "_amax_kernel", "_rot_amax_kernel",
             "_quantize_kernel", "_rotate_kernel", "_dequantize_kernel", "_int8_gemm_kernel",
             "_adaln_quantize_kernel", "_gelu_quantize_kernel", "_glu_quantize_kernel",
             "_rms_quantize_kernel")  # fmt: skip
# Kernels that also serve an older architecture than the default targets: the INT8 GEMM and attention run on Ampere
# (sm_80), and their int8 dots must compile there (mma.sync) as well as on Hopper (wgmma) and Blackwell.
ALSO_FOR = {"_int8_gemm_kernel": (80,), "_int8_attention_kernel": (80,), "_adaln_quantize_kernel": (80,),
            "_gelu_quantize_kernel": (80,), "_glu_quantize_kernel": (80,), "_rms_quantize_kernel": (80,)}
MODULES = ("fp8", "int8", "nvfp4", "gemm", "attention", "producers")  # every module of triton_kernels/ with kernels

_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")


def _arg_type(value: object) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
                 torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                 torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip
        return "*" + names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


class Launch:
    """One recorded `kernel[grid](...)`: the kernel, its signature and constexprs, its compile options."""

    def __init__(self, fn: object, args: tuple, kwargs: dict, options: dict) -> None:
        names = fn.arg_names  # type: ignore[attr-defined]
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{fn.__name__}: launch without {missing}")  # type: ignore[attr-defined]
        constexpr = {p.name for p in fn.params if p.is_constexpr}  # type: ignore[attr-defined]
        self.fn = fn
        self.name: str = fn.__name__  # type: ignore[attr-defined]
        self.signature = {n: ("constexpr" if n in constexpr else _arg_type(bound[n])) for n in names}
        self.constexprs = {n: bound[n] for n in names if n in constexpr}
        self.options = options

    def key(self) -> tuple:
        return (self.name, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                tuple(sorted(self.options.items())))  # fmt: skip

    def describe(self) -> str:
        ptrs = ",".join(t[1:] for t in self.signature.values() if t.startswith("*"))
        consts = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        opts = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}({ptrs}) {consts} {opts}".strip()


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Replace Triton's launch (JIT functions and autotuners) by a recorder; nothing runs. An autotuned
    kernel records one launch per config, as its first GPU call compiles every config."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def jit_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        options = {k: kwargs[k] for k in _OPTION_KEYS if k in kwargs}
        launches.append(Launch(self, args, kwargs, options))

    def tuned_run(self, *args, **kwargs):  # noqa: ANN001, ANN202
        kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        for cfg in self.configs:
            options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            launches.append(Launch(self.fn, args, {**kwargs, **cfg.kwargs}, options))

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, tuned_run  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = saved  # type: ignore[method-assign]


def engine_launches() -> list[Launch]:
    """Call every public launcher of triton_kernels/ over the variants a run takes (input dtypes, output
    dtypes, rotations, 4/6 scaling, bias, split-K, short and long rows) and return the distinct launches."""
    import torch

    from solrl_engine.kernels.dispatch import triton_module

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_kernels records GPU launches: run it without TRITON_INTERPRET=1")
    fp8, int8, nvfp4, gemm, attention, producers = (triton_module(n) for n in MODULES)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    signs = {n: torch.ones(n) for n in (16, 32, 64, 128)}
    with recording() as rec:
        for dt in dtypes:
            for shape in ((4, 64), (3, 5000), (256, 3072)):
                x = torch.empty(shape, dtype=dt)
                fp8.quantize_rowwise(x)
                int8.quantize_rowwise(x)
            x = torch.empty(32, 256, dtype=dt)
            nvfp4.amax(x)
            # every rotation size for BF16 (a run's activations), the smallest for the other dtypes
            for rot in (None, *signs.values()) if dt == torch.bfloat16 else (None, signs[16]):
                for fos in (False, True):
                    nvfp4.quantize(x, rht_signs=rot, four_over_six=fos)
                    nvfp4.fake_quantize(x, rht_signs=rot, four_over_six=fos)
                nvfp4.quantize(x, amax_value=torch.ones(()), rht_signs=rot)
                if rot is not None:
                    nvfp4.rotate(x, rot, dtype=dt)
            nvfp4.dequantize(torch.empty(32, 128, dtype=torch.uint8), torch.empty(32, 16, dtype=torch.uint8),
                             torch.ones(()), dt)  # fmt: skip
            acc = torch.empty(64, 96, dtype=torch.int32)
            for bias in (None, torch.empty(96), torch.empty(96, dtype=torch.bfloat16)):
                int8.scale_epilogue(acc, torch.ones(64, 1), torch.ones(96, 1), bias, dt)
            for m in (40, 512):  # the short-M tile and the full one
                for bias in (None, torch.empty(256, dtype=torch.bfloat16)):
                    int8.gemm(torch.empty(m, 1024, dtype=torch.int8), torch.ones(m, 1),
                              torch.empty(256, 1024, dtype=torch.int8), torch.ones(256, 1), bias, dt)  # fmt: skip
        for d in (64, 112, 128):  # the explore pass's INT8 attention at the head dims of the families (SANA-Video: 112)
            for out in (torch.bfloat16, torch.float32):
                attention.int8_attention(torch.empty(2, 300, d, dtype=torch.int8), torch.ones(2, 3),
                                         torch.empty(2, 300, d, dtype=torch.int8), torch.ones(2, 5),
                                         torch.empty(2, 300, d, dtype=torch.bfloat16), d**-0.5, out)  # fmt: skip
                # and FP8 (Q K^T and P V on the FP8 tensor cores: sm_89+, so the default targets only)
                e4m3, rows = torch.float8_e4m3fn, torch.ones(2, 300, 1)
                attention.fp8_attention(torch.empty(2, 300, d, dtype=e4m3), rows, torch.empty(2, 300, d, dtype=e4m3),
                                        rows, torch.empty(2, d, 300, dtype=e4m3), torch.ones(2, d, 1), d**-0.5,
                                        out)  # fmt: skip
            # with a key-padding mask's bias (SANA's and Qwen-Image's attention), both kernels
            bias = torch.zeros(2, 300)
            attention.int8_attention(torch.empty(2, 300, d, dtype=torch.int8), torch.ones(2, 3),
                                     torch.empty(2, 300, d, dtype=torch.int8), torch.ones(2, 5),
                                     torch.empty(2, 300, d, dtype=torch.bfloat16), d**-0.5, torch.bfloat16,
                                     bias)  # fmt: skip
            attention.fp8_attention(torch.empty(2, 300, d, dtype=e4m3), rows, torch.empty(2, 300, d, dtype=e4m3), rows,
                                    torch.empty(2, d, 300, dtype=e4m3), torch.ones(2, d, 1), d**-0.5, torch.bfloat16,
                                    448.0, bias)  # fmt: skip
        # the producers of SD3.5-Large, FLUX.1 and Qwen-Image (adaLN), SANA-1.6B and Wan2.1-1.3B / 14B (inline), rows
        # of their hidden size
        for k in (2432, 3072, 2240, 1536, 5120):
            mod = torch.ones(2, k)
            for fmt in ("fp8", "int8"):  # under autocast on a GPU (FP32 y), in BF16 without it (staged), and FP32
                x = torch.empty(2, 7, k, dtype=torch.bfloat16)  # cast to BF16 by the block (SANA's norm1, Wan's)
                producers.adaln_quantize(x, mod, mod, 1e-6, fmt, False, torch.float32)
                producers.adaln_quantize(x, mod, mod, 1e-6, fmt, True, torch.bfloat16)
                producers.adaln_quantize(x, mod, mod, 1e-6, fmt, False, torch.bfloat16)
        # the FFN GELUs of FLUX.1 / Qwen-Image (12288), SD3.5-Large (9728), Wan2.1-1.3B (8960) and -14B (13824)
        for k in (12288, 9728, 8960, 13824):
            for fmt in ("fp8", "int8"):
                for dt in (torch.bfloat16, torch.float32):
                    producers.gelu_quantize(torch.empty(2, 7, k, dtype=dt), fmt)
                    if k == 12288:  # FLUX.1's single block: its attention's 3072 values, then the MLP's GELU
                        producers.gelu_quantize(torch.empty(2, 7, k, dtype=dt), fmt, torch.empty(2, 7, 3072, dtype=dt))
        # SANA's FFN gate (GLUMBConv: a * silu(g) over pixel rows) at SANA-1.6B's (5600) and SANA-600M's (2880) width
        for k in (5600, 2880):
            for fmt in ("fp8", "int8"):
                for dt in (torch.bfloat16, torch.float32):
                    producers.glu_quantize(torch.empty(2, 4, 4, 2 * k, dtype=dt), fmt)
        # FLUX.2 [klein] 4B's SwiGLUs: each FFN's (9216 values a row), the single block's joined after its attention's
        # 3072 values
        for fmt in ("fp8", "int8"):
            for dt in (torch.bfloat16, torch.float32):
                x = torch.empty(2, 7, 2 * 9216, dtype=dt)
                producers.glu_quantize(x, fmt, True)
                producers.glu_quantize(x, fmt, True, torch.empty(2, 7, 3072, dtype=dt))
        # Z-Image's modulated RMS norms (3840: BF16 weight and scale under autocast, FP32 without) and its SwiGLU of
        # two linears (10240 values a row)
        for fmt in ("fp8", "int8"):
            for dt in (torch.bfloat16, torch.float32):
                x = torch.empty(2, 7, 3840, dtype=dt)
                producers.rms_quantize(x, torch.ones(3840, dtype=dt), 1e-5, torch.ones(2, 3840, dtype=dt), fmt, dt)
                h = torch.empty(2, 7, 10240, dtype=dt)
                producers.glu_quantize(h, fmt, True, None, h)
        # the same producers writing their codes alone (every linear they feed takes the codes: STORE_Y off), as a
        # GPU's autocast runs them: BF16 activations, an adaLN's FP32 y (FLUX.1) or its BF16 cast (SANA)
        bf = torch.bfloat16
        for fmt in ("fp8", "int8"):
            producers.adaln_quantize(torch.empty(2, 7, 3072, dtype=bf), torch.ones(2, 3072), torch.ones(2, 3072), 1e-6,
                                     fmt, False, torch.float32, False)  # fmt: skip
            producers.adaln_quantize(torch.empty(2, 7, 2240, dtype=bf), torch.ones(2, 2240), torch.ones(2, 2240), 1e-6,
                                     fmt, False, bf, False)  # fmt: skip
            producers.gelu_quantize(torch.empty(2, 7, 12288, dtype=bf), fmt, None, False)
            producers.gelu_quantize(torch.empty(2, 7, 12288, dtype=bf), fmt, torch.empty(2, 7, 3072, dtype=bf), False)
            producers.glu_quantize(torch.empty(2, 4, 4, 2 * 5600, dtype=bf), fmt, False, None, None, False)
            producers.glu_quantize(torch.empty(2, 7, 2 * 9216, dtype=bf), fmt, True, torch.empty(2, 7, 3072, dtype=bf),
                                   None, False)  # fmt: skip
            h = torch.empty(2, 7, 10240, dtype=bf)
            producers.glu_quantize(h, fmt, True, None, h, False)
            producers.rms_quantize(torch.empty(2, 7, 3840, dtype=bf), torch.ones(3840, dtype=bf), 1e-5,
                                   torch.ones(2, 3840, dtype=bf), fmt, bf, False)  # fmt: skip
        q = torch.empty(256, 512, dtype=torch.uint8)
        s = torch.empty(256, 64, dtype=torch.uint8)
        g = torch.ones(())
        for out in dtypes:
            for bias in (None, torch.empty(256, dtype=torch.bfloat16)):
                gemm.w4a4_gemm(q, s, g, q, s, g, bias=bias, out_dtype=out)
        for xdt in (torch.bfloat16, torch.float16):
            for m in (8, 40, 512):  # split-K at small M, one pass at large M
                for bias in (None, torch.empty(256, dtype=xdt)):
                    gemm.w4a16_gemm(torch.empty(m, 1024, dtype=xdt), torch.empty(256, 512, dtype=torch.uint8),
                                    torch.empty(256, 64, dtype=torch.uint8), g, bias=bias)  # fmt: skip
    unique: dict[tuple, Launch] = {}
    for launch in rec:
        unique.setdefault(launch.key(), launch)
    return list(unique.values())


def every_kernel() -> set[str]:
    """Names of every @triton.jit kernel (a function with `_kernel` in its name) in triton_kernels/."""
    from triton.runtime.jit import JITFunction

    from solrl_engine.kernels.dispatch import triton_module

    names = set()
    for mod in (triton_module(n) for n in MODULES):
        names |= {v.__name__ for v in vars(mod).values() if isinstance(v, JITFunction) and "_kernel" in v.__name__}
    return names


_FMA = re.compile(r"^\s*(?:@%p\d+\s+)?fma\.rn\.f32", re.M)
# the tensor-core instructions a kernel issues, with their operand types (what a dot really runs on: an FP8 dot that
# the compiler upcast would show f16 here): Ampere's mma.sync, Hopper's wgmma, Blackwell's tcgen05.mma kinds
_MMA = re.compile(r"\b(mma\.sync\.aligned\.m\d+n\d+k\d+[\w.]*|wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[\w.]+"
                  r"|tcgen05\.mma\.cta_group::\d\.kind::\w+)")


def compile_launch(launch: Launch, arch: int) -> dict[str, object]:
    """Compile one launch to a cubin for sm_<arch>a; count contracted multiply-adds in its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a GPU launch specializes a 16-byte-aligned pointer (every contiguous torch allocation) as divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(launch.signature.values()) if t.startswith("*")}
    src = ASTSource(fn=launch.fn, signature=launch.signature, constexprs=launch.constexprs, attrs=attrs)
    t0 = time.perf_counter()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    ptx = k.asm["ptx"]
    return {"cubin_bytes": len(k.asm["cubin"]), "fma": len(_FMA.findall(ptx)), "mma": sorted(set(_MMA.findall(ptx))),
            "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip


def check(archs: tuple[int, ...] = (90, 100), log: Callable[[str], None] = print) -> dict[str, object]:
    """Record, compile and judge every launch; returns the record (`ok` false names each failure)."""
    import triton

    launches = engine_launches()
    missing = sorted(every_kernel() - {ln.name for ln in launches})
    rows, failures = [], []
    for launch in launches:
        for arch in (*archs, *(a for a in ALSO_FOR.get(launch.name, ()) if a not in archs)):
            row: dict[str, object] = {"launch": launch.describe(), "arch": f"sm_{arch}" + ("a" if arch >= 90 else "")}
            try:
                row.update(compile_launch(launch, arch))
            except Exception as e:  # noqa: BLE001 - each failure is reported with its launch
                msg = str(e).strip().splitlines()
                row["error"] = f"{type(e).__name__}: {msg[-1] if msg else ''}"
                failures.append(f"{row['launch']} for {row['arch']}: {row['error']}")
            else:
                if launch.name in BIT_EXACT and (row["fma"] or launch.options.get("enable_fp_fusion", True)):
                    row["error"] = (f"a bit-exact kernel compiled with FP fusion ({row['fma']} fma.rn.f32 in "
                                    f"its PTX): launch it with enable_fp_fusion=False")  # fmt: skip
                    failures.append(f"{row['launch']} for {row['arch']}: {row['error']}")
            log(f"{row['arch']} {row['launch']}: " + (row.get("error") or f"ok, {row['cubin_bytes']} B cubin, "
                                                     f"{row['fma']} fma, {row['seconds']} s"))  # fmt: skip
            rows.append(row)
    if missing:
        failures.append(f"kernels no launcher reached (add them to engine_launches): {missing}")
    return {"bench": "compile every Triton launch for the GPU on a CPU", "triton": triton.__version__,
            "launches": len(launches), "ok": not failures, "failures": failures, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10 (90, 100); default both")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    rec = check(tuple(args.arch or (90, 100)))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1))
    verdict = "all compile" if rec["ok"] else "FAILED:\n  " + "\n  ".join(rec["failures"])
    print(f"{rec['launches']} launches: {verdict}")
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
