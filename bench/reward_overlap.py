"""How much reward time the rollouts hide behind sampling, with a reward server that sleeps per batch.

The quickstart's config (configs/tiny.py:tiny_sol_rl_shapes, the bundled model on this CPU) scored by a reward
server (solrl_engine.rewards.serve, in a thread of this process) hosting the shapes reward plus `--sleep` seconds
per scored batch: once with scoring overlapped (batch i scored while batch i+1 is sampled: Rollouts.start_scored;
Sol-RL's explore and regeneration in two halves of the prompts, Trainer._explore_in_halves), once with the overlap
switched off (every batch scored after the sampling), the same seeds, and once with the
reward in-process. Records per iteration the reward seconds hidden and exposed, the phase times, and whether the
non-time metrics agree (remote overlapped, remote sequential and in-process).

    python bench/reward_overlap.py --iterations 2 --sleep 0.2 --json /tmp/reward-overlap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class SlowShapes:
    """The shapes reward, `sleep` seconds slower per call: a stand-in for a large reward model on its own GPU."""

    def __init__(self, sleep: float) -> None:
        from solrl_engine.rewards.shapes import ShapesReward

        self.inner, self.sleep, self.calls = ShapesReward(), sleep, 0

    def __call__(self, images: Any, prompts: list[str]) -> Any:
        self.calls += 1
        time.sleep(self.sleep)
        return self.inner(images, prompts)

    def check_prompts(self, prompts: list[str]) -> None:
        self.inner.check_prompts(prompts)


def start_server(fn: Any) -> tuple[str, Any]:
    """Serve `fn` as the reward "shapes" on a free port of 127.0.0.1, in a thread; (url, stop)."""
    from solrl_engine.rewards.serve import Hosted, serve_in_thread

    return serve_in_thread([Hosted("shapes", fn, {"model": "ShapesReward (slow)", "args": {}, "video": False})])


def run(url: str, iterations: int, overlap: bool, out: Path, sets: list[str]) -> list[dict[str, Any]]:
    """The quickstart's config for `iterations`, scored at `url`; the metrics of each iteration."""
    from solrl_engine.rl import load_config
    from solrl_engine.rl.trainer import Trainer
    from solrl_engine.sampling.rollouts import Rollouts

    remote = [f"reward_url=shapes={url}"] if url else []  # no url: the shapes reward in-process
    cfg = load_config("configs/tiny.py:tiny_sol_rl_shapes", [f"iterations={iterations}", f"eval_every={iterations}",
                      *remote, f"output={out}", *sets])  # fmt: skip
    saved = Rollouts.overlaps
    if not overlap:
        Rollouts.overlaps = property(lambda self: False)  # type: ignore[method-assign,assignment]
    try:
        Trainer(cfg, progress=False).run()
    finally:
        Rollouts.overlaps = saved  # type: ignore[method-assign]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.2, help="seconds the reward sleeps per scored batch (0.2)")
    ap.add_argument("--set", action="append", default=[], help="a config change (key=value), as solrl train's")
    ap.add_argument("--json", default=None, help="write the record here")
    args = ap.parse_args(argv)
    import torch

    fn = SlowShapes(args.sleep)
    url, stop = start_server(fn)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("overlapped", "sequential"):
                runs[mode] = run(url, args.iterations, mode == "overlapped", Path(tmp) / mode, args.set)
            local = run("", args.iterations, False, Path(tmp) / "in_process", args.set)
    finally:
        stop()
    keys = ("time_total_s", "time_explore_s", "time_regen_s", "time_train_s", "time_reward_hidden_s",
            "time_reward_exposed_s")  # fmt: skip
    table = {mode: [{k: m[k] for k in keys} for m in ms] for mode, ms in runs.items()}
    for rows in table.values():
        for r in rows:
            total = r["time_reward_hidden_s"] + r["time_reward_exposed_s"]
            r["hidden_fraction"] = r["time_reward_hidden_s"] / total if total else None
    def agree(xs: list[dict[str, Any]], ys: list[dict[str, Any]]) -> bool:
        return all(all(a[k] == b[k] for k in a if not k.startswith("time")) for a, b in zip(xs, ys, strict=True))

    same = agree(runs["overlapped"], runs["sequential"])
    o, s = table["overlapped"], table["sequential"]
    rec = {
        "bench": "reward time hidden behind sampling (a reward server sleeping per batch)",
        "command": "python bench/reward_overlap.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": "configs/tiny.py:tiny_sol_rl_shapes (N=32, K=8, 8 prompts, rollout batch 64, 6/10 steps)",
        "changes": args.set,
        "sleep_s_per_batch": args.sleep, "threads": torch.get_num_threads(), "scored_batches": fn.calls,
        "iterations": table, "non_time_metrics_equal": same,
        # the same run with the shapes reward in this process (no server): what the remote runs must equal
        "remote_equals_in_process": agree(runs["overlapped"], local),
        "hidden_fraction_mean": sum(r["hidden_fraction"] for r in o) / len(o),
        "iteration_time_sequential_over_overlapped": sum(r["time_total_s"] for r in s)
        / sum(r["time_total_s"] for r in o),
    }  # fmt: skip
    print(json.dumps(rec, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
