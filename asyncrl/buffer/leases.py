"""The lease table: the buffer's part that hands samples to generators and assembles what
they stream back.

A lease gives one sample of a group to one generator. The generator streams the sample's
tokens as ``Chunk``s with sequence numbers; chunks are assembled in order (a duplicate is
counted and dropped, one that arrives early waits for the ones before it). A lease runs
as long as its generation does, minutes if need be; it is taken back (``expire`` picks,
``revoke`` takes) only when

    holder_silent  its holder sent nothing for ``heartbeat_timeout_s``: presumed dead
    holder_restarted  its holder's process started again under the same worker id (a
                   new ``incarnation`` in its messages): the lease died with the old one
    gap            a chunk before the ones waiting never came, for ``gap_timeout_s``
    no_progress    its holder is alive but sent no new chunk for it for
                   ``progress_timeout_s``, counted from its issue or its latest chunk
    not_held       its holder is alive but its heartbeats no longer list it, from
                   ``heartbeat_timeout_s`` after its issue: the grant or the last chunks
                   were lost (a buffer that died between journalling and sending them,
                   or chunks queued to the dead process), and the holder will send nothing
    drained        its holder left the run (``Leaving``), having sent every token it made

The sample then goes first in line to be leased again, with the tokens already assembled
as the next holder's prefix. A holder that is alive (``gap``, ``no_progress``) is told to abort the
lease (the buffer process sends ``LeaseRevoked``); tokens that still arrive for it are
counted as ``tokens_revoked_alive``, the work such revocations waste. The last chunk
hands the sample to the ``GroupAssembler``.
"""

from __future__ import annotations

import msgspec

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.groups import GroupAssembler
from asyncrl.buffer.state import BufferState, Slot
from asyncrl.seeds import derive_seed
from asyncrl.wire import Chunk, Lease, SamplingSpec

HOLDER_SILENT, GAP, NO_PROGRESS = "holder_silent", "gap", "no_progress"
HOLDER_RESTARTED, NOT_HELD, DRAINED = "holder_restarted", "not_held", "drained"
"""Why a lease is taken back (``expire``, or ``on_leaving``: drained); counted as
``leases_revoked_<reason>``."""
REVOKED_ALIVE_KEPT = 1024
"""Leases revoked from a live holder remembered for ``tokens_revoked_alive``: the holder
stops within a loop turn of being told, so only the latest few can still get chunks."""


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
        self.progress_at: dict[str, float] = {}
        """When each lease out now last made progress: its issue, or its latest new chunk."""
        self.incarnations: dict[str, str] = {}
        """Each generator's process start it last spoke from (``on_incarnation``)."""
        self.orphaned: set[str] = set()
        """Leases whose holder restarted, for the next ``expire`` to take back."""
        self.issued_at: dict[str, float] = {}
        """When each lease out now was issued (or the buffer restored it)."""
        self.claimed: dict[str, tuple[frozenset[str], float]] = {}
        """Each generator's latest list of the leases it holds, and when it came."""

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
            if chunk.lease_id in self.state.revoked_alive:
                counts["tokens_revoked_alive"] += len(chunk.token_ids)
            return
        n = len(chunk.token_ids)
        if not (n == len(chunk.logprobs) == len(chunk.versions)) or len(chunk.loss_mask) not in (
            0,
            n,
        ):
            counts["chunks_malformed"] += 1
            return
        slot = self._groups[where[0]].slots[where[1]]
        if chunk.seq < slot.next_seq or chunk.seq in slot.pending:
            counts["chunks_duplicate"] += 1
            return
        self.progress_at[chunk.lease_id] = now
        slot.pending[chunk.seq] = chunk
        if slot.next_seq not in slot.pending and slot.gap_since is None:
            slot.gap_since = now  # a chunk before this one is missing (late, or lost)
        while slot.next_seq in slot.pending:
            c = slot.pending.pop(slot.next_seq)
            slot.next_seq += 1
            slot.token_ids.extend(c.token_ids)  # in place: no attribute set on the Struct
            slot.logprobs.extend(c.logprobs)
            slot.versions.extend(c.versions)
            slot.loss_mask.extend(c.loss_mask)  # episodes only: empty means all 1
            slot.frames.extend(c.frames)  # pictures only
            counts["tokens_received"] += len(c.token_ids)
            if c.finished:
                slot.env_reward = c.reward
                if c.episode is not None:
                    for key, value in msgspec.structs.asdict(c.episode).items():
                        counts[f"episode_{key}"] += value
                self._finish(where[0], slot, c.finish_reason)
                return
        if not slot.pending:
            slot.gap_since = None

    def on_incarnation(self, worker_id: str, incarnation: str) -> None:
        """Note which start of ``worker_id``'s process is speaking. A new one means the
        process restarted under the same id: the leases it held then died with the old
        process, though the new one's heartbeats keep the holder alive, so ``expire``
        takes them back at once (leases issued from now on are the new process's)."""
        if not incarnation:
            return
        before = self.incarnations.get(worker_id)
        self.incarnations[worker_id] = incarnation
        if before is not None and before != incarnation:
            groups = self.state.groups
            self.orphaned.update(
                lease_id
                for lease_id, (g, i) in self.active.items()
                if groups[g].slots[i].worker_id == worker_id
            )

    def on_heartbeat(
        self,
        worker_id: str,
        now: float,
        version: int | None = None,
        leases: list[str] | None = None,
    ) -> None:
        """A heartbeat: the holder is alive, runs ``version`` and holds ``leases`` (None:
        not reported)."""
        self.last_seen[worker_id] = now
        if version is not None:
            self.worker_versions[worker_id] = version
        if leases is not None:
            self.claimed[worker_id] = (frozenset(leases), now)

    def on_leaving(self, worker_id: str) -> list[str]:
        """``worker_id`` leaves the run, drained: the leases it holds, for ``revoke`` to
        take back with reason ``drained``; its liveness records are forgotten (its version
        no longer counts among the generators')."""
        for records in (self.last_seen, self.worker_versions, self.claimed):
            records.pop(worker_id, None)
        groups = self._groups
        return [
            lease_id
            for lease_id, (g, i) in self.active.items()
            if groups[g].slots[i].worker_id == worker_id
        ]

    def expire(self, now: float) -> dict[str, str]:
        """The leases to take back now, lease id → reason (``holder_silent``, ``gap`` or
        ``no_progress``, as in the module docstring); a lease that keeps getting chunks is
        never among them, however long it runs. ``revoke`` takes them (the buffer process
        logs them between the two, so a replay needs no clock or heartbeats)."""
        cfg, expired = self.cfg, {}
        for lease_id in self.orphaned & self.active.keys():
            expired[lease_id] = HOLDER_RESTARTED
        self.orphaned.clear()
        for lease_id, (group_id, index) in self.active.items():
            slot = self._groups[group_id].slots[index]
            if lease_id in expired:
                continue
            if now - self.last_seen.get(slot.worker_id, now) > cfg.heartbeat_timeout_s:
                expired[lease_id] = HOLDER_SILENT
            elif slot.gap_since is not None and now - slot.gap_since > cfg.gap_timeout_s:
                expired[lease_id] = GAP
            elif now - self.progress_at.get(lease_id, now) > cfg.progress_timeout_s:
                expired[lease_id] = NO_PROGRESS
            elif self._forgotten(lease_id, slot.worker_id):
                expired[lease_id] = NOT_HELD
        return expired

    def _forgotten(self, lease_id: str, holder: str) -> bool:
        """Whether the holder's heartbeats stopped listing the lease: its latest list came
        ``heartbeat_timeout_s`` after the issue (a grant reaches a live holder in far less)
        and does not name it."""
        held, at = self.claimed.get(holder, (None, 0.0))
        issued = self.issued_at.get(lease_id)
        if held is None or issued is None or lease_id in held:
            return False
        return at - issued > self.cfg.heartbeat_timeout_s

    def revoke(
        self, lease_ids: list[str], reasons: list[str] | None = None
    ) -> dict[str, list[str]]:
        """Take these leases back, for ``reasons`` as ``expire`` gave them (None: counted
        as re-issued only); each sample goes first in line to be leased again, with the
        tokens already assembled as the next holder's prefix. Returns the leases whose
        holder is alive, by holder: the ones to tell to abort them."""
        counts, tell = self.state.counts, {}
        for lease_id, reason in zip(lease_ids, reasons or [None] * len(lease_ids)):
            where = self.active.pop(lease_id, None)
            if where is None:
                continue
            group_id, index = where
            slot = self.state.groups[group_id].slots[index]
            holder = slot.worker_id
            slot.lease_id, slot.worker_id, slot.pending, slot.gap_since = None, None, {}, None
            self.progress_at.pop(lease_id, None)
            self.issued_at.pop(lease_id, None)
            self.state.to_lease.insert(0, (group_id, index))  # first in line; keeps its tokens
            counts["leases_reissued"] += 1
            if reason is not None:
                counts[f"leases_revoked_{reason}"] += 1
            if reason in (GAP, NO_PROGRESS):
                self._remember_revoked_alive(lease_id, holder)
                tell.setdefault(holder, []).append(lease_id)
        return tell

    def alive_since(self, now: float) -> None:
        """Give every lease holder a full heartbeat timeout, and every lease a full
        progress timeout, from ``now`` (after a restart: the time the buffer was down is
        not its holders' doing, and their chunks sent meanwhile may still be on their way)."""
        groups = self.state.groups
        self.last_seen = {groups[g].slots[i].worker_id: now for g, i in self.active.values()}
        self.progress_at = dict.fromkeys(self.active, now)
        self.issued_at = dict.fromkeys(self.active, now)
        self.claimed = {}  # lists sent before ``now`` may predate grants the holder has

    def _remember_revoked_alive(self, lease_id: str, holder: str) -> None:
        revoked = self.state.revoked_alive
        revoked[lease_id] = holder
        if len(revoked) > REVOKED_ALIVE_KEPT:
            del revoked[next(iter(revoked))]  # the oldest

    def _issue(self, group_id: int, index: int, worker_id: str, now: float) -> Lease:
        st = self.state
        group = st.groups[group_id]
        slot = group.slots[index]
        slot.lease_id = f"{self.run_id}:{st.next_lease}"
        st.next_lease += 1
        slot.worker_id, slot.next_seq = worker_id, 0
        self.active[slot.lease_id] = (group_id, index)
        self.progress_at[slot.lease_id] = self.issued_at[slot.lease_id] = now
        st.counts["leases_issued"] += 1
        if slot.token_ids:  # taken back from an earlier holder: continued from its tokens
            st.counts["leases_continued"] += 1
        continued = 0 in slot.loss_mask  # an episode with a whole turn and its answer
        if continued:
            st.counts["episodes_continued"] += 1
        return Lease(
            run_id=self.run_id,
            lease_id=slot.lease_id,
            prompt_id=group.prompt_id,
            group_id=group_id,
            sample_index=index,
            prompt_ids=group.prompt_ids,
            sampling=self._sampling(group_id, index),
            prefix_ids=list(slot.token_ids),
            prefix_logprobs=list(slot.logprobs),
            prefix_versions=list(slot.versions),
            prefix_mask=list(slot.loss_mask) if continued else [],
            prefix_frames=bytes(slot.frames),
            min_version=self.groups.gate.min_version(st.version),
        )

    def _sampling(self, group_id: int, index: int) -> SamplingSpec:
        """The lease's sampling, seeded for its sample (the run's seed, its group and its
        index): a sample re-issued elsewhere draws with the same seed."""
        if self.sampling.seed is None:
            return self.sampling
        seed = derive_seed(self.sampling.seed, group_id, index)
        return msgspec.structs.replace(self.sampling, seed=seed)

    def _finish(self, group_id: int, slot: Slot, reason: str | None) -> None:
        del self.active[slot.lease_id]
        self.progress_at.pop(slot.lease_id, None)
        self.issued_at.pop(slot.lease_id, None)
        slot.lease_id, slot.finish_reason = None, reason
        group = self.state.groups[group_id]
        if reason == "error":  # the group fails: its other samples' leases end with it
            for other in group.slots:
                self.active.pop(other.lease_id, None)
                self.progress_at.pop(other.lease_id, None)
                self.issued_at.pop(other.lease_id, None)
        self.groups.finished(group, slot)
