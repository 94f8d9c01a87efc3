"""Pictures of scenes (``asyncrl.image.scenes``), drawn procedurally: the pretraining data
of the image chain, and the reference that the checker is tested against.

A picture is ``SIZE`` × ``SIZE`` RGB (uint8, height × width × 3) on a dark background.
Squares and circles of 6 to 8 pixels across are placed at random, at least ``GAP`` pixels
apart (touching objects would read as one), and a ``position`` scene's first object lies
clearly on its side of the second (``MARGIN`` pixels between their centres, as the checker
asks).
"""

from __future__ import annotations

import random

import numpy as np

from asyncrl.image.scenes import BACKGROUND, COLOURS, Scene

SIZE = 32
GAP = 2
MARGIN = 3
"""Pixels between two centres along the relation's axis, at least."""
TRIES = 500


def draw(scene: Scene, rng: random.Random) -> np.ndarray:
    """One picture of ``scene``: shape ``(SIZE, SIZE, 3)``, uint8."""
    for _ in range(TRIES):
        objects = [(g.colour, g.shape) for g in scene.groups for _ in range(g.count)]
        placed = _place(len(objects), rng)
        if placed is not None and _related(scene, placed):
            break
    else:  # pragma: no cover - a scene of three objects fits with room to spare
        raise RuntimeError(f"could not place {scene.prompt!r} in {TRIES} tries")
    image = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for (colour, shape), box in zip(objects, placed):
        _paint(image, shape, box, COLOURS[colour])
    return image


def _place(n: int, rng: random.Random) -> list[tuple[int, int, int]] | None:
    """``n`` boxes (top, left, side) inside the picture, ``GAP`` apart; None if one did
    not fit where the others left room."""
    boxes: list[tuple[int, int, int]] = []
    for _ in range(n):
        for _ in range(50):
            side = rng.randint(6, 8)
            top, left = rng.randint(1, SIZE - side - 1), rng.randint(1, SIZE - side - 1)
            if all(_apart((top, left, side), b) for b in boxes):
                boxes.append((top, left, side))
                break
        else:
            return None
    return boxes


def _apart(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    (ta, la, sa), (tb, lb, sb) = a, b
    return ta + sa + GAP <= tb or tb + sb + GAP <= ta or la + sa + GAP <= lb or lb + sb + GAP <= la


def centre(box: tuple[int, int, int]) -> tuple[float, float]:
    """(row, column) of a box's centre."""
    top, left, side = box
    return top + (side - 1) / 2, left + (side - 1) / 2


def _related(scene: Scene, boxes: list[tuple[int, int, int]]) -> bool:
    if scene.relation is None:
        return True
    (ra, ca), (rb, cb) = centre(boxes[0]), centre(boxes[1])
    return holds(scene.relation, (ra, ca), (rb, cb))


def holds(relation: str, a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether a centre ``a`` (row, column) lies ``relation`` a centre ``b``."""
    (ra, ca), (rb, cb) = a, b
    return {
        "left of": ca + MARGIN <= cb,
        "right of": ca >= cb + MARGIN,
        "above": ra + MARGIN <= rb,
        "below": ra >= rb + MARGIN,
    }[relation]


def _paint(image: np.ndarray, shape: str, box: tuple[int, int, int], rgb) -> None:
    top, left, side = box
    if shape == "square":
        image[top : top + side, left : left + side] = rgb
        return
    rows, cols = np.mgrid[0:side, 0:side]
    middle, radius = (side - 1) / 2, side / 2
    disc = (rows - middle) ** 2 + (cols - middle) ** 2 <= radius**2 - 0.5
    image[top : top + side, left : left + side][disc] = rgb
