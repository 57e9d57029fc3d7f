"""Rank fidelity of the explore copy on the tiny editing pipelines (FLUX.1 Kontext and Qwen-Image-Edit classes) beside
their text-to-image families (FLUX.1 with the same tiny weights as Kontext; Qwen-Image): `solrl fidelity`'s
measurement (Spearman and Kendall of the previews' ranking against full-step full-precision rollouts of the same
seeds), NVFP4 and FP8, the edits scored by the editing rewards (clip_direction + 0.5 preserve) on the bundled editing
set, the text-to-image by CLIPScore on the bundled sample set. Qwen-Image and its editor guide (4.0, each edit
against its own source-conditioned negative); FLUX.1's guidance is distilled.

    python bench/edit_fidelity.py --out bench/results/2026-11-29-cpu-edit-fidelity.json

The pipelines are the tests' tiny random-weight ones (tests/tiny_pipelines.py) scored by a tiny random CLIP: the
numbers say the measurement runs on edits as on images, with the previews conditioned on the source as the finals
are, not what a trained editor would show.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny pipelines are built as the tests build them


def main(argv: list[str] | None = None) -> Path:
    from tiny_pipelines import (
        SIZES,
        build_clip_reward,
        build_flux,
        build_flux_kontext,
        build_qwenimage,
        build_qwenimage_edit,
        qwen_vl_processor,
    )

    from solrl_engine.rl import load_config
    from solrl_engine.rl.fidelity import fidelity

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--preview-steps", type=int, default=2)
    ap.add_argument("--full-steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"{dt.date.today()}-cpu-edit-fidelity.json"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, qwen_vl_processor():
        clip = build_clip_reward(Path(tmp) / "clip")
        pipes = {"flux": build_flux(Path(tmp) / "flux"), "flux_kontext": build_flux_kontext(Path(tmp) / "kontext"),
                 "qwenimage": build_qwenimage(Path(tmp) / "qwen"),
                 "qwenimage_edit": build_qwenimage_edit(Path(tmp) / "qwen_edit")}  # fmt: skip
        common = [f"preview_steps={args.preview_steps}", f"full_steps={args.full_steps}", "device=cpu",
                  f"resolution={SIZES['flux']}", "solver=euler"]  # fmt: skip
        cases = [
            ("flux", "configs/flux1.py:flux1_sol_rl_clipscore", [f"reward_args=clipscore.model={clip}",
                                                                 "train_prompts=sample/train"]),
            ("flux_kontext", "configs/flux_kontext.py:flux_kontext_sol_rl_edit",
             [f"reward_args=clip_direction.model={clip}"]),
            ("qwenimage", "configs/qwenimage.py:qwenimage_sol_rl_clipscore", [f"reward_args=clipscore.model={clip}",
                                                                              "train_prompts=sample/train"]),
            ("qwenimage_edit", "configs/qwenimage_edit.py:qwenimage_edit_sol_rl_edit",
             [f"reward_args=clip_direction.model={clip}"]),
        ]  # fmt: skip
        for model, preset, extra in cases:
            for prec in ("nvfp4", "fp8"):
                sets = [f"model_path={pipes[model]}", f"explore_precision={prec}", *common, *extra]
                t0 = time.perf_counter()
                res = fidelity(load_config(str(ROOT / preset), sets), prompts=args.prompts, n=args.n, k=args.k,
                               progress=False)  # fmt: skip
                res.pop("per_prompt", None)
                rows.append({"model": model, "explore": prec, "seconds": time.perf_counter() - t0, **res})
                _write(args, rows)  # after every row: a cut-off run keeps what it measured
                print(f"{model:<13} {prec:<6} spearman {res['spearman_mean']:+.3f} kendall {res['kendall_mean']:+.3f} "
                      f"({res['quantized_layers']} quantized layers, {res['quantized_flop_share']:.0%} of the "
                      "linear FLOPs)", flush=True)  # fmt: skip
    out = _write(args, rows)
    print(f"wrote {out}")
    return out


def _write(args: argparse.Namespace, rows: list[dict]) -> Path:
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    rec = {"bench": "edit-fidelity", "settings": settings,
           "note": "tiny random-weight pipelines of the real classes (the same FLUX.1 weights for FLUX.1 and Kontext) "
                   "and a tiny random CLIP: the measurement, not what trained models show", "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.write_text(json.dumps(rec, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
