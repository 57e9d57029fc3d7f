"""Options of the pytest-benchmark runs under bench/ (`pytest bench/ --benchmark-only`)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--e2e-args",
        default="--n 16 --k 8 --prompts 4",
        help="bench/e2e.py arguments for test_bench_e2e.py's runs (e.g. '--paper-scale' for N=96, K=24)",
    )
