"""The batch server: the buffer's part that turns complete groups into the trainer's
batches, one per step, under the staleness bound (docs/design.md, Versions and staleness).

At consumption a group whose oldest token is more than η versions older than the step
is dropped and its prompt leased again (``GroupAssembler.drop_stale``); the rest are
taken oldest first, B groups a step, split across the trainer ranks by tokens (a group
stays on one rank: its advantages need all of it). Served batches are kept until a
trainer checkpoint covers their step, so a trainer that restarts from that checkpoint
trains on exactly the same data again and nothing is counted as consumed twice. It also
tracks the trainer's version, which the admission gate reads.
"""

from __future__ import annotations

from asyncrl.balance import split_balanced
from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.groups import GroupAssembler
from asyncrl.buffer.staleness import StalenessGate
from asyncrl.buffer.state import BufferState, Group
from asyncrl.wire import Sample


class BatchServer:
    def __init__(
        self,
        cfg: BufferConfig,
        gate: StalenessGate,
        state: BufferState,
        groups: GroupAssembler,
    ) -> None:
        self.cfg, self.gate, self.state, self.groups = cfg, gate, state, groups
        self._waited_step = -1
        self.steps_waited = 0
        """Steps held for a straggler since this process started: a gauge, not part of the
        saved state (a wait changes nothing the write-ahead log replays)."""

    def batch_for(self, step: int, rank: int, world_size: int) -> list[Sample] | None:
        """This rank's share of the step's batch, or None while it is not complete yet.
        Asking again for a step gives the same share (nothing is consumed twice)."""
        st = self.state
        shares = st.served.get(step)
        if shares is None:
            groups = self._take_groups(step)
            if groups is None:
                return None
            shares = st.served[step] = self._consume(step, groups, world_size)
            while len(st.served) > max(1, self.cfg.replay_steps):
                del st.served[min(st.served)]
        elif len(shares) != world_size:  # a trainer restarted with another number of ranks
            regrouped: dict[int, list[Sample]] = {}
            for sample in (s for share in shares for s in share):
                regrouped.setdefault(sample.group_id, []).append(sample)
            shares = st.served[step] = split_groups(list(regrouped.values()), world_size)
        else:
            st.counts["batches_served_again"] += rank == 0
        return shares[rank]

    def set_version(self, version: int) -> None:
        """The trainer published ``version``."""
        self.state.version = max(self.state.version, version)

    def resume_at(self, version: int) -> None:
        """A trainer (re)started at ``version`` (its checkpoint's step; 0 without one).
        The version goes back there, and steps from ``version`` on are served again from
        the batches kept for them, so the restarted trainer retrains on exactly the data
        the dead one had taken. Steps no longer kept get fresh groups: the gate is opened
        for their prompts."""
        st = self.state
        st.version = version
        if not st.served:
            return
        newest = max(st.served)
        missing = sum(1 for step in range(version, newest + 1) if step not in st.served)
        st.prompts_counted -= missing * self.cfg.prompts_per_batch
        st.counts["steps_not_replayable"] += missing

    def start_at(self, version: int) -> None:
        """Start this fresh buffer at ``version`` as if the batches of the earlier steps had
        been issued and consumed (the prompt stream goes on after them), so the gate does
        not admit them again: for the colocated placement resuming from a trainer
        checkpoint, which keeps no buffer state of its own."""
        st = self.state
        if st.groups or st.prompts_counted:
            raise RuntimeError("start_at needs a buffer that has issued nothing yet")
        st.version = version
        st.prompts_counted = st.prompt_position = version * self.cfg.prompts_per_batch

    def checkpointed(self, step: int) -> None:
        """The oldest trainer checkpoint kept is at ``step``: batches of earlier steps can
        never be asked for again."""
        st = self.state
        st.keep_served_from = max(st.keep_served_from, step)
        for old in [s for s in st.served if s < st.keep_served_from]:
            del st.served[old]

    def _take_groups(self, step: int) -> list[Group] | None:
        """Drop what became too stale (its prompt is leased again), then take B groups,
        oldest first, if there are B and no straggler must be waited for."""
        st, oldest = self.state, {}
        for group_id in st.ready:
            group = st.groups[group_id]
            version = oldest_version(group, step)
            if self.gate.is_stale(step, version):
                self.groups.drop_stale(group)
            else:
                oldest[group_id] = version
        st.ready = fresh = list(oldest)
        if len(fresh) < self.cfg.prompts_per_batch or self._straggler(step):
            return None
        # Oldest tokens first, not first finished: a long group finishes late, and taking
        # groups in finishing order would leave it behind until it is too stale to train.
        fresh.sort(key=lambda g: (oldest[g], g))
        taken, st.ready = fresh[: self.cfg.prompts_per_batch], fresh[self.cfg.prompts_per_batch :]
        st.filtered_since_batch = 0
        return [st.groups.pop(g) for g in taken]

    def _straggler(self, step: int) -> bool:
        """Whether a group still generating would be too stale for the step after this
        one: then the trainer waits for it (``stale_policy="wait"``), so that long
        samples, which finish last, are trained on instead of dropped for staleness.
        Holding the step also holds the version, and so the gate's admission: generation
        is paced by its slowest sample, never more than η versions behind."""
        if self.cfg.stale_policy != "wait" or self.gate.max_staleness is None:
            return False
        ready = set(self.state.ready)
        for group in self.state.groups.values():
            if group.group_id in ready:
                continue
            # A slot's first token is its oldest but for a lease moved to a generator with
            # older weights; the exact check at consumption still catches that case.
            # Waiting is only worth it for a group not stale already (that only happens after
            # a restart), and counted once per step however often the trainer asks.
            started = [first_version(s.versions) for s in group.slots if s.versions]
            if started and step - min(started) == self.gate.max_staleness:
                if self._waited_step != step:
                    self._waited_step, self.steps_waited = step, self.steps_waited + 1
                return True
        return False

    def _consume(self, step: int, groups: list[Group], world_size: int) -> list[list[Sample]]:
        """The groups as samples, counted as consumed with their staleness, per rank."""
        st = self.state
        per_group = [[to_sample(g, s) for s in g.slots] for g in groups]
        for sample in (s for group in per_group for s in group):
            generated = [v for v, m in zip(sample.versions, sample.loss_mask) if m]
            st.staleness[step - min(generated, default=step)] += 1
            st.newest_consumed_version = max(st.newest_consumed_version, *generated, 0)
        st.counts["samples_consumed"] += sum(len(g) for g in per_group)
        st.counts["completion_tokens_consumed"] += sum(
            len(s.token_ids) for g in groups for s in g.slots
        )
        st.counts["groups_consumed"] += len(groups)
        return split_groups(per_group, world_size)


def first_version(versions: list[int]) -> int:
    """The version of a sample's first generated token (an episode's first turn: its
    observations carry −1)."""
    return next((v for v in versions if v >= 0), versions[0])


def oldest_version(group: Group, default: int) -> int:
    """The version of the group's oldest generated token (``default`` if it has none)."""
    return min((v for s in group.slots for v in s.versions if v >= 0), default=default)


def to_sample(group: Group, slot) -> Sample:
    """A finished slot as the trainer's ``Sample``: prompt tokens (version −1, no loss)
    then the generated ones."""
    prompt = len(group.prompt_ids)
    return Sample(
        prompt_id=group.prompt_id,
        group_id=group.group_id,
        sample_index=slot.index,
        token_ids=group.prompt_ids + slot.token_ids,
        logprobs=[0.0] * prompt + slot.logprobs,
        versions=[-1] * prompt + slot.versions,
        loss_mask=[0] * prompt + (slot.loss_mask or [1] * len(slot.token_ids)),
        reward=slot.reward,
        finish_reason=slot.finish_reason,
        frames=bytes(slot.frames),
    )


def split_groups(per_group: list[list[Sample]], world_size: int) -> list[list[Sample]]:
    """Whole groups to one rank (group-relative advantages need all of a group), balanced
    by tokens across ranks."""
    tokens = [sum(len(s.token_ids) for s in group) for group in per_group]
    return [
        [s for i in share for s in per_group[i]] for share in split_balanced(tokens, world_size)
    ]
