"""The bundled quickstart under two engines, one after the other on this machine: its update phase's seconds and its
held-out gain, paired image by image (the same held-out prompts and seeds).

    python bench/update_phase.py --base HEAD~3 --out bench/results/<date>-cpu-tiny-update-phase.json

`--base` is a git revision of this repository: its `solrl_engine` and `configs` are archived to a temporary
directory and imported from there (PYTHONPATH), the other run imports this tree. Each run is the README's
training command (configs/tiny.py:tiny_sol_rl_shapes, every default), in a child process of its own, alone on
the machine. The record keeps every iteration's phase times, both runs' paired gains, and the paired difference
of their final held-out rewards (after - base), whose standard error says whether the two trained policies differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = "configs/tiny.py:tiny_sol_rl_shapes"


def child(tree: Path, out: Path, record: Path) -> None:
    """One quickstart run with the engine on sys.path; every evaluation's per-image held-out rewards kept."""
    import torch

    import solrl_engine
    from solrl_engine.rl import load_config
    from solrl_engine.rl.heldout import HeldOut
    from solrl_engine.rl.trainer import Trainer

    seen: list[list[float]] = []
    track = HeldOut.track_best

    def keep(self: HeldOut, iteration: int, rewards: torch.Tensor) -> None:
        seen.append(rewards.tolist())
        track(self, iteration, rewards)

    HeldOut.track_best = keep
    cfg = load_config(f"{tree / PRESET}", [f"output={out}"])
    tr = Trainer(cfg, progress=False)
    summary = tr.run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    record.write_text(json.dumps({
        "engine": str(Path(solrl_engine.__file__).parent),
        "policy_dtype": str(tr.dtype).removeprefix("torch."),
        "explore_recipe": summary["explore_recipe"],
        "phase_s": {k: [r[k] for r in rows] for k in ("time_explore_s", "time_regen_s", "time_train_s",
                                                      "time_total_s")},
        "heldout_gain_final": summary["heldout_gain_final"],
        "heldout_gain_stderr_final": summary["heldout_gain_stderr_final"],
        "heldout_reward_final": summary["heldout_reward_final"],
        "final_rewards": seen[-1],
    }))  # fmt: skip


def _run(tree: Path, pythonpath: str | None, tmp: Path, name: str) -> dict:
    record = tmp / f"{name}.json"
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    subprocess.run([sys.executable, __file__, "--child", str(tree), str(tmp / name), str(record)], env=env,
                   check=True, cwd=tmp)  # fmt: skip
    return json.loads(record.read_text())


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="git revision of the engine to compare with")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=3, metavar=("TREE", "OUT", "RECORD"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*(Path(p) for p in a.child))
        return
    if not a.base or not a.out:
        ap.error("--base and --out are required")
    import torch

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base_tree = tmp / "base"
        base_tree.mkdir()
        archive = subprocess.run(["git", "archive", a.base, "solrl_engine", "configs"], cwd=ROOT, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        base = _run(base_tree, str(base_tree), tmp, "base")
        after = _run(ROOT, str(ROOT), tmp, "after")
    diff = torch.tensor(after["final_rewards"]) - torch.tensor(base["final_rewards"])
    med = {k: statistics.median(r["phase_s"]["time_train_s"]) for k, r in (("base", base), ("after", after))}
    rec = {
        "bench": "bench/update_phase.py: the quickstart (README's command) under two engines, one after the other",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "base": {"rev": _git("rev-parse", a.base), **base},
        "after": {"rev": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "solrl_engine")),
                  **after},
        "update_phase_median_s": med,
        "update_phase_speedup": med["base"] / med["after"],
        "final_heldout_difference": {"mean": diff.mean().item(),
                                     "stderr": (diff.std() / len(diff) ** 0.5).item(), "images": len(diff)},
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rec, indent=2) + "\n")
    print(json.dumps({k: rec[k] for k in ("update_phase_median_s", "update_phase_speedup",
                                          "final_heldout_difference")}, indent=2))  # fmt: skip
    for k in ("base", "after"):
        print(f"{k}: gain {rec[k]['heldout_gain_final']:+.4f} +- {rec[k]['heldout_gain_stderr_final']:.4f}")


if __name__ == "__main__":
    main()
