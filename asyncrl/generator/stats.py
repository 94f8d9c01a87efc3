"""What a generator measures about itself (DESIGN §5, §10).

The design claims that generators never pause for weight updates; these figures check
it. ``GeneratorWorker`` feeds one ``GeneratorStats`` from its decode loop (engine steps,
idle loop turns) and from its weights thread (frames arrived, handed to the engine).
Every ``metrics.interval_s`` it logs ``window()`` as ``generator/*`` scalars, and at exit
``summary()`` goes to ``RUN_DIR/generator_<id>_summary.json``:

- tokens/s generated, and the **idle fraction**: the share of wall time the engine had
  no request to decode (waiting on leases, i.e. on the buffer's staleness gate);
- engine step times (mean, p50, p99) split into **update** steps — those that began or
  ended while an update was between its frames' arrival and its flip, and the flip step
  itself (which re-prefills under ``recompute``) — and **steady** steps;
- per update, seconds from the frames' arrival to staged (ready to flip) and to the flip;
- in the summary only, steady step times **by active batch size** (``steady_step_by_batch``:
  per bucket of sequences in the step, the steps, their seconds, sequences and, when the
  caller passes them, prompt tokens prefilled), which is what ``asyncrl.sim`` calibrates
  the engine's step cost against batch size from.

The ZeroMQ I/O thread receiving the frames is invisible here: a message is seen only
once it is whole, so "update" starts at arrival, not at the first byte.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    prefill_known: bool = False

    def add(self, seconds: float, sequences: int, prefill_tokens: int | None) -> None:
        row = self.buckets.setdefault(batch_bucket(sequences), [0.0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += seconds
        row[2] += sequences
        if prefill_tokens is not None:
            row[3] += prefill_tokens
            self.prefill_known = True

    def table(self) -> dict[str, dict[str, float]]:
        out = {}
        for bucket, (steps, seconds, sequences, prefill) in sorted(self.buckets.items()):
            row = {"steps": steps, "seconds": seconds, "sequences": sequences}
            if self.prefill_known:
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

    def scalars(self) -> dict[str, float]:
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
            out["weight_flip_s"] = sum(self.flip_s) / len(self.flip_s)
            out["weight_flip_s_max"] = max(self.flip_s)
        return out


class GeneratorStats:
    """Counters of one generator process; the weights thread calls the ``weights_*``
    methods, the decode loop everything else."""

    def __init__(self) -> None:
        self._window, self._total = _Totals(), _Totals()
        self._by_batch = _ByBatch()  # whole run only
        self.weights_received = 0
        self._lock = threading.Lock()  # guards what the weights thread writes
        self._receiving = False  # frames in hand, not yet offered to the engine
        self._arrived: dict[int, float] = {}  # offered version -> arrival, until flipped in
        self._staged: set[int] = set()  # offered versions already seen staged

    # ---- weights thread ----------------------------------------------------------------
    def weights_arriving(self) -> float:
        with self._lock:
            self._receiving = True
        return time.perf_counter()

    def weights_offered(self, version: int, arrived: float) -> None:
        with self._lock:
            self._receiving = False
            self._arrived[version] = arrived
            self.weights_received += 1

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
        now, stage_s, flip_s = time.perf_counter(), [], []
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
        for t in (self._window, self._total):
            (t.update_step_s if during_update else t.steady_step_s).append(seconds)
            t.tokens += tokens
        if not during_update:
            self._by_batch.add(seconds, tokens, prefill_tokens)

    def on_loop(self, seconds: float, stepped: bool) -> None:
        """One turn of the decode loop; a turn without an engine step is idle time."""
        for t in (self._window, self._total):
            t.seconds += seconds
            if not stepped:
                t.idle_s += seconds

    def window(self, version: int) -> dict[str, float]:
        """``generator/*`` scalars since the previous call; starts a new window."""
        scalars = self._window.scalars()
        self._window = _Totals()
        scalars.update(weights_received=float(self.weights_received), version=float(version))
        return {f"generator/{k}": v for k, v in scalars.items()}

    def summary(self, version: int) -> dict[str, Any]:
        """The whole run's figures (this process's life) under plain names, and the steady
        step times by batch size (``steady_step_by_batch``, the one nested entry)."""
        out: dict[str, Any] = self._total.scalars()
        out["loop_s"] = out.pop("window_s")
        out.update(weights_received=float(self.weights_received), version=float(version))
        out["steady_step_by_batch"] = self._by_batch.table()
        return out
