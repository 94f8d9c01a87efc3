"""A generator's two sockets to the buffer (docs/architecture.md, Leases).

``LeaseDesk`` holds the leases conversation on a DEALER socket: it asks for as many leases
as the engine has room for, keeps the grants whose weights have not arrived yet, hands the
buffer's revocations on, and after ``Leaving`` waits for the buffer's answer. ``Outbox``
streams on a PUSH socket: each lease's new tokens as ``Chunk`` messages in order, and the
process's heartbeats and its ``Leaving``. One socket keeps its messages in order, which
the drain relies on: every chunk a leaving generator sent is in before its ``Leaving``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.engine.leases import PendingLease
from asyncrl.wire import (
    Chunk,
    Lease,
    LeaseGrant,
    LeaseRequest,
    LeaseRevoked,
    Message,
    WireDecoder,
    encode,
)


class LeaseDesk:
    """The leases socket: requests out; grants, revocations and the leaving answer in."""

    def __init__(
        self, cfg: RolloutConfig, worker_id: str, incarnation: str, dealer: zmq.Socket
    ) -> None:
        self.cfg, self.worker_id, self.incarnation, self.dealer = (
            cfg,
            worker_id,
            incarnation,
            dealer,
        )
        self.decoder = WireDecoder(cfg.run_id)
        self.held: list[Lease] = []  # granted, waiting for weights of their min_version
        self.asked = 0.0  # when the unanswered LeaseRequest went out (0: none is out)

    def ask(self, free: int) -> None:
        """Ask for ``free`` more leases, unless a request is out and not yet overdue."""
        # Asked again after a while without an answer: a buffer that died and restarted
        # never saw the request (a repeat only replaces the first one there).
        again = self.asked and time.monotonic() - self.asked > 5 * self.cfg.transport.heartbeat_s
        if free > 0 and (not self.asked or again):
            req = LeaseRequest(
                run_id=self.cfg.run_id,
                worker_id=self.worker_id,
                capacity=free,
                incarnation=self.incarnation,
            )
            self.dealer.send(encode(req))
            self.asked = time.monotonic()

    def receive(self, block_ms: int) -> list[str]:
        """Take what the buffer sent, waiting up to ``block_ms`` for the first message:
        grants join ``held``; returns the ids of the leases it took back."""
        revoked: list[str] = []
        while self.dealer.poll(block_ms):
            block_ms = 0
            msg = self.decoder.try_decode(self.dealer.recv(copy=False).buffer, "leases socket")
            if isinstance(msg, LeaseRevoked):
                revoked.extend(msg.lease_ids)
                continue
            self.asked = 0.0  # answered (a bad frame too: it was likely the grant)
            if isinstance(msg, LeaseGrant):
                self.held.extend(msg.leases)
            elif msg is not None:
                self.decoder.count("unexpected", f"{type(msg).__name__} on the leases socket")
        return revoked

    def ready(self, version: int) -> list[Lease]:
        """The held leases that weights ``version`` may start (``min_version`` met), taken
        out of ``held``; the others stay."""
        ready = [lease for lease in self.held if lease.min_version <= version]
        self.held = [lease for lease in self.held if lease.min_version > version]
        return ready

    def drop(self, lease_ids: set[str]) -> int:
        """Forget the held leases among ``lease_ids``; returns how many were held."""
        before = len(self.held)
        self.held = [lease for lease in self.held if lease.lease_id not in lease_ids]
        return before - len(self.held)

    def await_left(self, timeout_s: float) -> list[str] | None:
        """After ``Leaving``: the leases the buffer's answer (``LeaseRevoked`` with
        ``left``) took back, or None if it did not come within ``timeout_s``. An earlier
        revocation is no answer."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.dealer.poll(50):
                continue
            msg = self.decoder.try_decode(self.dealer.recv(copy=False).buffer, "leases socket")
            if isinstance(msg, LeaseRevoked) and msg.left:
                return msg.lease_ids
        return None


class Outbox:
    """The chunks socket: every lease's tokens in order, heartbeats, ``Leaving``."""

    def __init__(self, cfg: RolloutConfig, worker_id: str, push: zmq.Socket) -> None:
        self.cfg, self.worker_id, self.push = cfg, worker_id, push
        self.tokens_sent = 0

    def send(self, message: Message) -> None:
        self.push.send(encode(message))

    def flush(self, pending: Iterable[PendingLease], now: float, force: bool) -> None:
        """Send the new tokens of each lease that has ``chunk_tokens`` of them or waited
        ``chunk_ms`` (all of them if ``force``). An episode's lease sends whole turns
        itself (``asyncrl.episodes.driver``)."""
        t = self.cfg.transport
        for p in pending:
            due = len(p.token_ids) >= t.chunk_tokens or (now - p.last_flush) * 1000 >= t.chunk_ms
            if p.token_ids and (due or force) and not p.whole_turns:
                self.chunk(p, now, finished=False, reason=None)

    def chunk(self, p: PendingLease, now: float, finished: bool, reason: str | None) -> None:
        """Send ``p``'s tokens since its last chunk as its next ``Chunk``."""
        chunk = Chunk(
            run_id=self.cfg.run_id,
            worker_id=self.worker_id,
            lease_id=p.lease.lease_id,
            seq=p.seq,
            token_ids=p.token_ids,
            logprobs=p.logprobs,
            versions=p.versions,
            finished=finished,
            finish_reason=reason,
            loss_mask=p.loss_mask,
            reward=p.reward if finished else None,
            episode=p.episode if finished else None,
            frames=bytes(p.frames),
        )
        self.send(chunk)
        self.tokens_sent += len(p.token_ids)
        p.seq, p.last_flush = p.seq + 1, now
        p.token_ids, p.logprobs, p.versions, p.loss_mask = [], [], [], []
        p.frames = bytearray()
