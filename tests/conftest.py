"""Test setup: Triton kernels run in the CPU interpreter when no GPU is present.

TRITON_INTERPRET must be set before Triton is first imported, hence here, at collection time.

OMP_WAIT_POLICY=PASSIVE, set before torch is imported (and inherited by every process a test starts): the
test run has two workers (README), and tests start child processes; OpenMP threads that spin while they
wait turn two processes of two threads on two cores into a crawl (two processes of small matmuls took
314 s each with the default policy, 2.2-2.7 s passive, 1.5 s alone). It changes how threads wait, not
what they compute.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
    # a checkout that is not installed (a lent GPU machine's copy): triton_kernels/ imports as solrl_triton
    from solrl_engine.kernels.dispatch import source_tree_kernels

    source_tree_kernels()
except ImportError:  # the dev extra installs it; without it Triton tests are skipped
    HAS_TRITON = False


# The files that take longest on 2 CPU cores (pytest --durations, 2026-11-29), longest first. The README's test
# command hands whole files to two workers (--dist loadfile) in collection order; starting the longest first keeps
# one worker from finishing a 7-minute file alone after the other is done (longest-first scheduling).
LONGEST_FIRST = (
    "test_gpu_rehearsal.py", "test_distributed.py", "test_gpu_rehearsal_sm80.py", "test_compiled_explore.py",
    "test_memplan.py", "test_context_parallel.py", "test_fast_path.py", "test_producers.py", "test_run_plan.py",
    "test_sana_video.py",
    "test_bench.py", "test_trust.py", "test_wan_i2v.py", "test_reward_server.py", "test_run_dirs.py",
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: the longest files first, the rest in their own order, each file's tests in theirs
    items.sort(key=lambda it: rank.get(it.path.name, len(LONGEST_FIRST)))


@pytest.fixture
def device() -> torch.device:
    """Where kernels are exercised: the GPU when there is one, else the CPU (Triton interpreted)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route solrl_engine.kernels through the Triton backend for one test."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install -e '.[dev]')")
    monkeypatch.setenv("SOLRL_BACKEND", "triton")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer random TinyT2I saved as a user's model directory (seed 0): the trainer tests' model."""
    from solrl_engine.models.tiny import TinyConfig, TinyT2I

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("small_tiny")
    TinyT2I(TinyConfig(num_layers=1, heads=2, head_dim=16, text_dim=32, text_layers=1)).save(d)
    return str(d)
