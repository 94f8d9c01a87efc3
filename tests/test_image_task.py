"""The image task: every scene drawn is judged a success against itself, and a failure
against a scene it does not show (a wrong count, colour, shape or side, a stray object);
the held-out split keeps whole scenes out of training, in every category."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from asyncrl.image.check import blobs, judge, success_by_category
from asyncrl.image.render import SIZE, draw
from asyncrl.image.scenes import (
    BACKGROUND,
    CATEGORIES,
    COLOURS,
    Group,
    Scene,
    all_scenes,
    sample_scenes,
    split,
)


def test_every_scene_drawn_passes_its_own_checks():
    rng, results = random.Random(0), []
    for scene in all_scenes():
        for _ in range(3):
            image = draw(scene, rng)
            assert image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8
            results.append((scene, judge(image, scene)))
    failed = [(s.prompt, v.checks) for s, v in results if not v.success]
    assert failed == []
    assert success_by_category(results) == {**dict.fromkeys(CATEGORIES, 1.0), "overall": 1.0}


def test_a_picture_fails_the_scenes_it_does_not_show():
    rng = random.Random(1)
    two_red = Scene("counting", (Group(2, "red", "circle"),))
    image = draw(two_red, rng)
    for wrong in (
        Scene("counting", (Group(3, "red", "circle"),)),  # count
        Scene("counting", (Group(2, "blue", "circle"),)),  # colour
        Scene("counting", (Group(2, "red", "square"),)),  # shape
        Scene("single", (Group(1, "red", "circle"),)),  # one too many
    ):
        verdict = judge(image, wrong)
        assert not verdict.success and 0 <= verdict.reward < 1, wrong.prompt
    left = Scene("position", (Group(1, "red", "square"), Group(1, "blue", "circle")), "left of")
    image = draw(left, rng)
    assert judge(image, left).success
    verdict = judge(image, replace(left, relation="right of"))
    assert not verdict.success and verdict.reward == pytest.approx(3 / 4)  # only the side


def test_a_stray_object_costs_part_of_the_reward_and_noise_does_not():
    rng = random.Random(2)
    scene = Scene("single", (Group(1, "green", "square"),))
    image = draw(scene, rng)
    noisy = np.clip(image + np.random.default_rng(0).normal(0, 12, image.shape), 0, 255)
    assert judge(noisy.astype(np.uint8), scene).success
    stray = image.copy()
    r, c = next(
        (r, c)
        for r in range(SIZE - 5)
        for c in range(SIZE - 5)
        if (image[r : r + 6, c : c + 6] == BACKGROUND).all()
    )
    stray[r + 1 : r + 5, c + 1 : c + 5] = COLOURS["yellow"]  # a blob of 16 pixels
    verdict = judge(stray, scene)
    assert [b.colour for b in blobs(stray)].count("yellow") == 1
    assert not verdict.success and verdict.reward == pytest.approx(1 / 2)


def test_held_out_scenes_are_never_trained_and_cover_every_category():
    train, held = split(held_out=False), split(held_out=True)
    assert not {s.prompt for s in train} & {s.prompt for s in held}
    assert {s.category for s in held} == set(CATEGORIES)
    assert 0.1 < len(held) / (len(train) + len(held)) < 0.3
    picked = sample_scenes(40, held_out=True, seed=0)
    assert all(s.held_out for s in picked) and {s.category for s in picked} == set(CATEGORIES)
    assert sample_scenes(40, held_out=True, seed=0) == picked  # a fixed evaluation set
