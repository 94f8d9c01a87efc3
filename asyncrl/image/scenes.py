"""Scenes a prompt asks for, a small GenEval: objects with a count, a colour and a shape,
and where one lies against another ("two red squares", "a red square left of a blue
circle"). A ``Scene`` is what is asked, its ``prompt`` the words a model is conditioned
on; ``asyncrl.image.render`` draws one, ``asyncrl.image.check`` judges a picture of it.

Categories, as GenEval reports them: ``single`` (one object), ``counting`` (two or three
of one kind), ``two_objects`` (one each of two kinds), ``position`` (one against the
other). Held-out prompts are whole scenes never trained on (a fixed hash of the prompt
picks them), so held-out success measures composition, not recall.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
}
"""RGB of each colour a prompt may ask for; far apart, so a pixel's nearest is clear."""
BACKGROUND = (24, 24, 24)
SHAPES = ("square", "circle")
NUMBERS = {1: "a", 2: "two", 3: "three"}
RELATIONS = ("left of", "right of", "above", "below")
CATEGORIES = ("single", "counting", "two_objects", "position")
HELD_OUT_SHARE = 0.2
"""Share of all scenes kept out of training for held-out evaluation."""

Category = Literal["single", "counting", "two_objects", "position"]


@dataclass(frozen=True)
class Group:
    """``count`` objects of one colour and shape."""

    count: int
    colour: str
    shape: str

    def words(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{NUMBERS[self.count]} {self.colour} {self.shape}{plural}"


@dataclass(frozen=True)
class Scene:
    category: Category
    groups: tuple[Group, ...]
    relation: str | None = None
    """``position``: where the first group's object lies against the second's."""

    @property
    def prompt(self) -> str:
        if self.relation is not None:
            return f"{self.groups[0].words()} {self.relation} {self.groups[1].words()}"
        return " and ".join(g.words() for g in self.groups)

    @property
    def held_out(self) -> bool:
        return held_out_prompt(self.prompt)


def held_out_prompt(prompt: str) -> bool:
    """Whether a scene's prompt is held out (a fixed hash of its words picks a fifth)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < HELD_OUT_SHARE


def all_scenes() -> list[Scene]:
    """Every scene of every category, in a fixed order."""
    kinds = [(c, s) for c in COLOURS for s in SHAPES]
    scenes = [Scene("single", (Group(1, c, s),)) for c, s in kinds]
    scenes += [Scene("counting", (Group(n, c, s),)) for n in (2, 3) for c, s in kinds]
    pairs = [(a, b) for a in kinds for b in kinds if a[0] != b[0]]  # two colours
    scenes += [Scene("two_objects", (Group(1, *a), Group(1, *b))) for a, b in pairs if a < b]
    scenes += [
        Scene("position", (Group(1, *a), Group(1, *b)), relation)
        for a, b in pairs
        for relation in RELATIONS
    ]
    return scenes


def split(held_out: bool) -> list[Scene]:
    """The training scenes, or the held-out ones."""
    return [s for s in all_scenes() if s.held_out == held_out]


def sample_scenes(n: int, held_out: bool, seed: int) -> list[Scene]:
    """``n`` scenes of the split, categories in turn (each category equally often)."""
    rng, pool = random.Random(seed), split(held_out)
    by_category = {c: [s for s in pool if s.category == c] for c in CATEGORIES}
    return [rng.choice(by_category[CATEGORIES[i % len(CATEGORIES)]]) for i in range(n)]
