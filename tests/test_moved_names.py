"""Names that moved keep working or say where they went: the Explorer's first import path still imports it, the
explore copy's old module re-exports it, and every other old path raises an ImportError naming the new one
(also through `from ... import`, which would otherwise say only "cannot import name")."""

import importlib

import pytest


@pytest.mark.parametrize(("module", "name", "new"), [
    ("solrl_engine.rollout", "Rollouts", "solrl_engine.sampling.rollouts.Rollouts"),
    ("solrl_engine.rollout", "explore_rule", "solrl_engine.explore.plan.explore_rule"),
    ("solrl_engine.hw", "probe_explore_timings", "solrl_engine.explore.choice.probe_explore_timings"),
    ("solrl_engine.hw", "ExploreChoice", "solrl_engine.explore.choice.ExploreChoice"),
    ("solrl_engine.quant.recipe", "auto_explore_recipe", "solrl_engine.explore.choice.hardware_plan"),
    ("solrl_engine.evaluation", "write_compare", "solrl_engine.rl.heldout.write_compare"),
    ("solrl_engine.rl.checkpoint", "prepare_output", "solrl_engine.rl.rundir"),
    ("solrl_engine.rl.fidelity", "linear_flops", "the Rollouts method"),
])  # fmt: skip
def test_a_moved_name_says_where_it_went(module, name, new):
    with pytest.raises(ImportError, match=f"{name} moved: use {new}"):
        exec(f"from {module} import {name}", {})  # noqa: S102 - the user's own spelling
    assert not hasattr(importlib.import_module(module), "no_such_name_here")  # other names still AttributeError


@pytest.mark.parametrize(("module", "new"), [("solrl_engine.models.tiny.pretrain", "solrl_engine.pretrain"),
                                             ("solrl_engine.quant.modelopt_peer", "solrl_engine.nn.modelopt_peer")])
def test_a_moved_module_says_where_it_went(module, new):
    with pytest.raises(ImportError, match=f"moved: import {new}"):
        importlib.import_module(module)


def test_the_old_import_paths_of_the_explorer_and_the_copy_still_work():
    from solrl_engine.explore import ExploreCopy, Explorer
    from solrl_engine.rl.explore import ExploreCopy as OldCopy
    from solrl_engine.rollout import Explorer as OldExplorer

    assert OldExplorer is Explorer and OldCopy is ExploreCopy
