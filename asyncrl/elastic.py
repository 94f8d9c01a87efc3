"""The elastic placement's controller: how many generators a run should have now, decided
from what the run shows while it goes on.

It is pure: ``Controller.decide`` takes the time and a ``Signals`` snapshot and returns a
``Move`` (one generator more or fewer, with its reason) or None. The launcher feeds it the
run's own metrics and carries its moves out through the generator pool
(``asyncrl.launcher.elastic``); anything else that can produce ``Signals`` (a model of the
system) can drive the same code.

The rule, one move at a time:

- the trainer waits for batches (its idle share above ``trainer_idle_high``): generation
  is the bottleneck, so one more generator;
- the trainer is busy (idle below ``trainer_idle_low``) while ready batches pile up
  (``backlog_batches`` or more): generation runs ahead, so one generator fewer, and its
  cores or accelerator go back to the rest of the run;
- nothing moves within ``dwell_s`` of the last move. Then the move is judged on what the
  run is for, trained tokens/s: a generator more must have raised them by ``min_gain``
  (else it only took cores from the trainer); one fewer must not have lowered them by as
  much (it was to free resources, not to speed training up). A move that fails is undone,
  and its direction is not tried again for ``retry_dwells`` dwells.

The gap between the two idle thresholds, the dwell and the undo rule keep it from
thrashing: at most one move per dwell, and a move that does not pay is not repeated
at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class ElasticConfig:
    """How the elastic placement (``placement=elastic``) moves generators."""

    min_generators: int = 1
    """Never fewer generators than this."""
    max_generators: int = 4
    """Never more generators than this (on one machine, at most its cores less the
    trainer's)."""
    dwell_s: float = 60.0
    """Least time between two moves; also how long a move runs before it is judged."""
    window_s: float = 30.0
    """The signals are averaged over this much of the latest run time."""
    trainer_idle_high: float = 0.25
    """The trainer's share of time spent waiting for batches above which generation is
    the bottleneck."""
    trainer_idle_low: float = 0.05
    """Below it, with ``backlog_batches`` ready, generation runs ahead of training."""
    backlog_batches: float = 2.0
    """Ready batches waiting in the buffer that count as generation running ahead."""
    min_gain: float = 0.05
    """A generator more is undone unless trained tokens/s rose by this share; one fewer
    is undone if they fell by as much."""
    retry_dwells: int = 3
    """Dwells before a direction that was undone is tried again."""

    def check(self, generators: int) -> None:
        """Refuse settings that cannot work (``ValueError`` naming the keys)."""
        lo, hi = self.min_generators, self.max_generators
        if not 1 <= lo <= hi:
            raise ValueError(
                f"elastic.min_generators={lo} must be at least 1 and at most "
                f"elastic.max_generators={hi}"
            )
        if not lo <= generators <= hi:
            raise ValueError(
                f"num_generators={generators} is where an elastic run starts: it must lie "
                f"within elastic.min_generators..max_generators ({lo}..{hi})"
            )
        if not 0 < self.window_s <= self.dwell_s:
            raise ValueError(
                f"elastic.window_s={self.window_s:g} must be above 0 and at most "
                f"elastic.dwell_s={self.dwell_s:g}: a move is judged on a window after it"
            )
        if not 0 <= self.trainer_idle_low < self.trainer_idle_high <= 1:
            raise ValueError(
                f"elastic.trainer_idle_low={self.trainer_idle_low:g} must be below "
                f"elastic.trainer_idle_high={self.trainer_idle_high:g}, both within 0..1"
            )


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


class Move(NamedTuple):
    delta: int
    """+1: one generator more; -1: one fewer."""
    reason: str


class Controller:
    def __init__(self, cfg: ElasticConfig) -> None:
        self.cfg = cfg
        self.last_move_at = float("-inf")
        self.judging: tuple[Move, float] | None = None  # the last move, tokens/s before it
        self.blocked_until = {1: float("-inf"), -1: float("-inf")}

    def decide(self, now: float, s: Signals) -> Move | None:
        """The move to make now, or None."""
        cfg = self.cfg
        if now - self.last_move_at < cfg.dwell_s:
            return None
        if self.judging is not None:
            move, before = self.judging
            self.judging = None
            gain = s.trained_tokens_per_s / before - 1 if before > 0 else 0.0
            if gain < (cfg.min_gain if move.delta > 0 else -cfg.min_gain):
                self.blocked_until[move.delta] = now + cfg.retry_dwells * cfg.dwell_s
                undo = Move(
                    -move.delta,
                    f"undo {move.delta:+d}: trained tokens/s {before:.0f} -> "
                    f"{s.trained_tokens_per_s:.0f} ({gain:+.0%})",
                )
                return self._made(undo, now, judge=None)
        move = self._wanted(s)
        if move is None or now < self.blocked_until[move.delta]:
            return None
        return self._made(move, now, judge=s.trained_tokens_per_s)

    def _wanted(self, s: Signals) -> Move | None:
        cfg = self.cfg
        if s.trainer_idle > cfg.trainer_idle_high and s.generators < cfg.max_generators:
            return Move(1, f"trainer idle {s.trainer_idle:.0%} > {cfg.trainer_idle_high:.0%}")
        busy = s.trainer_idle < cfg.trainer_idle_low
        if busy and s.ready_batches >= cfg.backlog_batches and s.generators > cfg.min_generators:
            return Move(
                -1,
                f"trainer idle {s.trainer_idle:.0%} < {cfg.trainer_idle_low:.0%} with "
                f"{s.ready_batches:.1f} batches ready",
            )
        return None

    def _made(self, move: Move, now: float, judge: float | None) -> Move:
        self.last_move_at = now
        self.judging = (move, judge) if judge is not None else None
        return move
