"""The buffer's logic, apart from sockets and processes: a deterministic state machine that
the buffer process drives with decoded messages and the current time (and that the
property tests drive with a simulated clock).

``RolloutBuffer`` is three parts over one state (``BufferState``, a msgspec Struct saved
and restored whole):

    leases     LeaseTable      leases, chunk assembly, expiry and revocation, prefixes
    assembler  GroupAssembler  prompt admission, groups, rewards, filters
    batches    BatchServer     the staleness check at consumption, per-step batches per
                               rank, served batches kept for a restarted trainer

Callers use the parts directly (``buffer.leases.lease(...)``); the buffer process feeds
them through its write-ahead ``Journal``. Accounting is exactly-once: every sample slot
ever created ends as consumed, dropped as stale, filtered, or failed, or is still in
flight, and ``check_accounting`` proves the sum.
"""

from __future__ import annotations

import msgspec

from asyncrl.buffer.batches import BatchServer
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.groups import GroupAssembler, PromptSource
from asyncrl.buffer.leases import LeaseTable
from asyncrl.buffer.staleness import StalenessGate
from asyncrl.buffer.state import BufferState
from asyncrl.wire import SamplingSpec

__all__ = ["BufferConfig", "PromptSource", "RolloutBuffer"]


class RolloutBuffer:
    def __init__(
        self, cfg: BufferConfig, run_id: str, prompts: PromptSource, sampling: SamplingSpec
    ) -> None:
        self.cfg, self.run_id, self.prompts, self.sampling = cfg, run_id, prompts, sampling
        self.gate = StalenessGate(cfg.prompts_per_batch, cfg.max_staleness)
        self._attach(BufferState())

    def _attach(self, state: BufferState) -> None:
        """Build the three parts over ``state``."""
        self.state = state
        self.assembler = GroupAssembler(self.cfg, self.run_id, self.prompts, self.gate, state)
        self.leases = LeaseTable(self.cfg, self.run_id, self.sampling, state, self.assembler)
        self.batches = BatchServer(self.cfg, self.gate, state, self.assembler)

    def save(self) -> bytes:
        """The whole state as msgpack; ``restore`` takes it back."""
        return msgspec.msgpack.encode(self.state)

    def restore(self, data: bytes, now: float) -> None:
        """Resume from ``save()``. Leases stay with their holders: a generator that is still
        alive keeps streaming into them; one that is not misses heartbeats and loses them.
        Samples that were waiting for a reward are queued for scoring again."""
        self._attach(msgspec.msgpack.decode(data, type=BufferState))
        self.assembler.rescore()
        self.leases.alive_since(now)

    def in_flight(self) -> int:
        """Samples created and not yet ended (consumed, stale, filtered or failed)."""
        return sum(len(g.slots) for g in self.state.groups.values())

    def in_flight_tokens(self) -> int:
        return sum(len(s.token_ids) for g in self.state.groups.values() for s in g.slots)

    def check_accounting(self) -> None:
        """Raise unless every sample slot created has ended or is in flight."""
        c = self.state.counts
        outcomes = ("samples_consumed", "samples_stale", "samples_filtered", "samples_failed")
        ended = sum(c[k] for k in outcomes)
        if c["samples_created"] != ended + self.in_flight():
            raise AssertionError(
                f"accounting broken: created {c['samples_created']} != ended {ended} "
                f"+ in flight {self.in_flight()} ({dict(c)})"
            )
