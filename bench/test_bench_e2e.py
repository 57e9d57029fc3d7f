"""End-to-end iterations under pytest-benchmark, one family per benchmark, `compile` (the compiled
full-precision baseline) in the same group and the same run:

    pytest bench/test_bench_e2e.py --benchmark-only --benchmark-json out.json
    pytest bench/test_bench_e2e.py --benchmark-only --e2e-args "--paper-scale"   # N=96 -> K=24

Each benchmark is one `Trainer.step()` of the bundled model built exactly as bench/e2e.py builds it
(its `family_config`); the first step (compilation, the explore choice's timing) is a warm-up round.
The per-phase seconds of the timed rounds go into extra_info, so the JSON holds the rollout phase
(explore + regenerate) as well as the whole iteration. Skipped without --benchmark-only.
"""

from __future__ import annotations

import importlib.util
import shlex
import statistics
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark", reason="pip install pytest-benchmark (the dev extra)")

_spec = importlib.util.spec_from_file_location("bench_e2e", Path(__file__).parent / "e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

PHASES = ("time_explore_s", "time_regen_s", "time_train_s", "time_total_s")


@pytest.fixture(autouse=True)
def _benchmark_only(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("benchmark_only", default=False):
        pytest.skip("an end-to-end benchmark: run `pytest bench/ --benchmark-only`")


@pytest.mark.parametrize("family", ["compile", "sol_rl", "naive_scaling", "diffusionnft"])
def test_e2e_iteration(benchmark, request: pytest.FixtureRequest, tmp_path: Path, family: str) -> None:
    from solrl_engine.rl.trainer import Trainer

    args = e2e.build_parser().parse_args(shlex.split(request.config.getoption("e2e_args")))
    cfg = e2e.family_config(family, args, str(tmp_path))
    tr = Trainer(cfg, progress=False)
    rows: list[dict] = []
    benchmark.group = f"e2e tiny iteration ({request.config.getoption('e2e_args')})"
    benchmark.pedantic(lambda: rows.append(tr.step()), rounds=3, warmup_rounds=1, iterations=1)
    timed = rows[1:]
    info = benchmark.extra_info
    info.update({p: statistics.median(r[p] for r in timed) for p in PHASES})
    info["time_rollout_s"] = info["time_explore_s"] + info["time_regen_s"]
    benchmark.extra_info.update(explore=tr.explorer.recipe_label, n=cfg.n, k=cfg.k,
                                compile_s=tr.rollouts.sampler.stats.overhead_s)  # fmt: skip
