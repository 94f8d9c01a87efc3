"""Balanced assignment of variable-length items to parts: shared by the buffer (whole
groups to trainer ranks) and the trainer (sequences to ranks and rows). A neutral module,
so neither imports the other."""

from __future__ import annotations


def split_balanced(lengths: list[int], parts: int) -> list[list[int]]:
    """Assign indices to ``parts`` groups with balanced token sums (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in order:
        g = min(range(parts), key=lambda p: (totals[p], len(groups[p]), p))
        groups[g].append(i)
        totals[g] += lengths[i]
    return [sorted(g) for g in groups]
