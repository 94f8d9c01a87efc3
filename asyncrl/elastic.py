"""The elastic placement's controller: how many generators and reward servers a run
should have now, decided from what the run shows while it goes on.

It is pure: ``Controller.decide`` takes the time and a ``Signals`` snapshot and returns a
``Move`` (processes of one role more or fewer, with its reason) or None. The launcher
feeds it the run's own metrics and carries its moves out through its pools
(``asyncrl.launcher.elastic``); anything else that can produce ``Signals`` (a model of the
system) can drive the same code.

The rule, one move at a time:

- the trainer waits for batches (its idle share above ``trainer_idle_high``) while
  finished samples queue for a reward server (``reward_backlog`` batches or more):
  scoring is the bottleneck, so one reward server more;
- reward servers would score less than ``reward_busy_low`` of their time with one
  fewer (their busy share now, shared by one server less), with nothing much queued:
  one fewer;
- a reward move that was kept (not undone) is not reversed within ``retry_dwells``
  dwells: a batching server's busy share swings with the bursts it is sent, and a
  server given back at the first quiet look is taken again at the next burst;
- the trainer waits for batches otherwise: generation is the bottleneck, so one
  generator more, or up to ``max_step`` more toward the split where generation would
  keep the trainer busy (``balanced``); where generators and trainer share slots, only
  if the whole split its signals predict trains most lies above this one (below it, the
  trainer waits for the batches' slowest sequences, and a slot taken from it slows
  training more than a generator more speeds supply);
- with ``lend_waits``, the trainer waits and no generator more can be added (at
  ``max_generators``, or after an undo, or a move that could not repay): its waits are
  lent to a generator on its own cores (``generate_while_waiting``), the colocated
  sharing of resources inside the asynchronous run; lending stops where the trainer is
  busy (idle below ``trainer_idle_low``: nothing to lend), and the lent engine's memory
  goes back to the trainer;
- the trainer is busy (idle below ``trainer_idle_low``) while ready batches pile up
  (``backlog_batches`` or more): generation runs ahead, so one generator fewer, and its
  cores or accelerator go back to the rest of the run;
- a move that restarts the trainer (where generators and trainer share slots) must be
  able to repay it: at best it speeds up the bottleneck side in proportion to the slots
  it gives that side (generation by ``delta / generators``, training by ``delta /
  trainer_slots``), and that share of a dwell (or of what the run has left, if less)
  must reach ``move_cost_s``. Near the best
  split of many slots a one-slot move cannot repay a restart, whatever the idle share
  says (the trainer still waits for batches there, between long-tail sequences);
- nothing moves within a dwell of the last move (``dwell_s``, stretched to hold
  ``dwell_steps`` trainer steps where steps grow long). Then the move is judged on what the
  run is for, trained tokens/s, against what they would have been without it: their
  level before the move carried on along their trend over the dwell before it (the
  workload drifts while a move runs: responses grow, dynamic sampling drops more groups
  as accuracy rises). A generator more must have raised them by ``min_gain`` (else it
  only took cores or slots from the trainer); one fewer must not have lowered them by as
  much (it was to free resources, not to speed training up). A move that fails is
  undone, and its direction is not tried again for ``retry_dwells`` dwells. No move is
  made before that trend is known: a window of signals after the last move's window.

The gap between the two idle thresholds, the dwell and the undo rule keep it from
thrashing: at most one move per dwell, and a move that does not pay is not repeated
at once.

The rule is the controller's settings (``ElasticConfig``) and how it decides
(``Controller``), each stated in the other's terms, so they share this file; what it reads
(``Signals``) and the split a snapshot implies (``balanced``) are
``asyncrl.elastic_signals``, which the launcher and the simulator fill in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from asyncrl.elastic_signals import Signals, balanced_target


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
    window_steps: int = 2
    """The window also holds at least this many trainer steps: where steps grow longer
    than the window (responses lengthen over a run), it stretches to them, so a
    window's figures never rest on one step."""
    dwell_steps: int = 5
    """A dwell also lasts at least this many trainer steps (at the window's seconds per
    step): a move is judged on steps made after it, whatever a step takes by then."""
    trainer_idle_high: float = 0.25
    """The trainer's share of time spent waiting for batches above which generation is
    the bottleneck."""
    trainer_idle_low: float = 0.05
    """Below it, with ``backlog_batches`` ready, generation runs ahead of training."""
    backlog_batches: float = 2.0
    """Ready batches waiting in the buffer that count as generation running ahead."""
    min_gain: float = 0.05
    """A generator more is undone unless trained tokens/s rose by this share over their
    trend; one fewer is undone if they fell by as much."""
    retry_dwells: int = 3
    """Dwells before a direction that was undone is tried again, and before a reward
    move that was kept is reversed."""
    move_cost_s: float = 0.0
    """Seconds of training a move of shared slots costs (the trainer's checkpoint and
    restart on its new slot count). A move is made only if the most it could gain over a
    dwell covers this. It applies where generators and trainer share slots (the
    simulator's cluster); the launchers' generators have cores of their own, and moving
    them does not stop the trainer."""
    max_step: int = 1
    """Most generators one move adds. Above 1, a move goes toward the split where
    generation would keep the trainer busy (estimated from its idle share; see
    ``balanced``): on a cluster of many slots, one slot a dwell reaches it too late."""

    min_reward_servers: int = 1
    """Never fewer reward servers than this (runs with ``reward.model_servers``)."""
    max_reward_servers: int = 2
    """Never more reward servers than this."""
    reward_backlog: float = 0.5
    """Samples waiting for a reward server, in batches, from which the trainer's wait is
    put down to scoring rather than generation."""
    lend_waits: bool = False
    """Moves may also lend the trainer's waits to a generator on its cores (where no
    generator more can be added) and stop lending where the trainer is busy, which hands
    the lent engine's memory back (embedded engines; ``LENDING``)."""
    reward_busy_low: float = 0.3
    """Reward servers that would score less than this share of their time with one
    fewer, with less than ``reward_backlog`` queued, give one back."""

    def check(self, generators: int, reward_servers: int = 0) -> None:
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
        if not 1 <= self.window_steps <= self.dwell_steps:
            raise ValueError(
                f"elastic.window_steps={self.window_steps} must be at least 1 and at most "
                f"elastic.dwell_steps={self.dwell_steps}: a move is judged on a window after it"
            )
        rlo, rhi = self.min_reward_servers, self.max_reward_servers
        if reward_servers and not 1 <= rlo <= reward_servers <= rhi:
            raise ValueError(
                f"reward.model_servers={reward_servers} is where an elastic run starts: it "
                f"must lie within elastic.min_reward_servers..max_reward_servers ({rlo}..{rhi}), "
                "the lower at least 1"
            )
        if self.move_cost_s < 0:
            raise ValueError(f"elastic.move_cost_s={self.move_cost_s:g} must be at least 0")
        if self.max_step < 1:
            raise ValueError(f"elastic.max_step={self.max_step} must be at least 1")
        if not 0 <= self.trainer_idle_low < self.trainer_idle_high <= 1:
            raise ValueError(
                f"elastic.trainer_idle_low={self.trainer_idle_low:g} must be below "
                f"elastic.trainer_idle_high={self.trainer_idle_high:g}, both within 0..1"
            )


LENDING = "lending"
"""The role of a move that starts (+1) or stops (-1) lending the trainer's waits."""


class Move(NamedTuple):
    delta: int
    """Processes of ``role`` more (+) or fewer (-); for ``LENDING``, start or stop."""
    reason: str
    role: str = "generators"
    """"generators", "rewards" (reward servers) or ``LENDING``."""


class Controller:
    def __init__(self, cfg: ElasticConfig) -> None:
        self.cfg = cfg
        self.last_move_at = float("-inf")
        # The move being judged: it, trained tokens/s before it, their trend, when made.
        self.judging: tuple[Move, float, float, float] | None = None
        self.blocked_until: dict[tuple[str, int], float] = {}  # (role, sign) -> time
        self.seen: deque[tuple[float, float]] = deque()  # (time, trained tokens/s)
        # The window and dwell in seconds now: the configured ones, stretched to hold
        # ``window_steps`` and ``dwell_steps`` of the latest steps.
        self.window_s, self.dwell_s = cfg.window_s, cfg.dwell_s

    def decide(self, now: float, s: Signals) -> Move | None:
        """The move to make now, or None."""
        cfg = self.cfg
        self.window_s = max(cfg.window_s, cfg.window_steps * s.step_s)
        self.dwell_s = max(cfg.dwell_s, cfg.dwell_steps * s.step_s, self.window_s)
        self.seen.append((now, s.trained_tokens_per_s))
        while self.seen[0][0] < now - self.dwell_s:
            self.seen.popleft()
        if now - self.last_move_at < self.dwell_s:
            return None
        if self.judging is not None:
            undo = self._judged(now, s)
            if undo is not None:
                return self._made(undo, now, judge=False)
        move = next(
            (m for m in self._wanted(s) if now >= self._blocked_until(m) and self._repays(m, s)),
            None,
        )
        if move is None:
            return None
        if self._trend() is None:
            return None  # a move is judged against the trend before it: none is known yet
        return self._made(move, now, judge=True)

    def _judged(self, now: float, s: Signals) -> Move | None:
        """The undo of the move being judged, if it did not pay. Trained tokens/s are
        compared with what they would be without it: their level before the move carried
        on along their trend then, since the workload drifts (longer responses, more
        groups dropped) while the move runs."""
        cfg, (move, before, trend, at) = self.cfg, self.judging
        self.judging = None
        expected = before + trend * (now - at)
        if expected <= 0:
            return None
        gain = s.trained_tokens_per_s / expected - 1
        if gain >= (cfg.min_gain if move.delta > 0 else -cfg.min_gain):
            return None
        self.blocked_until[_direction(move)] = now + cfg.retry_dwells * self.dwell_s
        return Move(
            -move.delta,
            f"undo {move.delta:+d}: trained tokens/s {s.trained_tokens_per_s:.0f}, "
            f"{gain:+.0%} against {expected:.0f} expected without it",
            move.role,
        )

    def _trend(self) -> float | None:
        """Trained tokens/s per second (least squares) over the last dwell, counting only
        what was seen a window after the previous move (its transition left out); None
        until that spans a window."""
        window = self.window_s
        points = [(t, v) for t, v in self.seen if t >= self.last_move_at + window]
        if len(points) < 2 or points[-1][0] - points[0][0] < window:
            return None
        mt = sum(t for t, _ in points) / len(points)
        mv = sum(v for _, v in points) / len(points)
        var = sum((t - mt) ** 2 for t, _ in points)
        return sum((t - mt) * (v - mv) for t, v in points) / var

    def _wanted(self, s: Signals) -> Iterator[Move]:
        """The moves the signals call for, first the most wanted (one not blocked by an
        undo is made)."""
        cfg = self.cfg
        scoring_behind = s.reward_servers > 0 and s.reward_queue >= cfg.reward_backlog
        if s.trainer_idle > cfg.trainer_idle_high and scoring_behind:
            if s.reward_servers >= cfg.max_reward_servers:
                return  # more generators would only lengthen the queue
            yield Move(
                1,
                f"trainer idle {s.trainer_idle:.0%} > {cfg.trainer_idle_high:.0%} with "
                f"{s.reward_queue:.1f} batches waiting for a reward server",
                "rewards",
            )
            return  # the same: scoring holds the trainer up, not generation
        # The servers left would take the work of the one given back.
        left = s.reward_busy * s.reward_servers / max(s.reward_servers - 1, 1)
        idle_scorers = left < cfg.reward_busy_low and not scoring_behind
        if s.reward_servers > cfg.min_reward_servers and idle_scorers:
            yield Move(
                -1,
                f"reward servers busy {s.reward_busy:.0%}, {left:.0%} on one fewer < "
                f"{cfg.reward_busy_low:.0%} of their time",
                "rewards",
            )
        target = balanced_target(s)
        # On shared slots a generator more is a trainer slot fewer: where the split the
        # signals predict trains most is not above this one, the trainer's waits are the
        # batches' slowest sequences, which more generators would not shorten.
        beyond = s.trainer_slots <= 0 or target > s.generators
        if s.trainer_idle > cfg.trainer_idle_high and s.generators < cfg.max_generators and beyond:
            room = cfg.max_generators - s.generators
            step = min(cfg.max_step, room, max(1, target - s.generators))
            yield Move(step, f"trainer idle {s.trainer_idle:.0%} > {cfg.trainer_idle_high:.0%}")
        if cfg.lend_waits and not s.lending and s.trainer_idle > cfg.trainer_idle_high:
            yield Move(
                1,
                f"trainer idle {s.trainer_idle:.0%} > {cfg.trainer_idle_high:.0%} and no "
                "generator more: its cores generate while it waits",
                LENDING,
            )
        busy = s.trainer_idle < cfg.trainer_idle_low
        if s.lending and busy:
            yield Move(
                -1,
                f"trainer idle {s.trainer_idle:.0%} < {cfg.trainer_idle_low:.0%}: nothing to "
                "lend, the lent engine's memory goes back",
                LENDING,
            )
        if busy and s.ready_batches >= cfg.backlog_batches and s.generators > cfg.min_generators:
            yield Move(
                -1,
                f"trainer idle {s.trainer_idle:.0%} < {cfg.trainer_idle_low:.0%} with "
                f"{s.ready_batches:.1f} batches ready",
            )

    def _repays(self, move: Move, s: Signals) -> bool:
        """Whether ``move`` could repay a restart of the trainer within a dwell: at best it
        speeds the side it gives slots to in proportion to them, and only while the run
        lasts (a run that ends within a dwell gives it less than one)."""
        if move.role != "generators" or s.trainer_slots <= 0 or self.cfg.move_cost_s <= 0:
            return True
        side = s.generators if move.delta > 0 else s.trainer_slots
        lasts = min(self.dwell_s, s.steps_left * s.step_s)
        return abs(move.delta) / max(side, 1) * lasts >= self.cfg.move_cost_s

    def _blocked_until(self, move: Move) -> float:
        """Until when ``move``'s role and direction wait after an undo."""
        return self.blocked_until.get(_direction(move), float("-inf"))

    def _made(self, move: Move, now: float, judge: bool) -> Move:
        """Record ``move`` made at ``now``; it is judged a dwell later unless an undo."""
        if judge:
            before = self.seen[-1][1]
            self.judging = (move, before, self._trend(), now)
            if move.role == "rewards":  # kept, its reverse waits as an undone move's repeat
                reverse = _direction(move._replace(delta=-move.delta))
                self.blocked_until[reverse] = now + self.cfg.retry_dwells * self.dwell_s
        self.last_move_at = now
        return move


def _direction(move: Move) -> tuple[str, int]:
    """What an undo blocks: more or fewer of the move's role."""
    return move.role, 1 if move.delta > 0 else -1
