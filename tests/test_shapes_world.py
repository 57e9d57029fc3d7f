"""The procedural shapes world: grammar, splits, layouts, renderer."""

from __future__ import annotations

import random

import pytest
import torch

from solrl_engine.data import shapes as world


def test_parse_round_trips_every_prompt():
    for scene in world.all_scenes():
        assert world.parse(scene.prompt) == scene


@pytest.mark.parametrize(
    "bad",
    [
        "a red hexagon",
        "two red circles",
        "a red circle next to a blue square",
        "a red circle to the left of a red square",  # same colour twice
        "a small red circle above a blue square",  # sizes only for single objects
        "",
    ],
)
def test_prompts_outside_the_grammar_raise_a_clear_error(bad):
    with pytest.raises(world.PromptError, match="grammar|colours"):
        world.parse(bad)


def test_splits_are_fixed_disjoint_and_heldout_uses_only_seen_words():
    train, held = world.prompts("train"), world.prompts("heldout")
    assert len(held) == 64 and len(set(held)) == 64
    assert not set(train) & set(held)
    assert world.prompts("heldout") == held  # fixed
    train_words = {w for p in train for w in p.split()}
    assert {w for p in held for w in p.split()} <= train_words  # unseen combinations of seen words
    for p in held:
        assert world.is_heldout(world.parse(p))
    for p in train:
        assert not world.is_heldout(world.parse(p))
    assert sum(world.parse(p).relation is None for p in held) == 12
    assert len(train) == 690
    with pytest.raises(ValueError, match="split"):
        world.prompts("test")


def test_every_scene_can_be_laid_out_and_relations_hold():
    rng = random.Random(0)
    for scene in world.all_scenes():
        placed = world.layout(scene, rng)
        assert len(placed) == len(scene.objects)
        for _o, cx, cy, area in placed:
            assert 0 < cx < 32 and 0 < cy < 32 and area > 0
        if scene.relation:
            axis, sign = world.RELATIONS[scene.relation]
            a, b = placed
            assert sign * ((a[1], a[2])[axis] - (b[1], b[2])[axis]) > 0


def test_render_is_deterministic_and_in_range():
    a = world.render("a red circle to the left of a blue triangle", 3)
    b = world.render("a red circle to the left of a blue triangle", 3)
    assert torch.equal(a, b) and a.shape == (3, 32, 32)
    assert a.min() >= 0 and a.max() <= 1
    assert not torch.equal(a, world.render("a red circle to the left of a blue triangle", 4))
    # the object colours are present
    red = torch.tensor(world.COLORS["red"]).view(3, 1, 1)
    assert ((a - red).abs().amax(0) < 1e-6).sum() > 10


def test_rendered_area_matches_the_requested_size():
    for size, (lo, hi) in [("small", world.AREA["small"]), ("large", world.AREA["large"])]:
        for shape in world.SHAPES:
            img = world.render(f"a {size} green {shape}", 1)
            green = torch.tensor(world.COLORS["green"]) - torch.tensor(world.BACKGROUND)
            cover = ((img - torch.tensor(world.BACKGROUND).view(3, 1, 1)) * green.view(3, 1, 1)).sum(0) / green.dot(
                green
            )
            assert lo - 2 <= cover.sum().item() <= hi + 2, (size, shape)
