"""The programmatic judge of a picture against its scene (a small GenEval's checker).

Each pixel takes the nearest of the palette's colours, or the background when that is
nearer or no colour is within ``COLOUR_DISTANCE``; pixels of one colour that touch (four
ways) form an object when there are at least ``MIN_AREA`` of them (fewer are noise). An
object is a square when it fills its bounding box (``SQUARE_FILL``), a circle otherwise.

A scene's checks, each passed or not: every group has exactly its count of objects of its
colour and shape; the picture holds no other object; and for ``position``, the first
object's centre lies on the asked side of the second's. Success is every check passed;
the reward is the share passed, so a picture that gets the count right but adds a stray
object scores between 0 and 1.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from asyncrl.image.render import holds
from asyncrl.image.scenes import BACKGROUND, CATEGORIES, COLOURS, Scene

COLOUR_DISTANCE = 90.0
MIN_AREA = 8
SQUARE_FILL = 0.9


@dataclass
class Blob:
    colour: str
    shape: str
    area: int
    centre: tuple[float, float]
    """(row, column) of its pixels' mean."""


@dataclass
class Verdict:
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return bool(all(self.checks.values()))

    @property
    def reward(self) -> float:
        return (
            float(sum(map(bool, self.checks.values()))) / len(self.checks) if self.checks else 0.0
        )


def colour_map(image: np.ndarray) -> np.ndarray:
    """Per pixel, the index of its palette colour in ``COLOURS`` order, or -1 for the
    background. ``image``: (H, W, 3) uint8."""
    palette = np.array([BACKGROUND, *COLOURS.values()], dtype=np.float32)  # (K+1, 3)
    distance = np.linalg.norm(image.astype(np.float32)[:, :, None, :] - palette, axis=-1)
    nearest = distance.argmin(axis=-1) - 1  # background -> -1
    nearest[distance.min(axis=-1) > COLOUR_DISTANCE] = -1
    return nearest


def blobs(image: np.ndarray) -> list[Blob]:
    """The objects of a picture, by colour segmentation."""
    labels, names = colour_map(image), list(COLOURS)
    seen = np.zeros(labels.shape, dtype=bool)
    found = []
    for r0, c0 in zip(*np.nonzero(labels >= 0)):
        if seen[r0, c0]:
            continue
        pixels = _component(labels, seen, r0, c0)
        if len(pixels) < MIN_AREA:
            continue
        rows, cols = np.array(pixels).T
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        shape = "square" if len(pixels) / box >= SQUARE_FILL else "circle"
        colour = names[labels[r0, c0]]
        found.append(Blob(colour, shape, len(pixels), (rows.mean(), cols.mean())))
    return found


def _component(labels: np.ndarray, seen: np.ndarray, r0: int, c0: int) -> list[tuple[int, int]]:
    """The pixels of ``labels[r0, c0]``'s colour connected to it (four ways), marked seen."""
    height, width = labels.shape
    colour, pixels, stack = labels[r0, c0], [], [(r0, c0)]
    seen[r0, c0] = True
    while stack:
        r, c = stack.pop()
        pixels.append((r, c))
        for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            inside = 0 <= rr < height and 0 <= cc < width
            if inside and not seen[rr, cc] and labels[rr, cc] == colour:
                seen[rr, cc] = True
                stack.append((rr, cc))
    return pixels


def judge(image: np.ndarray, scene: Scene) -> Verdict:
    """The checks of ``scene`` on ``image``."""
    return judge_blobs(blobs(image), scene)


def judge_blobs(found: list[Blob], scene: Scene) -> Verdict:
    """The checks of ``scene`` on a picture whose objects are ``found`` (``blobs``): one
    segmentation serves every scene a picture is judged against."""
    kinds = Counter((b.colour, b.shape) for b in found)
    verdict = Verdict()
    for g in scene.groups:
        verdict.checks[f"{g.words()}"] = kinds[(g.colour, g.shape)] == g.count
    verdict.checks["nothing else"] = len(found) == sum(g.count for g in scene.groups)
    if scene.relation is not None:
        first, second = (
            [b for b in found if (b.colour, b.shape) == (g.colour, g.shape)] for g in scene.groups
        )
        placed = len(first) == 1 and len(second) == 1
        ok = placed and holds(scene.relation, first[0].centre, second[0].centre)
        verdict.checks[scene.relation] = ok
    return verdict


def success_by_category(results: list[tuple[Scene, Verdict]]) -> dict[str, float]:
    """Held-out success per category and over all (``overall``: the categories' mean, as
    GenEval reports it)."""
    by: dict[str, list[bool]] = defaultdict(list)
    for scene, verdict in results:
        by[scene.category].append(verdict.success)
    rates = {c: sum(v) / len(v) for c in CATEGORIES if (v := by.get(c))}
    rates["overall"] = sum(rates.values()) / len(rates) if rates else 0.0
    return rates
