"""What a generator measures about itself (docs/design.md, Weights without stopping
generation; What is measured).

The design claims that generators never pause for weight updates; these figures check
it. ``GeneratorWorker`` feeds one ``GeneratorStats`` from its decode loop (engine steps,
idle loop turns) and from its weights thread (frames arrived, handed to the engine).
Every ``metrics.interval_s`` it logs ``window()`` as ``generator/*`` scalars, and at exit
``summary()`` goes to ``RUN_DIR/generator_<id>_summary.json``:

- tokens/s generated, and the **idle fraction**: the share of wall time the engine had
  no request to decode (waiting on leases, i.e. on the buffer's staleness gate);
- engine step times (mean, p50, p99) split into **update** steps — those that began or
  ended while an update was between its frames' arrival and its flip, and the flip step
  itself (which re-prefills under ``recompute``) — and **steady** steps; in the summary
  also the update steps against steady steps of the same batch size and kind
  (``update_step_ratio_*``, ``steady_step_ms_p99_matched``), since updates come with new
  leases and so fall on full batches that prefill;
- per update, seconds from the frames' arrival to staged (ready to flip) and to the flip;
- **slot occupancy** (``slot_occupancy``): the mean share of the engine's slots (running
  plus free) in use, weighted by loop-turn wall time, idle turns counting as none in use;
  reported once the loop passes each step's output and status to ``on_output``;
- per weights version, the **tail** of its batch: seconds from the finish by which 90% of
  the leases finished under it were done to the last one (``tail_s``, summed over the
  versions closed, i.e. replaced by a newer one, ``tail_batches``), against the version's
  generation seconds, from its first engine step to its last finish (``batch_gen_s``);
  ``tail_s_mean`` and ``tail_fraction`` follow. Under ``max_staleness`` 0 the leases of
  a version are one batch, and the tail is the time the last 10% of it holds the step up;
- in the summary only, steady step times **by active batch size** (``steady_step_by_batch``:
  per bucket of sequences in the step, the steps, their seconds, sequences and, when the
  caller passes them, prompt tokens prefilled), which is what ``asyncrl.sim`` calibrates
  the engine's step cost against batch size from.

The ZeroMQ I/O thread receiving the frames is invisible here: a message is seen only
once it is whole, so "update" starts at arrival, not at the first byte.

Why one file: every figure of a generator's summary and ``generator/*`` scalars comes from
one ``GeneratorStats``; the per-batch-size table, the totals and the version finishes are
its parts, used nowhere else, and read best beside the figures they make.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # annotations only: the engine module imports torch, these stats need not
    from asyncrl.engine.base import EngineStatus, StepOutput


def step_time_stats(prefix: str, seconds: Sequence[float]) -> dict[str, float]:
    """``{prefix}_ms_mean/_p50/_p99`` of step times given in seconds; empty for no steps."""
    if not len(seconds):
        return {}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    p50, p99 = np.percentile(ms, [50, 99])
    return {
        f"{prefix}_ms_mean": float(ms.mean()),
        f"{prefix}_ms_p50": float(p50),
        f"{prefix}_ms_p99": float(p99),
    }


def _kind(sequences: int, prefill_tokens: int | None) -> tuple[int, bool | None]:
    """A step's stratum: its batch bucket, and whether it prefilled (None: not known)."""
    return batch_bucket(sequences), None if prefill_tokens is None else prefill_tokens > 0


def batch_bucket(sequences: int) -> int:
    """The bucket (its lowest batch size) of a step with ``sequences`` sequences: exact up
    to 64, then 8 wide up to 256, then 64 wide, so the table stays small at any slot count."""
    if sequences <= 64:
        return sequences
    if sequences <= 256:
        return 64 + 8 * ((sequences - 64) // 8)
    return 256 + 64 * ((sequences - 256) // 64)


@dataclass
class _ByBatch:
    """Steady engine steps by batch bucket: [steps, seconds, sequences, prefill tokens]."""

    buckets: dict[int, list[float]] = field(default_factory=dict)
    by_kind: dict[tuple[int, bool | None], array] = field(default_factory=dict)
    """Every step's seconds by (bucket, whether the step prefilled; None where unknown)."""

    def add(self, seconds: float, sequences: int, prefill_tokens: int | None) -> None:
        bucket = batch_bucket(sequences)
        row = self.buckets.setdefault(bucket, [0.0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += seconds
        row[2] += sequences
        if prefill_tokens is not None:
            row[3] += prefill_tokens
        self.by_kind.setdefault(_kind(sequences, prefill_tokens), array("d")).append(seconds)

    def mean_s(self, sequences: int, prefill_tokens: int | None = None) -> float | None:
        """The mean steady step of ``sequences``' bucket; None before any. With
        ``prefill_tokens`` known, of the steps that prefilled too (or did not): a step
        admitting new prompts costs more than a decode-only one of the same batch."""
        if prefill_tokens is None:
            row = self.buckets.get(batch_bucket(sequences))
            return row[1] / row[0] if row else None
        steps = self.by_kind.get(_kind(sequences, prefill_tokens))
        return sum(steps) / len(steps) if steps else None

    def matched_percentile(self, steps: Sequence[tuple[int, float, int | None]], q: float):
        """The ``q``-th percentile of the steady steps weighted to the mix of bucket and
        kind of ``steps`` ((sequences, seconds, prefill tokens) each): what those steps
        would cost at that percentile with no update in flight. None without a match."""
        mix = Counter(_kind(sequences, prefill) for sequences, _, prefill in steps)
        pools = [(pool, n) for k, n in mix.items() if len(pool := self._pool(*k))]
        if not pools:
            return None
        seconds = np.concatenate([pool for pool, _ in pools])
        weights = np.concatenate([np.full(len(pool), n / len(pool)) for pool, n in pools])
        order = np.argsort(seconds, kind="stable")
        cumulative = np.cumsum(weights[order])
        at = int(np.searchsorted(cumulative, q / 100.0 * cumulative[-1]))
        return float(seconds[order][min(at, len(seconds) - 1)])

    def _pool(self, bucket: int, prefilled: bool | None) -> np.ndarray:
        """The steady steps of one stratum; a step whose kind is unknown matches every
        steady step of its bucket, as in ``mean_s``."""
        kinds = [prefilled] if prefilled is not None else [True, False, None]
        found = [
            np.frombuffer(self.by_kind[(bucket, k)]) for k in kinds if (bucket, k) in self.by_kind
        ]
        return np.concatenate(found) if found else np.empty(0)

    def table(self) -> dict[str, dict[str, float]]:
        out = {}
        for bucket, (steps, seconds, sequences, prefill) in sorted(self.buckets.items()):
            row = {"steps": steps, "seconds": seconds, "sequences": sequences}
            if any(kind is not None for _, kind in self.by_kind):  # prefill counted
                row["prefill_tokens"] = prefill
            out[str(bucket)] = row
        return out


@dataclass
class _Totals:
    """Sums over one span of time: a logging window, or the whole run."""

    seconds: float = 0.0
    idle_s: float = 0.0
    tokens: int = 0
    steady_step_s: array = field(default_factory=lambda: array("d"))
    update_step_s: array = field(default_factory=lambda: array("d"))
    stage_s: list[float] = field(default_factory=list)
    flip_s: list[float] = field(default_factory=list)
    slot_s: float = 0.0
    """Seconds of the turns whose slot occupancy is known (every idle turn)."""
    busy_slot_s: float = 0.0
    """Σ over those turns of seconds × the fraction of the engine's slots in use."""
    tails: list[tuple[float, float]] = field(default_factory=list)
    """(batch generation seconds, tail seconds) of each weights version closed."""

    def scalars(self, sees_slots: bool) -> dict[str, float]:
        steps = len(self.steady_step_s) + len(self.update_step_s)
        out = {
            "window_s": self.seconds,
            "tokens": float(self.tokens),
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "idle_s": self.idle_s,
            "idle_fraction": self.idle_s / self.seconds if self.seconds > 0 else 0.0,
            "steps": float(steps),
            "update_steps": float(len(self.update_step_s)),
            **step_time_stats("steady_step", self.steady_step_s),
            **step_time_stats("update_step", self.update_step_s),
        }
        if self.stage_s:
            out["weight_stage_s"] = sum(self.stage_s) / len(self.stage_s)
        if self.flip_s:
            # Versions flipped in, each inside one engine step (an update step); versions
            # superseded before they were staged are received but never flipped.
            out["weights_flipped"] = float(len(self.flip_s))
            out["weight_flip_s"] = sum(self.flip_s) / len(self.flip_s)
            out["weight_flip_s_max"] = max(self.flip_s)
        if sees_slots and self.slot_s > 0:
            out["slot_occupancy"] = self.busy_slot_s / self.slot_s
        if self.tails:
            gen_s, tail_s = (sum(t[i] for t in self.tails) for i in (0, 1))
            out.update(tail_batches=float(len(self.tails)), batch_gen_s=gen_s, tail_s=tail_s)
            out["tail_s_mean"] = tail_s / len(self.tails)
            out["tail_fraction"] = tail_s / gen_s if gen_s > 0 else 0.0
        return out


def batch_tail(began: float, finishes: Sequence[float]) -> tuple[float, float]:
    """(generation seconds, tail seconds) of the leases finished under one weights
    version: from ``began`` (the start of the first engine step that ran under it) to the
    last finish, and from the finish by which 90% of them were done to the last."""
    done = sorted(finishes)
    p90 = done[math.ceil(0.9 * len(done)) - 1]
    return done[-1] - began, done[-1] - p90


class VersionFinishes:
    """When the leases finished under the weights version in use: opened by the first
    engine step under a version, closed by the first step under another."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.began = 0.0
        self.finishes: list[float] = []

    def step(
        self, version: int, began: float, ended: float, finished: int
    ) -> tuple[float, float] | None:
        """One engine step that ran under ``version`` from ``began`` to ``ended`` and
        finished ``finished`` leases; returns the (generation, tail) seconds of the
        version it closed, None if it closed none (or one with no finish)."""
        closed = None
        if version != self.version:
            closed = self.close()
            self.version, self.began, self.finishes = version, began, []
        self.finishes += [ended] * finished
        return closed

    def close(self) -> tuple[float, float] | None:
        return batch_tail(self.began, self.finishes) if self.finishes else None


class GeneratorStats:
    """Counters of one generator process; the weights thread calls the ``weights_*``
    methods, the decode loop everything else."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock  # seconds; tests drive their own
        self._window, self._total = _Totals(), _Totals()
        self._by_batch = _ByBatch()  # whole run only
        # (sequences, seconds, prefill tokens) of each step during an update
        self._update_batches: list[tuple[int, float, int | None]] = []
        self.weights_received = 0
        self._lock = threading.Lock()  # guards what the weights thread writes
        self._receiving = False  # frames in hand, not yet offered to the engine
        self._arrived: dict[int, float] = {}  # offered version -> arrival, until flipped in
        self._staged: set[int] = set()  # offered versions already seen staged
        self._step_began: float | None = None  # clock at the start of the last engine step
        self._occupied: float | None = None  # slot fraction of this turn's step, if told
        self._sees_slots = False  # the caller reports slots (on_output)
        self._versions = VersionFinishes()

    # ---- weights thread ----------------------------------------------------------------
    def weights_arriving(self) -> float:
        with self._lock:
            self._receiving = True
        return self._clock()

    def weights_offered(self, version: int, arrived: float) -> None:
        with self._lock:
            self._receiving = False
            self._arrived[version] = arrived
            self.weights_received += 1

    def weight_timings(self) -> tuple[list[float], list[float]]:
        """Seconds from arrival to staged, and to flipped in, of every update so far."""
        with self._lock:
            return list(self._total.stage_s), list(self._total.flip_s)

    def weights_dropped(self) -> None:
        with self._lock:
            self._receiving = False

    # ---- decode loop -------------------------------------------------------------------
    def updating(self, version: int) -> bool:
        """Whether an update newer than ``version`` (the engine's) is on its way in."""
        with self._lock:
            return self._receiving or any(v > version for v in self._arrived)

    def observe_weights(self, version: int, staged_version: int) -> None:
        """Note updates the engine has staged (``staged_version``) or flipped (``version``)."""
        now, stage_s, flip_s = self._clock(), [], []
        with self._lock:
            for v, arrived in list(self._arrived.items()):
                # v == version unseen as staged: staged and flipped within one loop turn.
                if v in (staged_version, version) and v not in self._staged:
                    self._staged.add(v)
                    stage_s.append(now - arrived)
                if v <= version:  # flipped in, or superseded by a newer one before staging
                    if v == version:
                        flip_s.append(now - arrived)
                    del self._arrived[v]
                    self._staged.discard(v)
        for t in (self._window, self._total):
            t.stage_s += stage_s
            t.flip_s += flip_s

    def on_step(
        self, seconds: float, tokens: int, during_update: bool, prefill_tokens: int | None = None
    ) -> None:
        """One engine step: ``tokens`` is one per sequence in it (its active batch);
        ``prefill_tokens``, when known, the prompt tokens it prefilled."""
        self._step_began = self._clock() - seconds
        for t in (self._window, self._total):
            (t.update_step_s if during_update else t.steady_step_s).append(seconds)
            t.tokens += tokens
        if not during_update:
            self._by_batch.add(seconds, tokens, prefill_tokens)
        else:
            self._update_batches.append((tokens, seconds, prefill_tokens))

    def on_output(self, out: StepOutput, before: EngineStatus) -> None:
        """What the engine step just counted by ``on_step`` returned, and the engine's
        status before it: the share of its slots the step worked on (the running requests
        and the waiting ones it could admit) and the leases it finished (aborts aside)
        under its weights version, for the version's tail."""
        slots = before.running + before.free_slots
        busy = before.running + min(before.waiting, before.free_slots)
        self._occupied, self._sees_slots = (busy / slots if slots > 0 else 0.0), True
        finished = sum(f.reason != "abort" for f in out.finished)
        now = self._clock()
        began = now if self._step_began is None else self._step_began
        closed = self._versions.step(out.version, began, now, finished)
        if closed is not None:
            for t in (self._window, self._total):
                t.tails.append(closed)

    def on_loop(self, seconds: float, stepped: bool) -> None:
        """One turn of the decode loop; a turn without an engine step is idle time (and
        no slot in use); a stepped one has the occupancy ``on_output`` gave it, if any."""
        occupied, self._occupied = self._occupied, None
        for t in (self._window, self._total):
            t.seconds += seconds
            if not stepped:
                t.idle_s += seconds
            if not stepped or occupied is not None:
                t.slot_s += seconds
                t.busy_slot_s += seconds * (occupied or 0.0)

    def window(self, version: int) -> dict[str, float]:
        """``generator/*`` scalars since the previous call; starts a new window."""
        scalars = self._window.scalars(self._sees_slots)
        self._window = _Totals()
        scalars.update(weights_received=float(self.weights_received), version=float(version))
        return {f"generator/{k}": v for k, v in scalars.items()}

    def summary(self, version: int) -> dict[str, Any]:
        """The whole run's figures (this process's life) under plain names, and the steady
        step times by batch size (``steady_step_by_batch``, the one nested entry)."""
        out: dict[str, Any] = self._total.scalars(self._sees_slots)
        out["loop_s"] = out.pop("window_s")
        out.update(weights_received=float(self.weights_received), version=float(version))
        out["steady_step_by_batch"] = self._by_batch.table()
        out.update(self._update_ratios())
        return out

    def _update_ratios(self) -> dict[str, float]:
        """Each step during an update against the mean steady step of its batch size (and,
        where known, of its kind: prefilling or decode-only): what an update costs a decode
        step, apart from which batches updates fall on (they come with new leases, so full
        batches that prefill). And the p99 of the steady steps in the update steps' mix of
        batch and kind, to set the update steps' own p99 against."""
        ratios = [
            seconds / mean
            for sequences, seconds, prefill in self._update_batches
            if (mean := self._by_batch.mean_s(sequences, prefill))
        ]
        if not ratios:
            return {}
        p50, p99 = np.percentile(ratios, [50, 99])
        out = {"update_step_ratio_p50": float(p50), "update_step_ratio_p99": float(p99)}
        matched = self._by_batch.matched_percentile(self._update_batches, 99)
        out["steady_step_ms_p99_matched"] = 1000.0 * matched  # not None: a ratio matched
        return out
