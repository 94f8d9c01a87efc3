"""The buffer process: ``RolloutBuffer`` behind ZeroMQ sockets (docs/architecture.md,
Processes and their sockets; Messages).

Sockets it binds (endpoints published in ``RUN_DIR/endpoints/buffer.json``):

    chunks   PULL    Chunk, Heartbeat and Leaving messages from generators
    leases   ROUTER  LeaseRequest from generators, answered with LeaseGrant once it has one;
                     LeaseRevoked to a live generator whose leases were taken back, to
                     one that streams into a lease the buffer no longer has, and to one
                     that left (what it held)
    trainer  ROUTER  BatchRequest from trainer ranks (answered with Batch once the step's
                     batch is complete; the same share again if asked again), VersionAnnounce
                     and CheckpointAnnounce

Every frame is decoded by a ``WireDecoder``; a bad frame, or a good message on the wrong
socket, is counted by kind and dropped. Each loop turn also pumps ``Scoring``
(``asyncrl.buffer.scoring``: finished samples out, rewards back in). On exit (SIGTERM or
``stop``) the counters go to ``RUN_DIR/buffer_counters.json``. This module does sockets
and persistence only; the buffer's logic is in ``asyncrl.buffer.core`` and its parts.

Nothing accepted is lost when the process dies, even by SIGKILL: every input goes
through a ``Journal`` that appends it to a write-ahead log (``RUN_DIR/buffer_wal/``,
``asyncrl.buffer.wal``) before any reply shows its effect; the state is saved to
``RUN_DIR/buffer_state.msgpack`` every ``checkpoint_s`` and at exit, starting a fresh log
segment. Started again on the same run directory (the launcher restarts it), the process
restores the saved state, replays the log, and generators and trainer ranks carry on:
they re-send requests that went unanswered, and leases stuck behind a chunk lost in the
crash are re-issued from the tokens assembled before it.

    python -m asyncrl.buffer.server --config RUN_DIR/rollout.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring, Scoring, buffer_counters
from asyncrl.buffer.state import SavedState
from asyncrl.buffer.wal import Journal, WriteAheadLog, replay
from asyncrl.config import load_json
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.security import refused_peers
from asyncrl.transport import (
    bind,
    close_context,
    read_endpoints,
    server_socket,
    write_endpoints,
)
from asyncrl.wire import (
    Batch,
    BatchRequest,
    CheckpointAnnounce,
    Chunk,
    Heartbeat,
    LeaseGrant,
    LeaseRequest,
    LeaseRevoked,
    Leaving,
    VersionAnnounce,
    WireDecoder,
    encode,
)

DRAIN = 1000  # messages handled per socket per loop turn, so no socket starves the others


class BufferServer:
    def __init__(
        self, cfg: RolloutConfig, buffer: RolloutBuffer, scoring: Scoring | InlineScoring
    ) -> None:
        self.cfg, self.buffer, self.scoring = cfg, buffer, scoring
        self.ctx = zmq.Context()
        t = cfg.transport
        self.chunks = server_socket(self.ctx, zmq.PULL, t, cfg.run_dir)
        self.leases = server_socket(self.ctx, zmq.ROUTER, t, cfg.run_dir)
        self.trainer = server_socket(self.ctx, zmq.ROUTER, t, cfg.run_dir)
        for router in (self.leases, self.trainer):
            # A restarted generator or trainer rank comes back with the same identity: it
            # takes the route over even if the dead one's connection is not closed yet.
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A restarted buffer binds where the dead one was: peers reconnect by themselves.
        before = read_endpoints(cfg.run_dir, "buffer", timeout_s=0) or {}
        self.endpoints = {
            name: bind(sock, t, cfg.run_dir, f"buffer-{name}", before.get(name, ""))
            for name, sock in (
                ("chunks", self.chunks),
                ("leases", self.leases),
                ("trainer", self.trainer),
            )
        }
        self.decoder = WireDecoder(cfg.run_id)
        self.lease_waiting: dict[bytes, LeaseRequest] = {}
        self.batch_waiting: dict[bytes, BatchRequest] = {}
        self.to_tell: dict[str, set[str]] = {}
        """Generator → leases it holds that the buffer took back, to send in LeaseRevoked."""
        self.departed: dict[str, str] = {}
        """Generator → the process (incarnation) that left the run: its requests get nothing."""
        self.stop_event = threading.Event()
        self.journal = Journal(buffer)  # every input to the buffer goes through it
        self.wal: WriteAheadLog | None = None  # set up by recover()
        self.socket_counts: Counter[str] = Counter()
        self.metrics = MetricsLogger(cfg.run_dir, "buffer", MetricsConfig(progress_bar=False))

    @property
    def state_path(self) -> Path:
        return Path(self.cfg.run_dir) / "buffer_state.msgpack"

    def save_state(self) -> None:
        """Save the state, naming a fresh log segment that starts at it; then drop the old
        segments (unless ``keep_wal``). A crash anywhere in between leaves a saved state
        whose segment is whole."""
        segment = self.wal.roll() if self.wal is not None else 0
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(SavedState(segment, self.buffer.save())))
        os.replace(tmp, self.state_path)
        if self.wal is not None and not self.cfg.buffer.keep_wal:
            self.wal.drop_before(segment)

    def recover(self, now: float) -> int:
        """Restore the saved state and replay the log after it; returns the events replayed."""
        segment, replayed = 0, 0
        if self.state_path.exists():
            saved = msgspec.msgpack.decode(self.state_path.read_bytes(), type=SavedState)
            self.buffer.restore(saved.state, now)
            segment = saved.wal_segment
        wal_dir = Path(self.cfg.run_dir) / "buffer_wal"
        log_file = wal_dir / f"{segment:08d}.wal"
        if log_file.exists():
            replayed = replay(self.buffer, log_file.read_bytes())
            self.buffer.assembler.rescore()
            self.buffer.leases.alive_since(now)
        if self.cfg.buffer.checkpoint_s:
            self.wal = WriteAheadLog(wal_dir, segment, self.cfg.buffer.wal_fsync)
            self.journal.log = self.wal
            self.save_state()  # the replayed state becomes the base of a fresh segment
        if replayed or segment:
            print(
                f"[buffer] restored: {replayed} logged events replayed, version "
                f"{self.buffer.state.version}, {self.buffer.in_flight()} samples in flight",
                flush=True,
            )
        return replayed

    def serve(self) -> None:
        self.recover(time.time())
        write_endpoints(self.cfg.run_dir, "buffer", self.endpoints)
        poller = zmq.Poller()
        for sock in (self.chunks, self.leases, self.trainer):
            poller.register(sock, zmq.POLLIN)
        last_expire = last_metrics = last_save = time.time()
        try:
            while not self.stop_event.is_set():
                ready = dict(poller.poll(timeout=20))
                now = time.time()
                if self.chunks in ready:
                    self._drain(self.chunks, self._on_chunk_socket, now)
                if self.leases in ready:
                    self._drain(self.leases, self._on_lease_socket, now)
                if self.trainer in ready:
                    self._drain(self.trainer, self._on_trainer_socket, now)
                self.scoring.pump(self.buffer, self.journal.reward)
                if now - last_expire > 0.25:
                    self._tell(self.journal.expire(now))
                    last_expire = now
                self._send_revocations()
                self._answer_waiting(now)
                if self.wal is not None:
                    self.wal.flush()
                if self.cfg.buffer.checkpoint_s and now - last_save > self.cfg.buffer.checkpoint_s:
                    self.save_state()
                    last_save = now
                if now - last_metrics > 5.0:
                    self._log_metrics()
                    last_metrics = now
        finally:
            if self.wal is not None:
                self.save_state()
                self.wal.close()
            self._log_metrics()
            self._write_counters()
            self.metrics.close()
            self.scoring.close()
            close_context(self.ctx)

    def stop(self) -> None:
        self.stop_event.set()

    # ---- sockets -------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket, handle, now: float) -> None:
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames, now)

    def _receive(self, frames, where: str, routed: bool):
        """Decode one message from ``frames`` (``[identity, body]`` on a ROUTER socket,
        ``[body]`` otherwise); bad frames are counted and give None."""
        if len(frames) != (2 if routed else 1):
            self.decoder.count("frames", f"{where}: {len(frames)} frames")
            return None
        return self.decoder.try_decode(frames[-1].buffer, where)

    def _unexpected(self, msg, where: str) -> None:
        if msg is not None:
            self.decoder.count("unexpected", f"{type(msg).__name__} on the {where}")

    def _on_chunk_socket(self, frames, now: float) -> None:
        msg = self._receive(frames, "chunks socket", routed=False)
        if isinstance(msg, Chunk):
            if msg.lease_id not in self.buffer.leases.active:
                # Its holder missed the LeaseRevoked (it was presumed dead, the message was
                # lost, or the lease ended with its failed group): tell it (again).
                self._tell({msg.worker_id: [msg.lease_id]})
            self.journal.chunk(msg, now)
        elif isinstance(msg, Heartbeat):
            self.buffer.leases.on_incarnation(msg.worker_id, msg.incarnation)
            self.buffer.leases.on_heartbeat(msg.worker_id, now, msg.version, msg.leases)
        elif isinstance(msg, Leaving):
            self._on_leaving(msg)
        else:
            self._unexpected(msg, "chunks socket")

    def _on_leaving(self, msg: Leaving) -> None:
        """A drained generator leaves: its leases go back at once (its chunks came first on
        this socket), a request of its still waiting is dropped, and it is told what was
        taken back (an empty list too: the answer it waits for before it exits)."""
        self.departed[msg.worker_id] = msg.incarnation
        taken = self.journal.leave(msg.worker_id)
        for identity, req in list(self.lease_waiting.items()):
            if req.worker_id == msg.worker_id:
                del self.lease_waiting[identity]
        if self.wal is not None:
            self.wal.flush()  # logged first: a restart never hands back what it answered for
        answer = LeaseRevoked(
            run_id=self.cfg.run_id, worker_id=msg.worker_id, lease_ids=sorted(taken), left=True
        )
        self.leases.send_multipart([msg.worker_id.encode(), encode(answer)])
        print(
            f"[buffer] {msg.worker_id} left the run, drained: {len(taken)} leases back", flush=True
        )

    def _on_lease_socket(self, frames, now: float) -> None:
        msg = self._receive(frames, "leases socket", routed=True)
        if isinstance(msg, LeaseRequest):
            if self.departed.get(msg.worker_id) == msg.incarnation:
                return  # sent before it left; the process is gone
            self.buffer.leases.on_incarnation(msg.worker_id, msg.incarnation)
            self.lease_waiting[frames[0].bytes] = msg
        else:
            self._unexpected(msg, "leases socket")

    def _on_trainer_socket(self, frames, now: float) -> None:
        msg = self._receive(frames, "trainer socket", routed=True)
        if isinstance(msg, BatchRequest) and 0 <= msg.rank < msg.world_size:
            self.batch_waiting[frames[0].bytes] = msg
        elif isinstance(msg, VersionAnnounce):
            self.journal.version(msg.version, msg.resumed)
        elif isinstance(msg, CheckpointAnnounce):
            self.journal.checkpointed(msg.step)
        else:
            self._unexpected(msg, "trainer socket")

    def _tell(self, revoked: dict[str, list[str]]) -> None:
        for worker_id, lease_ids in revoked.items():
            self.to_tell.setdefault(worker_id, set()).update(lease_ids)

    def _send_revocations(self) -> None:
        """Tell each generator in ``to_tell`` to abort those leases, on the leases socket
        (its DEALER's identity is its worker id; a generator not connected is skipped)."""
        if not self.to_tell:
            return
        if self.wal is not None:
            self.wal.flush()  # logged first: a restart never hands back a lease its holder dropped
        for worker_id, lease_ids in self.to_tell.items():
            msg = LeaseRevoked(
                run_id=self.cfg.run_id, worker_id=worker_id, lease_ids=sorted(lease_ids)
            )
            self.leases.send_multipart([worker_id.encode(), encode(msg)])
        self.to_tell.clear()

    def _answer_waiting(self, now: float) -> None:
        # What is answered is logged first: a reply never shows state a restart would lose.
        for identity, req in list(self.lease_waiting.items()):
            leases = self.journal.lease(req.worker_id, req.capacity, now)
            if leases:
                if self.wal is not None:
                    self.wal.flush()
                self.leases.send_multipart(
                    [identity, encode(LeaseGrant(run_id=self.cfg.run_id, leases=leases))]
                )
                del self.lease_waiting[identity]
        for identity, req in list(self.batch_waiting.items()):
            samples = self.journal.batch(req.step, req.rank, req.world_size)
            if samples is not None:
                if self.wal is not None:
                    self.wal.flush()
                batch = Batch(run_id=self.cfg.run_id, step=req.step, rank=req.rank, samples=samples)
                self.trainer.send_multipart([identity, encode(batch)])
                del self.batch_waiting[identity]

    # ---- metrics -------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        out = buffer_counters(self.buffer, self.scoring)
        out.update({f"buffer/bad_frames_{k}": float(v) for k, v in self.decoder.errors.items()})
        out["buffer/refused_peers"] = float(refused_peers(self.ctx))  # CURVE: unknown keys
        return out

    def _log_metrics(self) -> None:
        self.metrics.log(int(self.buffer.state.version), self.counters())

    def _write_counters(self) -> None:
        path = Path(self.cfg.run_dir) / "buffer_counters.json"
        path.write_text(json.dumps(self.counters(), indent=2, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the buffer process.")
    parser.add_argument("--config", required=True, help="RolloutConfig JSON")
    args = parser.parse_args(argv)
    cfg: RolloutConfig = load_json(args.config)
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, cfg.prompt_source(), cfg.sampling.spec(cfg.seed))
    server = BufferServer(cfg, buffer, Scoring(cfg))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve()


if __name__ == "__main__":
    main()
