"""Behaviour pinned across a refactor: the tiny sol_rl, compile, naive_quant and diffusionnft presets, 3 iterations
each through the real trainer (evaluation, best adapter, checkpoint and export included); every metric that is
not a time, and the sha256 of the trained adapters (trained, old, EMA) and of the explore copy's tensors.
Also `solrl fidelity` at explore_precision=auto (the hardware plan's precision) and the public Explorer
(select, sync_, select). Two such files written by two trees on the same machine must be equal, bit for bit.

    python bench/same_metrics.py --out /tmp/after.json                       # the engine this Python imports
    mkdir -p /tmp/base && git archive HEAD~1 solrl_engine configs | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python bench/same_metrics.py --out /tmp/before.json  # the previous commit's engine
    python bench/same_metrics.py --compare /tmp/before.json /tmp/after.json  # exit 1 on any difference

Uses only what both trees have (solrl_engine.rl.load_config, solrl_engine.rl.trainer.Trainer, Trainer.run,
.adapters, .explore) and each tree's own configs/tiny.py. explore_precision is pinned to nvfp4 (with the
preset's 128-point rotation and 4-over-6 scales): `auto` times this machine, which is not behaviour.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

PRESETS = ("sol_rl", "compile", "naive_quant", "diffusionnft")  # the trainer's families; "fidelity", "explorer"
EXTRA = ("fidelity", "explorer")
SETS = ["iterations=3", "n=8", "k=4", "prompts_per_iter=2", "rollout_batch_size=16", "train_batch_size=8",
        "eval_every=3", "save_every=3", "eval_prompt_count=4", "eval_seeds=1", "eval_train_prompt_count=2",
        "explore_precision=nvfp4", "device=cpu"]  # fmt: skip
PRESET_SETS = {"diffusionnft": ["n=4"]}  # it trains on every rollout: N = K


def _kept(d: dict, out: Path) -> dict:
    """A record without what measures the machine (times) or names this run's directory (paths)."""
    return {k: v.replace(str(out), "OUT") if isinstance(v, str) else v
            for k, v in d.items() if not k.startswith("time_") and k != "mean_time_total_s"}  # fmt: skip


def _digest(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_preset(family: str, root: Path, tmp: Path, threads: int) -> dict:
    import torch

    from solrl_engine.rl import load_config
    from solrl_engine.rl.trainer import Trainer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out = tmp / family
    sets = SETS + PRESET_SETS.get(family, []) + [f"output={out}", f"compile_cache_dir={tmp / 'inductor'}"]
    cfg = load_config(f"{root / 'configs' / 'tiny.py'}:tiny_{family}_shapes", sets)
    tr = Trainer(cfg, progress=False)
    summary = tr.run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    adapters = {f"{a}/{n}": t for a, d in tr.adapters.state_dict().items() for n, t in d.items()}
    q = out / "quantization.txt"
    return {
        "metrics": [_kept(r, out) for r in rows],
        "summary": _kept(summary, out),
        "adapters_sha256": _digest(adapters),
        "explore_copy_sha256": None if tr.explore is None else _digest(tr.explore.transformer.state_dict()),
        "quantization_txt_sha256": hashlib.sha256(q.read_bytes()).hexdigest() if q.exists() else None,
    }


def run_fidelity(root: Path, threads: int) -> dict:
    """`solrl fidelity` at explore_precision=auto: the hardware plan's precision, not timed (deterministic)."""
    import torch

    from solrl_engine.rl import load_config
    from solrl_engine.rl.fidelity import fidelity

    torch.set_num_threads(threads)
    cfg = load_config(f"{root / 'configs' / 'tiny.py'}:tiny_sol_rl_shapes", ["device=cpu", "explore_precision=auto"])
    res = fidelity(cfg, prompts=2, n=6, k=2, progress=False)
    return {k: v for k, v in res.items() if not k.startswith("time_") and k != "oracle_cached"}


def run_explorer(threads: int) -> dict:
    """The public Explorer on the bundled model: select, an update written back with sync_, select again."""
    import torch

    from solrl_engine.data import load_prompts
    from solrl_engine.explore import Explorer  # the README's import path, in both trees
    from solrl_engine.models import load_model
    from solrl_engine.rewards import load_reward

    torch.set_num_threads(threads)
    model = load_model("tiny", None, "cpu", torch.float32)
    ex = Explorer(model, load_reward("shapes"), n=8, k=4, preview_steps=2, explore_precision="nvfp4",
                  quantize={"rht": 16, "four_over_six": True}, batch_size=16, seed=0)  # fmt: skip
    prompts = load_prompts("shapes/heldout")[:2]
    first = ex.select(prompts)
    with torch.no_grad():
        for p in model.transformer.parameters():
            p.mul_(1.001)
    synced = ex.sync_(model.transformer)
    second = ex.select(prompts)
    return {f"{tag}_{k}": v for tag, s in (("first", first), ("second", second)) for k, v in
            {"seeds": s.seeds, "proxy": s.proxy_rewards.tolist(), "ranks": s.ranks.tolist(),
             "all_rewards": s.all_rewards.tolist(), "noise_sha256": _digest({"noise": s.noise})}.items()} | {
        "synced_layers": synced}  # fmt: skip


def record(out_path: Path, presets: list[str], threads: int) -> None:
    import solrl_engine

    root = Path(solrl_engine.__file__).resolve().parents[1]
    print(f"engine: {root}", flush=True)
    res = {"engine": str(root), "threads": threads, "sets": SETS, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in presets:
            print(f"== {fam}", flush=True)
            if fam == "fidelity":
                res["presets"][fam] = run_fidelity(root, threads)
            elif fam == "explorer":
                res["presets"][fam] = run_explorer(threads)
            else:
                res["presets"][fam] = run_preset(fam, root, Path(tmp), threads)
    out_path.write_text(json.dumps(res, indent=1, sort_keys=True))
    print(f"wrote {out_path}")


def compare(a_path: Path, b_path: Path) -> int:
    a, b = (json.loads(p.read_text()) for p in (a_path, b_path))
    bad, added = 0, []
    for fam in sorted(set(a["presets"]) | set(b["presets"])):
        pa, pb = a["presets"].get(fam), b["presets"].get(fam)
        if pa is None or pb is None:
            print(f"{fam}: only in {'the second' if pa is None else 'the first'} file")
            bad += 1
            continue
        for key in sorted(set(pa) | set(pb)):
            va, vb = pa.get(key), pb.get(key)
            if key not in pa:  # a field the newer tree reports and the older did not: nothing to compare
                added.append(f"{fam}.{key}")
                continue
            if json.dumps(va, sort_keys=True) == json.dumps(vb, sort_keys=True):  # NaN == NaN here, as text
                continue
            bad += 1
            if key == "metrics" and isinstance(va, list) and isinstance(vb, list):
                for i, (ra, rb) in enumerate(zip(va, vb, strict=False)):
                    diff = {k: (ra.get(k), rb.get(k)) for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)}
                    if diff:
                        print(f"{fam}: metrics row {i + 1} differs: {diff}")
                if len(va) != len(vb):
                    print(f"{fam}: {len(va)} vs {len(vb)} metrics rows")
            else:
                print(f"{fam}: {key} differs: {va!r} vs {vb!r}")
    if added:
        print(f"new in the second file, not compared: {', '.join(added)}")
    n = sum(len(p.get("metrics", [])) for p in a["presets"].values())
    print("identical, bit for bit" if not bad else f"{bad} difference(s)", f"({len(a['presets'])} presets, {n} "
          f"iteration records; {a['engine']} vs {b['engine']})")  # fmt: skip
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the record of the engine this Python imports here")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--presets", default=",".join(PRESETS + EXTRA),
                    help="any of sol_rl, compile, naive_quant, diffusionnft, fidelity, explorer (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads: the same in both runs")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("give --out FILE or --compare BEFORE AFTER")
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order is part of what must not vary
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    record(args.out, [p.strip() for p in args.presets.split(",") if p.strip()], args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
