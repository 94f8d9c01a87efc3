"""The lease table: the buffer's part that hands samples to generators and assembles what
they stream back.

A lease gives one sample of a group to one generator, with a deadline. The generator
streams the sample's tokens as ``Chunk``s with sequence numbers; chunks are assembled in
order (a duplicate is counted and dropped, one that arrives early waits for the ones
before it). A lease is taken back (``expire`` picks, ``revoke`` takes) when it is past
its deadline, its holder has been silent longer than the heartbeat timeout, or a chunk
before the ones waiting never came; the sample then goes first in line to be leased
again, with the tokens already assembled as the next holder's prefix. The last chunk
hands the sample to the ``GroupAssembler``.
"""

from __future__ import annotations

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.groups import GroupAssembler
from asyncrl.buffer.state import BufferState, Slot
from asyncrl.wire import Chunk, Lease, SamplingSpec


class LeaseTable:
    def __init__(
        self,
        cfg: BufferConfig,
        run_id: str,
        sampling: SamplingSpec,
        state: BufferState,
        groups: GroupAssembler,
    ) -> None:
        self.cfg, self.run_id, self.sampling, self.state, self.groups = (
            cfg,
            run_id,
            sampling,
            state,
            groups,
        )
        self.active: dict[str, tuple[int, int]] = {
            s.lease_id: (g.group_id, s.index)
            for g in state.groups.values()
            for s in g.slots
            if s.lease_id
        }
        """Lease id → (group id, slot index) of every lease out now."""
        # On the chunk path, per chunk: the state's containers, looked up once (a restore
        # builds new parts over the new state, so these never go out of date).
        self._groups, self._counts = state.groups, state.counts
        self.last_seen: dict[str, float] = {}
        """When each generator was last heard from (a lease, a chunk or a heartbeat)."""
        self.worker_versions: dict[str, int] = {}
        """The weights version each generator last reported."""

    def lease(self, worker_id: str, capacity: int, now: float) -> list[Lease]:
        """Up to ``capacity`` leases for ``worker_id``: samples waiting first, then samples
        of newly admitted prompts, as the staleness gate allows."""
        self.last_seen[worker_id] = now
        out, st = [], self.state
        while len(out) < capacity:
            if not st.to_lease and not self.groups.admit():
                break
            group_id, index = st.to_lease.pop(0)
            if group_id in st.groups:  # its group may have failed meanwhile
                out.append(self._issue(group_id, index, worker_id, now))
        return out

    def on_chunk(self, chunk: Chunk, now: float) -> None:
        """Assemble a chunk into its sample, in sequence order."""
        self.last_seen[chunk.worker_id] = now
        where = self.active.get(chunk.lease_id)
        counts = self._counts
        if where is None:
            counts["chunks_unknown_lease"] += 1  # revoked or already finished
            return
        if not (len(chunk.token_ids) == len(chunk.logprobs) == len(chunk.versions)):
            counts["chunks_malformed"] += 1
            return
        slot = self._groups[where[0]].slots[where[1]]
        if chunk.seq < slot.next_seq or chunk.seq in slot.pending:
            counts["chunks_duplicate"] += 1
            return
        slot.pending[chunk.seq] = chunk
        if slot.next_seq not in slot.pending and slot.gap_since is None:
            slot.gap_since = now  # a chunk before this one is missing (late, or lost)
        while slot.next_seq in slot.pending:
            c = slot.pending.pop(slot.next_seq)
            slot.next_seq += 1
            slot.token_ids.extend(c.token_ids)  # in place: no attribute set on the Struct
            slot.logprobs.extend(c.logprobs)
            slot.versions.extend(c.versions)
            counts["tokens_received"] += len(c.token_ids)
            if c.finished:
                self._finish(where[0], slot, c.finish_reason)
                return
        if not slot.pending:
            slot.gap_since = None

    def on_heartbeat(self, worker_id: str, now: float, version: int | None = None) -> None:
        self.last_seen[worker_id] = now
        if version is not None:
            self.worker_versions[worker_id] = version

    def expire(self, now: float) -> list[str]:
        """The leases to take back now: past their deadline, held by a silent generator, or
        stuck behind a lost chunk. ``revoke`` takes them (the buffer process logs the list
        between the two, so a replay needs no clock or heartbeats)."""
        expired = []
        for lease_id, (group_id, index) in self.active.items():
            slot = self.state.groups[group_id].slots[index]
            silent = now - self.last_seen.get(slot.worker_id, now) > self.cfg.heartbeat_timeout_s
            gap = slot.gap_since is not None and now - slot.gap_since > self.cfg.gap_timeout_s
            if now > slot.deadline or silent or gap:
                expired.append(lease_id)
        return expired

    def revoke(self, lease_ids: list[str]) -> None:
        """Take these leases back; each sample goes first in line to be leased again, with
        the tokens already assembled as the next holder's prefix."""
        for lease_id in lease_ids:
            where = self.active.pop(lease_id, None)
            if where is None:
                continue
            group_id, index = where
            slot = self.state.groups[group_id].slots[index]
            slot.lease_id, slot.worker_id, slot.pending, slot.gap_since = None, None, {}, None
            self.state.to_lease.insert(0, (group_id, index))  # first in line; keeps its tokens
            self.state.counts["leases_reissued"] += 1

    def alive_since(self, now: float) -> None:
        """Give every lease holder a full heartbeat timeout from ``now`` to show it is alive
        (after a restart)."""
        groups = self.state.groups
        self.last_seen = {groups[g].slots[i].worker_id: now for g, i in self.active.values()}

    def _issue(self, group_id: int, index: int, worker_id: str, now: float) -> Lease:
        st = self.state
        group = st.groups[group_id]
        slot = group.slots[index]
        slot.lease_id = f"{self.run_id}:{st.next_lease}"
        st.next_lease += 1
        slot.worker_id, slot.deadline, slot.next_seq = worker_id, now + self.cfg.lease_timeout_s, 0
        self.active[slot.lease_id] = (group_id, index)
        st.counts["leases_issued"] += 1
        return Lease(
            run_id=self.run_id,
            lease_id=slot.lease_id,
            prompt_id=group.prompt_id,
            group_id=group_id,
            sample_index=index,
            prompt_ids=group.prompt_ids,
            sampling=self.sampling,
            deadline=slot.deadline,
            prefix_ids=list(slot.token_ids),
            prefix_logprobs=list(slot.logprobs),
            prefix_versions=list(slot.versions),
        )

    def _finish(self, group_id: int, slot: Slot, reason: str | None) -> None:
        del self.active[slot.lease_id]
        slot.lease_id, slot.finish_reason = None, reason
        group = self.state.groups[group_id]
        if reason == "error":  # the group fails: its other samples' leases end with it
            for other in group.slots:
                self.active.pop(other.lease_id, None)
        self.groups.finished(group, slot)
