"""Seeds that are pure functions of what they seed, never of time or order: a sample's
seed of (run seed, group id, sample index), set by the buffer on each lease, and a token's
draw of (sample seed, position), taken by the embedded engine (``asyncrl.engine.sampling``).
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose outputs look random."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (e.g. a run's seed, a group id
    and a sample index): each part is hashed into the running value in turn."""
    x = 0
    for part in parts:
        x = _mix64(x ^ (part & _MASK64))
    return x >> 1
