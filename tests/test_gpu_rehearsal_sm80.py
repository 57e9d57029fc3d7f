"""The GPU session rehearsed at a simulated sm_80 (an A100: INT8 tensor cores, no FP8), calls 1 and 3, as
test_gpu_rehearsal.py rehearses sm_90; a file of its own so that pytest-xdist (the README's test command)
runs the two rehearsals side by side."""

from __future__ import annotations

import pytest
import test_gpu_rehearsal as base
from test_gpu_rehearsal import check_every_stage, check_forwards, check_preflight

tree, rehearse = base.tree, base.rehearse  # the same fixtures, this module's own (module-scoped) instances

CASES = [(1, "80"), (3, "80")]


@pytest.mark.slow
@pytest.mark.parametrize(("call", "sm"), CASES)
def test_each_device_call_runs_every_stage_clean_from_a_bare_copy_at_sm80(call, sm, rehearse, tree):
    check_every_stage(call, sm, rehearse, tree)


@pytest.mark.slow
def test_call_1_preflight_checks_int8_only_at_sm80(rehearse):
    check_preflight("80", rehearse)


@pytest.mark.slow
@pytest.mark.parametrize(("call", "sm"), [(3, "80")])
def test_forwards_run_the_gpu_path_eager_and_compiled_at_sm80(call, sm, rehearse):
    check_forwards(call, sm, rehearse)
