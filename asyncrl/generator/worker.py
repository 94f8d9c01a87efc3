"""The generator process: one engine, fed by leases from the buffer, streaming chunks back.

It drives its engine through the ``Engine`` protocol only (``asyncrl.interfaces``): it
asks the buffer for as many leases as the engine's status shows free slots, submits each
as an engine request (prompt plus any prefix an earlier holder generated), steps the
engine, and flushes each lease's new tokens as a ``Chunk`` every ``chunk_tokens`` tokens
or ``chunk_ms`` milliseconds, whichever comes first. A lease the buffer takes back
(``LeaseRevoked``: no progress, or a chunk lost) is aborted in the engine and its unsent
tokens dropped, so its slot goes to new work. Drained (``drain``; SIGUSR1 to the
process), it leaves the run without losing work: it asks for nothing more, sends every
token it has, aborts its requests, tells the buffer it is ``Leaving`` (the buffer leases
its samples again, continued from those tokens) and, once the buffer has answered, exits
with ``EXIT_DRAINED``, which the launcher does not restart. It sends heartbeats with its
weights version, and a background thread receives weight updates from the trainer's PUB
socket (tensors, or a directory on disk) and hands them to ``stage_weights``, so decoding
never waits for a transfer. ``engine.backend`` picks the engine: the embedded one in this
process, or ``remote``, inference servers over HTTP (``asyncrl.engine.remote``).
It measures itself (``GeneratorStats``: tokens/s, idle fraction, step times during weight
updates against steady ones) into ``RUN_DIR/metrics.jsonl`` and TensorBoard as process
``generator_<id>`` every ``metrics.interval_s``, and into ``generator_<id>_summary.json``
at exit.

    python -m asyncrl.generator.worker --config RUN_DIR/rollout.json --worker-id g0

Why one file: the generator process is one loop (leases in, engine steps, chunks out) and
the weights thread that feeds it; ``make_engine`` and ``main`` are its entry. Its parts with
a life of their own are elsewhere: the engines, the lease bridge (``asyncrl.engine.leases``),
the two sockets to the buffer (``asyncrl.generator.buffer_link``), the weight intake
(``asyncrl.generator.weights``) and the measurements (``asyncrl.generator.stats``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.config import ConfigError, load_json
from asyncrl.engine.base import Request, ServerFailed, StepOutput
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.fit import fit_context
from asyncrl.engine.leases import PendingLease, lease_request, record_tokens
from asyncrl.engine.remote import RemoteEngine
from asyncrl.episodes.driver import EpisodeDriver
from asyncrl.generator.buffer_link import LeaseDesk, Outbox
from asyncrl.generator.stats import GeneratorStats
from asyncrl.generator.weights import WeightsIntake
from asyncrl.interfaces import Engine
from asyncrl.liveness import EXIT_DRAINED, EXIT_FATAL, AliveMark
from asyncrl.metrics import MetricsLogger
from asyncrl.transport import client_socket, read_endpoints, write_endpoints
from asyncrl.weights.probe import FlipProbe
from asyncrl.wire import Heartbeat, Lease, Leaving

log = logging.getLogger(__name__)


class GeneratorWorker:
    def __init__(self, cfg: RolloutConfig, worker_id: str, engine: Engine) -> None:
        self.cfg, self.worker_id, self.engine = cfg, worker_id, engine
        self.ctx = zmq.Context()
        endpoints = read_endpoints(cfg.run_dir, "buffer")
        if endpoints is None:
            raise TimeoutError(f"the buffer never published its endpoints in {cfg.run_dir}")
        # This start of the process: after a restart under the same worker id the buffer
        # re-issues what the dead process held at once, not after a progress timeout.
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        t = cfg.transport
        push = client_socket(self.ctx, zmq.PUSH, t, cfg.run_dir)
        push.connect(endpoints["chunks"])
        self.outbox = Outbox(cfg, worker_id, push)
        dealer = client_socket(self.ctx, zmq.DEALER, t, cfg.run_dir, identity=worker_id)
        dealer.connect(endpoints["leases"])
        self.desk = LeaseDesk(cfg, worker_id, self.incarnation, dealer)
        self.pending: dict[str, PendingLease] = {}
        self.stop_event = threading.Event()
        self.drain_event = threading.Event()  # set: hand every lease back and stop
        self.leases_handed_back: int | None = None  # set once drained
        self.leases_aborted = 0  # taken back by the buffer while this generator held them
        self.requests_refused = 0  # leases the engine could not run (see _submit)
        self.stats = GeneratorStats()
        # The launcher restarts a generator whose loop stops turning (frozen, wedged): weights
        # stage on their own thread, so a turn never waits for a transfer.
        self.alive = AliveMark()
        self.metrics = MetricsLogger(cfg.run_dir, f"generator_{worker_id}", cfg.metrics)
        self.episodes: EpisodeDriver | None = None
        if cfg.task.environment:  # multi-turn: each lease is an episode
            self.episodes = EpisodeDriver(cfg, engine, self.pending, self._send_now)
        self.weights = WeightsIntake(cfg, worker_id, engine, self.stats, self.ctx, self.stop_event)
        self.probe: FlipProbe | None = None
        if cfg.transport.weights.probe_text:
            self.probe = FlipProbe(
                cfg.site(),
                cfg.model.path,
                worker_id,
                engine,
                self.ctx,
                lambda: self.weights.lineage,
            )

    def run(self) -> None:
        last_beat, last_log, turn_start = 0.0, time.time(), time.perf_counter()
        try:
            while not self.stop_event.is_set():
                if self.drain_event.is_set():
                    self._leave()
                    break
                self._ask_for_leases()
                self._take_leases(block_ms=0 if self._busy() else self._idle_ms())
                self._start_held()
                if self.episodes is not None:
                    self.episodes.poll(time.time())
                stepped = self._busy()
                if stepped:
                    self._step()
                now = time.time()
                self.outbox.flush(self.pending.values(), now, force=False)
                self.alive.touch(now)
                turn_start = self._end_turn(turn_start, stepped)
                if now - last_beat >= self.cfg.transport.heartbeat_s:
                    self._heartbeat()
                    last_beat = now
                if now - last_log >= self.cfg.metrics.interval_s:
                    self._log_window()
                    last_log = now
        finally:
            self.stop_event.set()
            if self.episodes is not None:
                self.episodes.close()
            self.weights.join(timeout=5)
            self._close_metrics()
            self.ctx.destroy(linger=0)

    def stop(self) -> None:
        self.stop_event.set()

    def drain(self) -> None:
        """Leave the run at the next loop turn, handing every lease back (``_leave``)."""
        self.drain_event.set()

    # ---- leases --------------------------------------------------------------------
    def _busy(self) -> bool:
        status = self.engine.status()
        if status.failure:  # a server lost for good, seen even with nothing to step
            raise ServerFailed(status.failure)
        return status.running + status.waiting > 0

    def _idle_ms(self) -> int:
        # An environment at work answers soon: its next turn should not wait for a poll;
        # nor should leases held for weights that are on their way.
        soon = self.desk.held or (self.episodes is not None and self.episodes.between_turns())
        return 2 if soon else 50

    def _ask_for_leases(self) -> None:
        status = self.engine.status()
        free = status.free_slots - status.waiting - len(self.desk.held)
        if self.episodes is not None:  # their next turns will need the slots
            free -= self.episodes.between_turns()
        self.desk.ask(free)

    def _take_leases(self, block_ms: int) -> None:
        """Take the buffer's grants (held until started) and abort what it took back."""
        revoked = self.desk.receive(block_ms)
        if revoked:
            self._abort(revoked)

    def _start_held(self) -> None:
        """Start the leases granted so far whose ``min_version`` the engine's weights meet.
        The others wait for newer weights: at η = 0 a grant for the next version often
        arrives before its weights, and a sample begun under the old ones would only be
        dropped as stale."""
        if not self.desk.held:
            return
        status = self.engine.status()
        behind = any(lease.min_version > status.version for lease in self.desk.held)
        if behind and status.staged_version >= 0 and status.running + status.waiting == 0:
            self._step()  # an idle engine flips staged weights only in a step
            status = self.engine.status()
        now = time.time()
        for lease in self.desk.ready(status.version):
            self._submit(lease, now)

    def _submit(self, lease: Lease, now: float) -> None:
        if self.episodes is not None:
            self.episodes.start(lease, now)
            return
        try:
            self.engine.submit(self.request_of(lease))
        except ValueError as e:
            # A request the engine refuses (a prompt longer than its max_seq_len) would be
            # refused again wherever it went: it ends as an error, which fails its group in
            # the buffer (counted in buffer/groups_failed), instead of crashing this process.
            self.requests_refused += 1
            log.warning("lease %s refused by the engine: %s", lease.lease_id, e)
            self.outbox.chunk(PendingLease(lease), now, finished=True, reason="error")
            return
        self.pending[lease.lease_id] = PendingLease(lease, last_flush=now)

    def request_of(self, lease: Lease) -> Request:
        """The engine request that generates ``lease`` (a ValueError if it cannot)."""
        return lease_request(lease)

    def _leave(self) -> None:
        """Hand every lease back and go. The tokens generated so far are sent first, then
        ``Leaving`` on the same socket, so the buffer has them all when it takes the
        leases back: the next holder continues each sample from its last token, with the
        same seed. A grant on its way is taken back there too (the buffer takes what it
        had given this process, not what the process names). An episode's turn in progress
        is done again by the next holder (episodes stream whole turns). Without the
        buffer's answer within ``heartbeat_timeout_s`` (it is down), the leases come back
        as a dead holder's would."""
        self._take_leases(block_ms=0)
        held = self._lease_ids()
        self.outbox.flush(self.pending.values(), time.time(), force=True)
        self._abort(held, counted=False)
        leaving = Leaving(
            run_id=self.cfg.run_id, worker_id=self.worker_id, incarnation=self.incarnation
        )
        self.outbox.send(leaving)
        taken = self.desk.await_left(self.cfg.buffer.heartbeat_timeout_s)
        if taken is None:
            log.warning("drained, but the buffer never answered: it takes the leases back later")
            return
        self.leases_handed_back = len(taken)
        log.info("drained: %d leases handed back to the buffer", len(taken))

    def _abort(self, lease_ids: list[str], counted: bool = True) -> None:
        """Stop generating for leases the buffer took back (``counted`` in
        ``leases_aborted``; not when this process hands them back itself); their unsent
        tokens are dropped (the buffer would drop them too: the next holder continues from
        what it has)."""
        aborted = self.desk.drop(set(lease_ids))
        for lease_id in lease_ids:
            running = self.pending.pop(lease_id, None) is not None  # else finished meanwhile
            if running:
                self.engine.abort(lease_id)
            if self.episodes is not None and lease_id in self.episodes:
                self.episodes.abort(lease_id)  # between turns it holds no request
                running = True
            aborted += running
        self.leases_aborted += aborted if counted else 0

    # ---- decoding ------------------------------------------------------------------
    def _step(self) -> None:
        status = self.engine.status()
        before, prefilled = status.version, status.prefill_tokens
        updating = self.stats.updating(before)
        start = time.perf_counter()
        out = self.engine.step()
        seconds = time.perf_counter() - start
        # The step overlapped an update if one was on its way in when it began or when it
        # ended (frames decoded meanwhile), or if it flipped new weights in itself.
        during_update = updating or out.version != before or self.stats.updating(out.version)
        # Prompt tokens this step prefilled (engines that count them): the simulator's
        # decode-cost calibration separates prefill from decode with it.
        if prefilled is not None:
            prefilled = self.engine.status().prefill_tokens - prefilled
        self.stats.on_step(seconds, len(out.tokens), during_update, prefilled)
        self.stats.on_output(out, status)
        self._record(out, time.time())
        if self.probe is not None:
            self.probe.after_step(out.version)  # new weights: scored before the next step

    # ---- metrics -------------------------------------------------------------------
    def _end_turn(self, turn_start: float, stepped: bool) -> float:
        """Account one loop turn (idle unless it stepped) and any weights staged or
        flipped during it; returns the next turn's start."""
        status = self.engine.status()
        self.stats.observe_weights(status.version, status.staged_version)
        turn_end = time.perf_counter()
        self.stats.on_loop(turn_end - turn_start, stepped)
        return turn_end

    def _log_window(self) -> None:
        status = self.engine.status()
        # The engine's own gauges too (a remote engine's resends, server restarts, updates).
        self.metrics.log(status.version, self.stats.window(status.version) | status.metrics)

    def _close_metrics(self) -> None:
        self._log_window()
        status = self.engine.status()
        summary = self.stats.summary(status.version)
        self.metrics.write_summary(
            {
                "worker_id": self.worker_id,
                **summary,
                "leases_handed_back": self.leases_handed_back,
                "engine": status.metrics,
            },
            name=f"generator_{self.worker_id}_summary.json",
        )
        self.metrics.close()

    # ---- chunks --------------------------------------------------------------------
    def _record(self, out: StepOutput, now: float) -> None:
        for p, reason in record_tokens(self.pending, out):
            if p.whole_turns:
                self.episodes.turn_finished(p, reason)
            else:
                self.outbox.chunk(p, now, finished=True, reason=reason)

    def _send_now(self, p: PendingLease, finished: bool, reason: str | None) -> None:
        self.outbox.chunk(p, time.time(), finished, reason)

    def _heartbeat(self) -> None:
        # Grants that came during a long step are taken first: the buffer takes back a
        # lease the list leaves out.
        self._take_leases(block_ms=0)
        status = self.engine.status()
        decoders = (self.desk.decoder, self.weights.decoder)
        bad = sum(sum(d.errors.values()) for d in decoders)
        beat = Heartbeat(
            run_id=self.cfg.run_id,
            worker_id=self.worker_id,
            kind="generator",
            version=status.version,
            running=status.running,
            incarnation=self.incarnation,
            leases=self._lease_ids(),
            counters={
                "tokens_sent": float(self.outbox.tokens_sent),
                "bad_frames": float(bad),
                "leases_aborted": float(self.leases_aborted),
                "requests_refused": float(self.requests_refused),
                "weights_anchors_asked": float(self.weights.anchors_asked),
            },
        )
        self.outbox.send(beat)

    def _lease_ids(self) -> list[str]:
        """Every lease this process holds: waiting for weights, generating, or an episode's."""
        ids = {lease.lease_id for lease in self.desk.held} | self.pending.keys()
        if self.episodes is not None:
            ids |= self.episodes.lease_ids()
        return sorted(ids)


def make_engine(cfg: RolloutConfig, model_path: str, worker_id: str) -> Engine:
    """The generator's engine, as ``cfg.engine.backend`` selects. A remote engine's server
    logs go to ``RUN_DIR/logs/generator_ID_serverI.log``, and their URLs to
    ``RUN_DIR/endpoints/servers-ID.json`` (read by the trainer's NCCL publisher)."""
    if getattr(cfg.engine, cfg.engine.backend).max_seq_len == 0:
        # Sized by the launcher's preflight unless the policy did not exist then (a Slurm
        # chain submits every stage at once): size it here the same way. A prompt that
        # does not fit fails its group at run time (see _submit).
        try:
            fit_context(cfg.task, cfg.model.path, cfg.engine, cfg.sampling.max_new_tokens)
        except ConfigError as e:
            log.warning("%s", e)
    if cfg.engine.plan().embedded:
        # Staged while decoding goes on: it must not slow the decode steps beside it.
        return EmbeddedEngine(model_path, cfg.engine.embedded, yield_staging=True)
    engine = RemoteEngine(
        model_path,
        cfg.engine.remote,
        log_dir=Path(cfg.run_dir) / "logs",
        name=f"generator_{worker_id}",
    )
    urls = {str(i): url for i, url in enumerate(engine.urls)}
    write_endpoints(cfg.run_dir, f"servers-{worker_id}", urls)
    return engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one generator process.")
    parser.add_argument("--config", required=True, help="RolloutConfig JSON")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument(
        "--model", default="", help="weights to start from (default: config's model)"
    )
    args = parser.parse_args(argv)
    cfg: RolloutConfig = load_json(args.config)
    try:
        engine = make_engine(cfg, args.model or cfg.model.path, args.worker_id)
        try:
            worker = GeneratorWorker(cfg, args.worker_id, engine)
            signal.signal(signal.SIGTERM, lambda *_: worker.stop())
            signal.signal(signal.SIGINT, lambda *_: worker.stop())
            signal.signal(signal.SIGUSR1, lambda *_: worker.drain())
            worker.run()
        finally:
            engine.close()  # a remote engine stops the servers it launched
    except ServerFailed as e:  # a restart of this process cannot bring the server back
        log.error("generator %s stops the run: %s", args.worker_id, e)
        raise SystemExit(EXIT_FATAL) from e
    if worker.drain_event.is_set():
        raise SystemExit(EXIT_DRAINED)  # it left on purpose: the launcher lets it go


if __name__ == "__main__":
    main()
