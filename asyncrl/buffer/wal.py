"""The buffer's write-ahead log: every input that changes ``RolloutBuffer``'s state, as a
msgpack record appended to a file before its effect leaves the process.

``RolloutBuffer`` is deterministic in its inputs (the prompt stream is a function of the
position, lease ids and group ids are counters, times come in as arguments), so its
state is its last saved state plus the inputs since, replayed in order: the buffer
process restarts from ``buffer_state.msgpack`` and the log segment it names, and
nothing it had accepted is lost. What depends on the clock or on heartbeats is logged as
its outcome (the leases ``expire`` chose), not as its cause. Inputs that change nothing
(a lease request answered with no lease, a batch request for a step not complete yet
that dropped no stale group) are not logged.

Records are framed as ``[u32 length][u32 crc32][msgpack]``; a torn tail (the process died
mid-write) ends the replay there. ``Journal`` is the one way the buffer process (and the
property tests) feed the buffer, so the live path and the replay cannot drift apart.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec

from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.leases import DRAINED
from asyncrl.wire import Chunk, Lease, Sample


class Event(msgspec.Struct, tag=True, array_like=True):
    pass


class Leased(Event):
    worker_id: str
    capacity: int
    now: float


class Chunked(Event):
    chunk: Chunk
    now: float


class Rewarded(Event):
    key: tuple[int, int]
    reward: float


class Batched(Event):
    step: int
    rank: int
    world_size: int


class Versioned(Event):
    version: int
    resumed: bool


class Checkpointed(Event):
    step: int


class Revoked(Event):
    lease_ids: list[str]
    reasons: list[str] = []
    """Why each was taken back (``LeaseTable.expire``); may be empty (re-issued, no reason)."""


AnyEvent = Leased | Chunked | Rewarded | Batched | Versioned | Checkpointed | Revoked
_HEADER = struct.Struct("<II")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


def frame(event: Event) -> bytes:
    body = _encoder.encode(event)
    return _HEADER.pack(len(body), zlib.crc32(body)) + body


def read_events(data: bytes) -> Iterator[AnyEvent]:
    """The events of a log segment, up to its end or the first torn or corrupt record."""
    at = 0
    while at + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, at)
        body = data[at + _HEADER.size : at + _HEADER.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            return
        yield _decoder.decode(body)
        at += _HEADER.size + length


class WriteAheadLog:
    """Append-only segments ``DIR/NNNNNNNN.wal``. ``append`` buffers in memory; ``flush``
    writes with one ``os.write`` (it survives the process dying; ``fsync`` also survives
    the machine dying, at a cost per flush)."""

    def __init__(self, directory: str | Path, segment: int, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync, self.segment = fsync, segment
        self._fd = os.open(self.path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._pending: list[bytes] = []
        self.records = 0

    def path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}.wal"

    def append(self, event: Event) -> None:
        self._pending.append(frame(event))

    def flush(self) -> None:
        if not self._pending:
            return
        os.write(self._fd, b"".join(self._pending))
        if self.fsync:
            os.fsync(self._fd)
        self.records += len(self._pending)
        self._pending.clear()

    def roll(self) -> int:
        """Start the next segment (call ``drop_before`` once a state naming it is saved)."""
        self.flush()
        os.close(self._fd)
        self.segment += 1
        self._fd = os.open(self.path(self.segment), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        return self.segment

    def drop_before(self, segment: int) -> None:
        for old in self.directory.glob("*.wal"):
            if old.stem.isdigit() and int(old.stem) < segment:
                old.unlink(missing_ok=True)

    def close(self) -> None:
        self.flush()
        os.close(self._fd)


class Journal:
    """The buffer's inputs, applied and logged (``log=None``: applied only, e.g. during a
    replay). One method per input, each applied to the buffer part it concerns."""

    def __init__(self, buffer: RolloutBuffer, log: WriteAheadLog | None = None) -> None:
        self.buffer, self.log = buffer, log

    def _record(self, event: Event) -> None:
        if self.log is not None:
            self.log.append(event)

    def lease(self, worker_id: str, capacity: int, now: float) -> list[Lease]:
        leases = self.buffer.leases.lease(worker_id, capacity, now)
        if leases:
            self._record(Leased(worker_id, capacity, now))
        return leases

    def chunk(self, chunk: Chunk, now: float) -> None:
        self.buffer.leases.on_chunk(chunk, now)
        self._record(Chunked(chunk, now))

    def reward(self, key: tuple[int, int], reward: float) -> None:
        self.buffer.assembler.on_reward(key, reward)
        self._record(Rewarded(tuple(key), reward))

    def batch(self, step: int, rank: int, world_size: int) -> list[Sample] | None:
        counts = self.buffer.state.counts
        stale_before = counts["groups_stale"]
        samples = self.buffer.batches.batch_for(step, rank, world_size)
        if samples is not None or counts["groups_stale"] != stale_before:
            self._record(Batched(step, rank, world_size))
        return samples

    def version(self, version: int, resumed: bool = False) -> None:
        if resumed:
            self.buffer.batches.resume_at(version)
        else:
            self.buffer.batches.set_version(version)
        self._record(Versioned(version, resumed))

    def checkpointed(self, step: int) -> None:
        self.buffer.batches.checkpointed(step)
        self._record(Checkpointed(step))

    def expire(self, now: float) -> dict[str, list[str]]:
        """Take back the leases due now; returns those whose holder is alive, by holder,
        for the buffer process to tell (a replay tells nobody: it calls ``revoke``)."""
        expired = self.buffer.leases.expire(now)
        if not expired:
            return {}
        lease_ids, reasons = list(expired), list(expired.values())
        self._record(Revoked(lease_ids, reasons))
        return self.buffer.leases.revoke(lease_ids, reasons)

    def leave(self, worker_id: str) -> list[str]:
        """A generator left, drained: take back every lease it holds (logged as their
        revocation, so a replay needs no record of who left); returns their ids."""
        lease_ids = self.buffer.leases.on_leaving(worker_id)
        if lease_ids:
            reasons = [DRAINED] * len(lease_ids)
            self._record(Revoked(lease_ids, reasons))
            self.buffer.leases.revoke(lease_ids, reasons)
        return lease_ids

    def apply(self, event: AnyEvent) -> None:
        """Replay one logged event."""
        match event:
            case Leased(worker_id, capacity, now):
                self.lease(worker_id, capacity, now)
            case Chunked(chunk, now):
                self.chunk(chunk, now)
            case Rewarded(key, reward):
                self.reward(key, reward)
            case Batched(step, rank, world_size):
                self.batch(step, rank, world_size)
            case Versioned(version, resumed):
                self.version(version, resumed)
            case Checkpointed(step):
                self.checkpointed(step)
            case Revoked(lease_ids, reasons):
                self.buffer.leases.revoke(lease_ids, reasons)


def replay(buffer: RolloutBuffer, data: bytes) -> int:
    """Apply the events of a log segment to ``buffer``; returns how many there were."""
    journal, count = Journal(buffer), 0
    for event in read_events(data):
        journal.apply(event)
        count += 1
    return count
