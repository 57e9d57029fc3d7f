"""Rank fidelity of the explore copy on a tiny video pipeline (Wan classes) beside a tiny image one (SD3 classes),
and of the explore-only low-precision attention options on the video one (FP8 and INT8 through their ops'
PyTorch references; each also through its Triton kernel at a simulated sm_90, `@sm90`, the interpreter running
it): `solrl fidelity`'s measurement (Spearman and Kendall of the previews' ranking against full-step
full-precision rollouts of the same seeds).

    python bench/video_fidelity.py --out bench/results/2026-11-25-cpu-video-fidelity.json
    python bench/video_fidelity.py --explore fp8+fp8-attention,fp8+fp8-attention@sm90 --out ...   # some rows

The pipelines are the tests' tiny random-weight ones (tests/tiny_pipelines.py: the real diffusers classes at toy
widths) scored by a tiny random CLIP: the numbers say the measurement runs on video as on images and how the
options move it, not what a trained Wan would show (no real weights here).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny pipelines are built as the tests build them
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import: the @sm90 rows run the kernel on a CPU


def main(argv: list[str] | None = None) -> Path:
    from tiny_pipelines import SIZES, WAN_FRAMES, build_clip_reward, build_sd3, build_wan

    from solrl_engine.rl import load_config
    from solrl_engine.rl.fidelity import fidelity

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--preview-steps", type=int, default=2)
    ap.add_argument("--full-steps", type=int, default=4)
    ap.add_argument("--explore", default="", help="comma-separated explore rows to run (e.g. fp8+fp8-attention@sm90); "
                                                  "default every row of both pipelines")  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"{dt.date.today()}-cpu-video-fidelity.json"))
    args = ap.parse_args(argv)
    only = {e for e in args.explore.split(",") if e}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clip = build_clip_reward(Path(tmp) / "clip")
        pipes = {"sd3": build_sd3(Path(tmp) / "sd3"), "wan": build_wan(Path(tmp) / "wan")}
        steps = [f"preview_steps={args.preview_steps}", f"full_steps={args.full_steps}", "device=cpu",
                 f"reward_args=clipscore.model={clip}"]  # fmt: skip
        cases = [
            ("sd3", "configs/sd3.py:sd3_sol_rl_clipscore", [f"resolution={SIZES['sd3']}"], ("nvfp4", "fp8")),
            ("wan", "configs/wan.py:wan13b_sol_rl_clipscore",
             [f"resolution={SIZES['wan']}", f"width={SIZES['wan']}", f"frames={WAN_FRAMES}", "reward_frames=3"],
             ("nvfp4", "fp8", "fp8+fp8-attention", "fp8+fp8-attention@sm90", "fp8+int8-attention",
              "fp8+int8-attention@sm90")),
        ]  # fmt: skip
        for model, preset, extra, precisions in cases:
            for prec in precisions:
                if only and prec not in only:
                    continue
                case, _, sm = prec.partition("@sm")
                fmt, _, att = case.partition("+")
                sets = [f"model_path={pipes[model]}", f"explore_precision={fmt}", *steps, *extra]
                if att:
                    sets.append(f"explore_attention={att.removesuffix('-attention')}")
                if sm:
                    os.environ["SOLRL_SIMULATE_SM"] = sm
                t0 = time.perf_counter()
                try:
                    res = fidelity(load_config(str(ROOT / preset), sets), prompts=args.prompts, n=args.n, k=args.k,
                                   progress=False)  # fmt: skip
                finally:
                    os.environ.pop("SOLRL_SIMULATE_SM", None)
                res.pop("per_prompt", None)
                rows.append({"model": model, "explore": prec, "seconds": time.perf_counter() - t0, **res})
                _write(args, rows)  # after every row: a cut-off run keeps what it measured
                print(f"{model:<4} {prec:<18} spearman {res['spearman_mean']:+.3f} kendall {res['kendall_mean']:+.3f} "
                      f"({res['quantized_layers']} quantized layers, {res['quantized_flop_share']:.0%} of the "
                      "linear FLOPs)", flush=True)  # fmt: skip
    out = _write(args, rows)
    print(f"wrote {out}")
    return out


def _write(args: argparse.Namespace, rows: list[dict]) -> Path:
    from tiny_pipelines import MAX_SEQUENCE_LENGTH

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    rec = {"bench": "video-fidelity", "settings": settings, "max_sequence_length": MAX_SEQUENCE_LENGTH,
           "note": "tiny random-weight pipelines of the real classes and a tiny random CLIP: the measurement, not "
                   "what trained models show", "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.write_text(json.dumps(rec, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
