"""A trainer rank that generates while it waits (``generate_while_waiting``): the colocated
placement's sharing of cores, inside an asynchronous run.

Where the trainer waits for its batch, its cores idle. ``LendingSource`` wraps the rank's
``BatchSource`` (``asyncrl.interfaces``): for the length of each ``request_batch`` it opens
a ``Gate``, and a generator on a thread of the trainer's process (``LentWorker``, worker
``lent<rank>``, an embedded engine of its own) takes leases and decodes on those cores;
when the batch comes, the gate closes and the trainer trains only once the engine's step
in progress has ended, so the two never compute at once. A closed gate asks for no lease
and steps nothing, but keeps the heartbeats and the weight intake going: the leases it
holds wait, alive to the buffer, and go on from their last token at the next wait.
Everything else is the generator process's own code (``GeneratorWorker``): leases, chunks,
weights, the buffer's books. At the end of the stage it is drained like any generator:
its tokens sent, its leases handed back.

The gate is the trainer's wait itself, so the share of the trainer's cores that goes to
generation follows the run: nothing while generation keeps the trainer busy, most of them
where the trainer waits (dynamic sampling dropping groups, responses growing).

Under ``placement=elastic`` with ``elastic.lend_waits``, lending is one of the controller's
moves, the colocated ↔ async switch: the launcher turns a ``LendSwitch`` on or off, and
switched off the lent generator leaves as a drained one does and its engine is freed, so
a trainer that no longer waits gets its memory back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from asyncrl.buffer.config import RolloutConfig
from asyncrl.generator.worker import GeneratorWorker, make_engine
from asyncrl.interfaces import BatchSource
from asyncrl.liveness import LendSwitch
from asyncrl.wire import Batch

log = logging.getLogger(__name__)

CLOSED_POLL_MS = 20
"""How long a closed gate's worker waits on the buffer's socket per turn: heartbeats and
grants still flow, and an opened gate is seen within this."""


class Gate:
    """Who computes now: the trainer (closed) or the lent engine (open)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.turn = threading.Lock()
        """Held by the lent worker for each engine step."""

    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Close, and return once no engine step is in progress."""
        self._open.clear()
        with self.turn:
            pass


class LentWorker(GeneratorWorker):
    """A generator that asks for leases and steps its engine only while its gate is open."""

    def __init__(self, cfg: RolloutConfig, worker_id: str, engine, gate: Gate) -> None:
        super().__init__(cfg, worker_id, engine)
        self.gate = gate
        # The trainer's loop marks the process alive: a thread of it must not hide a
        # trainer that stopped turning.
        self.alive.path = None

    def _ask_for_leases(self) -> None:
        if self.gate.is_open():
            super()._ask_for_leases()

    def _busy(self) -> bool:
        return super()._busy() and self.gate.is_open()

    def _idle_ms(self) -> int:
        return super()._idle_ms() if self.gate.is_open() else CLOSED_POLL_MS

    def _start_held(self) -> None:
        if self.gate.is_open():
            super()._start_held()

    def _step(self) -> None:
        with self.gate.turn:
            if self.gate.is_open():  # closed while this turn waited for the lock
                super()._step()


class LendingSource:
    """A ``BatchSource`` that lends the trainer rank's cores to generation while it waits:
    always, or, given a ``LendSwitch``, while it is on (the elastic controller's lending
    moves). Switched off, the lent generator is drained (its leases go back to the buffer,
    which another generator continues) and its engine, weights and KV cache, is freed;
    switched on again, a new one joins under a new worker id and takes the newest weights
    as any joining generator does."""

    def __init__(
        self, inner: BatchSource, cfg: RolloutConfig, rank: int, switch: LendSwitch | None = None
    ) -> None:
        if not cfg.engine.plan().embedded:  # refused before the run starts, too
            raise ValueError("generate_while_waiting needs engine.backend=embedded")
        self.inner, self.cfg, self.rank, self.switch = inner, cfg, rank, switch
        # The engine decodes on the trainer's cores with the trainer's intra-op threads,
        # set again on its own thread in _run. torch's count is process-wide (a thread
        # starts with the last count set anywhere), so the engine must not set the
        # generators' count (threads=0 below): that would change the trainer's too.
        self.threads = torch.get_num_threads()
        self.gate = Gate()
        self.worker: LentWorker | None = None
        self.thread: threading.Thread | None = None
        self.joins = 0
        if switch is None:
            self._start()

    def _start(self) -> None:
        worker_id = f"lent{self.rank}" + (f"-{self.joins}" if self.joins else "")
        self.joins += 1
        embedded = replace(self.cfg.engine.embedded, threads=0)
        engine_cfg = replace(self.cfg, engine=replace(self.cfg.engine, embedded=embedded))
        engine = make_engine(engine_cfg, self.cfg.model.path, worker_id)
        self.worker = LentWorker(self.cfg, worker_id, engine, self.gate)
        self.thread = threading.Thread(target=self._run, args=(self.worker,), daemon=True)
        self.thread.name = f"generator-{worker_id}"
        self.thread.start()

    def _run(self, worker: LentWorker) -> None:
        torch.set_num_threads(self.threads)
        try:
            worker.run()
        except Exception:  # the trainer trains on; the buffer takes its leases back
            log.exception("the lent generator %s stopped", worker.worker_id)
        finally:
            worker.engine.close()

    def _leave(self) -> None:
        """Drain the lent generator (its tokens sent, its leases handed back) and free its
        engine."""
        worker, thread = self.worker, self.thread
        if worker is None or thread is None:
            return
        worker.drain()
        thread.join(timeout=self.cfg.buffer.heartbeat_timeout_s + 30)
        if thread.is_alive():
            log.warning("the lent generator did not leave in time: the buffer takes its leases")
            worker.stop()
        self.worker = self.thread = None

    def request_batch(
        self,
        step: int,
        world_size: int,
        timeout_s: float = 600.0,
        on_wait: Callable[[], None] | None = None,
        wait_tick_s: float = 10.0,
        deadline: float | None = None,
    ) -> Batch | None:
        if self.switch is not None:
            on = self.switch.on
            if on and self.worker is None:
                self._start()
            elif not on and self.worker is not None:
                self._leave()
        self.gate.open()  # with no lent generator, nobody is waiting for it
        try:
            return self.inner.request_batch(
                step, world_size, timeout_s, on_wait, wait_tick_s, deadline
            )
        finally:
            self.gate.close()

    def announce_version(self, version: int, resumed: bool = False) -> None:
        self.inner.announce_version(version, resumed)

    def announce_checkpoint(self, oldest_kept_step: int) -> None:
        self.inner.announce_checkpoint(oldest_kept_step)

    def close(self) -> None:
        """Drain the lent generator, then close the source it wraps."""
        self._leave()
        self.inner.close()
