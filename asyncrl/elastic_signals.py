"""What the elastic controller (``asyncrl.elastic``) reads, and the split it implies.

``Signals`` is one snapshot of a run, averaged over the controller's window: the
launcher's loop (``asyncrl.launcher.elastic``) builds it from the run's metrics, the
simulator (``asyncrl.sim.elastic``) from its model, both through ``signals`` over the
window's trainer steps (``StepRecord``). ``balanced``, ``predicted`` and
``balanced_target`` read a snapshot as a model of the run, generation scaled by its
generators and training by the trainer's slots: where generation would keep the
trainer just busy, and the whole generator count to move toward.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple


class Signals(NamedTuple):
    """What the run shows, averaged over the latest ``window_s``."""

    generators: int
    """Generators running now."""
    trainer_idle: float
    """Share of the trainer's time spent waiting for batches."""
    ready_batches: float
    """Complete batches waiting in the buffer."""
    trained_tokens_per_s: float
    """Tokens trained per second of run time."""
    trainer_slots: int = 0
    """Slots the trainer holds, where generators and trainer share one pool of slots (a
    generator more is a trainer slot fewer); 0 where the trainer's size stays as it is."""
    reward_servers: int = 0
    """Reward servers running now (0: the run scores in the buffer's process)."""
    reward_queue: float = 0.0
    """Finished samples waiting for a reward server, in batches."""
    reward_busy: float = 0.0
    """Share of the reward servers' time spent scoring."""
    lending: bool = False
    """Whether the trainer lends its waits to a generator now (``lend_waits``)."""
    step_s: float = 0.0
    """Mean seconds per trainer step over the window (waiting included): what the
    controller's window and dwell stretch to when steps grow long."""
    steps_left: float = math.inf
    """Trainer steps the run has still to make (inf where its length is not known)."""


class StepRecord(NamedTuple):
    """One trainer step as the signals count it."""

    seconds: float
    """Its wall time from asking for its batch to its end (waiting included)."""
    waited: float
    """Seconds of it spent waiting for the batch."""
    tokens: float
    """Tokens it trained."""


def signals(
    generators: int, steps: Sequence[StepRecord], ready_batches: float, trainer_slots: int = 0
) -> Signals:
    """The signals of the trainer steps of a window. Trained tokens/s are over the steps'
    own time, not the window's: a window holds a whole number of steps, and dividing by
    its length would swing by a step's tokens with where the window starts. Time between
    steps (a trainer restarting after a move, a checkpoint) counts in neither."""
    wall = sum(s.seconds for s in steps)
    if wall <= 0:
        return Signals(generators, 0.0, ready_batches, 0.0, trainer_slots)
    return Signals(
        generators=generators,
        trainer_idle=sum(s.waited for s in steps) / wall,
        ready_batches=ready_batches,
        trained_tokens_per_s=sum(s.tokens for s in steps) / wall,
        trainer_slots=trainer_slots,
        step_s=wall / len(steps),
    )


def windowed(steps: deque[tuple[float, Any]], now: float, window_s: float, least: int) -> float:
    """Drop the oldest of ``steps`` ((time, step), oldest first) that lie more than
    ``window_s`` before ``now``, keeping at least ``least`` of them; the seconds the
    window spans now (``window_s``, or more where it stretched to keep ``least``)."""
    while len(steps) > least and steps[0][0] < now - window_s:
        steps.popleft()
    return max(window_s, now - steps[0][0]) if steps else window_s


def balanced(s: Signals) -> float:
    """The generator count at which generation would keep the trainer just busy, if
    generation scales with its generators and training with the trainer's slots: the
    trainer now works ``1 - idle`` of the time, so generation must grow by ``1/(1 -
    idle)`` against training; where the two share ``trainer_slots + generators`` slots,
    training shrinks as generation grows."""
    busy = max(1.0 - s.trainer_idle, 1e-3)
    if s.trainer_slots <= 0:
        return s.generators / busy
    ratio = s.generators / (s.trainer_slots * busy)
    return (s.generators + s.trainer_slots) * ratio / (1 + ratio)


def predicted(s: Signals, generators: int) -> float:
    """Trained tokens/s at ``generators`` generators, by the same scaling as ``balanced``:
    what generation supplies now (the trained tokens/s, while the trainer waits) grows
    with the generators; what training could take (the trained tokens/s over its busy
    share) with the trainer's slots, which shared slots shrink as generators grow."""
    supply = s.trained_tokens_per_s * generators / max(s.generators, 1)
    capacity = s.trained_tokens_per_s / max(1.0 - s.trainer_idle, 1e-3)
    if s.trainer_slots > 0:
        capacity *= max(s.generators + s.trainer_slots - generators, 0) / s.trainer_slots
    return min(supply, capacity)


def balanced_target(s: Signals) -> int:
    """The whole generator count to move toward: ``balanced`` rounded, or on shared slots
    the whole count either side of it that ``predicted`` rates higher (rounded up past the
    balance, a split can leave the trainer too few slots to take what is generated)."""
    b = balanced(s)
    if s.trainer_slots <= 0:
        return round(b)
    return max((math.floor(b), math.ceil(b)), key=lambda g: predicted(s, g))
