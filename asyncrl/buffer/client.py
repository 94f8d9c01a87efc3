"""The trainer side of the buffer: request a rank's share of a step's batch, announce
published versions and kept checkpoints. One client per trainer rank (a DEALER socket);
it is the ``asyncrl.interfaces.BatchSource`` of the asynchronous placement."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from asyncrl.transport import TransportConfig, client_socket, read_endpoints
from asyncrl.wire import (
    Batch,
    BatchRequest,
    CheckpointAnnounce,
    VersionAnnounce,
    WireDecoder,
    encode,
)

log = logging.getLogger(__name__)

WAIT_LOG_S = 60.0
"""A trainer rank waiting this long for a batch says so, and again as often."""


class BufferClient:
    """A ``BatchSource`` over ZeroMQ: the buffer process on the other end."""

    def __init__(self, run_dir: str, run_id: str, rank: int, transport: TransportConfig) -> None:
        self.run_id, self.rank = run_id, rank
        endpoints = read_endpoints(run_dir, "buffer")
        if endpoints is None:
            raise TimeoutError(f"the buffer never published its endpoints in {run_dir}")
        self.ctx = zmq.Context()
        self.sock = client_socket(
            self.ctx, zmq.DEALER, transport, run_dir, identity=f"trainer-{rank}"
        )
        self.sock.connect(endpoints["trainer"])
        self.decoder = WireDecoder(run_id, expected=Batch)

    def request_batch(
        self,
        step: int,
        world_size: int,
        timeout_s: float = 600.0,
        on_wait: Callable[[], None] | None = None,
        wait_tick_s: float = 10.0,
        deadline: float | None = None,
    ) -> Batch | None:
        """Block until the buffer hands over this rank's share of ``step``'s batch; None
        once ``deadline`` (Unix time) passes first.

        ``on_wait`` runs every ``wait_tick_s`` without a batch: rank 0 republishes its
        weights there, since a generator that (re)joined after the last publish would
        otherwise decode forever with weights too stale for the buffer to accept. A wait
        is logged every ``WAIT_LOG_S``: a step that never comes is said, not silent.
        """
        if deadline is not None and time.time() >= deadline:
            return None  # not asked: a batch served now would be consumed and never trained
        request = encode(
            BatchRequest(run_id=self.run_id, step=step, rank=self.rank, world_size=world_size)
        )
        self.sock.send(request)
        start = time.monotonic()
        give_up, logged = start + timeout_s, start
        while True:
            now = time.monotonic()
            if now >= give_up:
                raise TimeoutError(f"no batch for step {step} after {timeout_s:.0f} s")
            # Past the deadline, a batch already served is still read (trained, not left
            # consumed); with none waiting, the trainer stops.
            if deadline is not None and time.time() >= deadline and not self.sock.poll(0):
                log.warning(
                    "step %d: the time limit passed waiting %.0f s for its batch", step, now - start
                )
                return None
            if now - logged >= WAIT_LOG_S:
                log.warning(
                    "step %d: no batch after %.0f s (the generators' logs say why)",
                    step,
                    now - start,
                )
                logged = now
            tick = min(give_up - now, wait_tick_s)
            if deadline is not None:
                tick = min(tick, max(deadline - time.time(), 0.01))
            if not self.sock.poll(int(tick * 1000)):
                if on_wait is not None:
                    on_wait()
                # Ask again: a buffer that died and restarted never saw the request. Asking
                # twice is safe, the buffer serves a step's share the same every time.
                self.sock.send(request)
                continue
            batch = self.decoder.try_decode(self.sock.recv(copy=False).buffer, "trainer socket")
            if isinstance(batch, Batch) and batch.step == step:
                return batch

    def announce_version(self, version: int, resumed: bool = False) -> None:
        """The newest published version, or (``resumed``) the version this trainer starts
        at, from its checkpoint or from scratch."""
        self.sock.send(
            encode(VersionAnnounce(run_id=self.run_id, version=version, resumed=resumed))
        )

    def announce_checkpoint(self, oldest_kept_step: int) -> None:
        """Batches of steps before the oldest checkpoint kept will never be asked again."""
        self.sock.send(encode(CheckpointAnnounce(run_id=self.run_id, step=oldest_kept_step)))

    def close(self) -> None:
        """Close the socket, dropping anything unsent."""
        self.ctx.destroy(linger=0)
