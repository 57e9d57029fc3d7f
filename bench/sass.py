"""Static cost of the GEMM kernels without a GPU: compile them for sm_90a with the installed Triton
(its bundled ptxas/nvdisasm), and count the SASS instructions in each kernel's main loop.

Why: on Hopper the NVFP4 GEMM decodes its operands with ordinary instructions while the tensor cores
multiply, so the loop's instruction count per K step bounds its speed. With W warps on an SM's 4
schedulers, one K step issues in about W * count / 4 cycles; the MMA of a BM x BN x BK step takes
BM * BN * BK / 2048 cycles on an H100 (FP16). `issue_per_mma` is their ratio: below 1 the tensor
cores are the limit, above 1 the decode is. A proxy to compare kernel versions, not a timing.

    python bench/sass.py                      # writes bench/results/<date>-sm90a-sass.json
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

W4A4_SIG = {
    "aq_ptr": "*i32", "as_ptr": "*u8", "ga_ptr": "*fp32", "bq_ptr": "*i32", "bs_ptr": "*u8", "gb_ptr": "*fp32",
    "bias_ptr": "*bf16", "out_ptr": "*i16", "M": "i32", "N": "i32", "K": "i32", "BM": "constexpr",
    "BN": "constexpr", "BK": "constexpr", "GROUP_M": "constexpr", "HAS_BIAS": "constexpr", "OUT_KIND": "constexpr",
}  # fmt: skip
W4A16_SIG = {
    "x_ptr": "*bf16", "bq_ptr": "*i32", "bs_ptr": "*u8", "gb_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32",
    "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
    "HAS_BIAS": "constexpr", "OUT_KIND": "constexpr", "PARTIAL": "constexpr", "DOT_F32": "constexpr",
}  # fmt: skip


def _main_loop(sass: str) -> collections.Counter:
    """Opcode counts of the longest backward branch's body (the K loop)."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lm = re.match(r"\s*(\.L_x_\d+):", line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update({p: addr for p in pending})
            pending = []
            ins.append((addr, m.group(2)))
    best = None
    for addr, text in ins:
        bm = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if bm and bm.group(1) in labels and labels[bm.group(1)] < addr:
            if best is None or addr - labels[bm.group(1)] > best[1] - best[0]:
                best = (labels[bm.group(1)], addr)
    body = [t for a, t in ins if best and best[0] <= a <= best[1]]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def compile_and_count(fn, sig: dict, consts: dict, warps: int, stages: int) -> dict[str, object]:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*") or t == "i32"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    loop = _main_loop(sass)
    every = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0].split(".")[0]
        for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s*(.*?);", sass)
    )
    return {
        "loop_instructions": sum(loop.values()),
        "loop_top_ops": dict(loop.most_common(8)),
        "spill_loads": every.get("LDL", 0),
        "spill_stores": every.get("STL", 0),
        "shared_bytes": k.metadata.shared,
    }


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench/sass.py compiles real GPU code: run it without TRITON_INTERPRET=1")
    import triton

    from solrl_engine.kernels.dispatch import triton_module

    gemm = triton_module("gemm")

    rows = []
    for cfg in gemm._w4a4_configs():
        c = cfg.kwargs
        consts = {**c, "HAS_BIAS": True, "OUT_KIND": 1}
        r = compile_and_count(gemm._w4a4_kernel, W4A4_SIG, consts, cfg.num_warps, cfg.num_stages)
        mma_cycles = c["BM"] * c["BN"] * c["BK"] / 2048
        r.update(kernel="w4a4", tile=[c["BM"], c["BN"], c["BK"]], warps=cfg.num_warps, stages=cfg.num_stages)
        r["issue_per_mma"] = cfg.num_warps * r["loop_instructions"] / 4 / mma_cycles
        rows.append(r)
    for xdt in ("*bf16", "*fp16"):
        bm, bn, bk, _, warps, stages = 16, 64, 256, 1, 4, 4
        consts = {"BM": bm, "BN": bn, "BK": bk, "HAS_BIAS": False, "OUT_KIND": 0, "PARTIAL": True, "DOT_F32": False}
        r = compile_and_count(gemm._w4a16_kernel, {**W4A16_SIG, "x_ptr": xdt}, consts, warps, stages)
        weight_bytes = bn * (bk // 2 + bk // 16)
        r.update(kernel=f"w4a16_{xdt[1:]}", tile=[bm, bn, bk], warps=warps, stages=stages)
        r["weight_bytes_per_issue_cycle"] = weight_bytes / (warps * r["loop_instructions"] / 4)
        rows.append(r)
    for r in rows:
        if "issue_per_mma" in r:
            extra = f"issue/MMA {r['issue_per_mma']:.2f}"
        else:
            extra = f"weight B/issue-cycle {r['weight_bytes_per_issue_cycle']:.1f} (H100 HBM share ~14.5)"
        print(f"{r['kernel']:>11} {str(r['tile']):>16} w{r['warps']} s{r['stages']}: loop {r['loop_instructions']:>5} "
              f"instr, spills {r['spill_loads']}/{r['spill_stores']}, {extra}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}-sm90a-sass.json"
    rec = {"bench": "static SASS counts of the GEMM main loops (compiled for sm_90a, not run)",
           "triton": triton.__version__, "rows": rows}  # fmt: skip
    path.write_text(json.dumps(rec, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
