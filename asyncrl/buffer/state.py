"""The buffer's whole state, as one msgspec Struct: what ``RolloutBuffer.save`` writes and
``restore`` reads back (msgpack, never pickle), and what the write-ahead log's events
change. The three parts of the buffer (``LeaseTable``, ``GroupAssembler``,
``BatchServer``) share this one object; each field says which part writes it.

Indexes that can be rebuilt from it (lease id → slot, when each generator was last
heard from, the queue of samples waiting for a reward) are not part of it.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from asyncrl.wire import Chunk, Sample


class Slot(msgspec.Struct):
    """One sample of a group: the tokens received so far, in order, and its lease."""

    index: int
    """The sample's index in its group."""
    lease_id: str | None = None
    """The lease generating it now; None when not leased (waiting, or finished)."""
    worker_id: str | None = None
    """The generator holding ``lease_id``."""
    next_seq: int = 0
    """The chunk sequence number assembled next."""
    pending: dict[int, Chunk] = msgspec.field(default_factory=dict)
    """Chunks that arrived ahead of ``next_seq``, by sequence number."""
    token_ids: list[int] = msgspec.field(default_factory=list)
    """Generated tokens assembled so far (a re-issued lease's prefix)."""
    logprobs: list[float] = msgspec.field(default_factory=list)
    """Behavior logprob of each token in ``token_ids``."""
    versions: list[int] = msgspec.field(default_factory=list)
    """Policy version that produced each token in ``token_ids`` (−1: an observation)."""
    loss_mask: list[int] = msgspec.field(default_factory=list)
    """Episodes: 1 for each token of ``token_ids`` the model generated, 0 for an
    environment's; empty (every single-turn sample): all 1."""
    frames: bytearray = msgspec.field(default_factory=bytearray)
    """Pictures: the frames received so far (``Chunk.frames``, concatenated)."""
    env_reward: float | None = None
    """An episode's reward, from its environment (then no verifier runs)."""
    finish_reason: str | None = None
    """Why generation ended; None while it goes on."""
    reward: float | None = None
    """The sample's reward, once scored."""
    gap_since: float | None = None
    """When chunks after a missing one began to wait in ``pending``."""


class Group(msgspec.Struct):
    """The n samples of one prompt (a GRPO group)."""

    group_id: int
    prompt_id: int
    prompt_ids: list[int]
    slots: list[Slot]


class BufferState(msgspec.Struct):
    """Everything the buffer needs to resume."""

    version: int = 0
    """The trainer's newest announced version (``BatchServer``)."""
    # The prompt stream, groups and rewards (GroupAssembler).
    prompt_position: int = 0
    """Position of the next prompt in the task's prompt stream."""
    retry_prompts: list[tuple[int, list[int]]] = msgspec.field(default_factory=list)
    """Prompts whose group went stale, leased again before the stream's next ones."""
    prompts_counted: int = 0
    """Prompts admitted, less those whose group was dropped (the gate's count)."""
    next_group_id: int = 0
    groups: dict[int, Group] = msgspec.field(default_factory=dict)
    """Groups in flight: leased, generating, scored or complete, not yet consumed."""
    ready: list[int] = msgspec.field(default_factory=list)
    """Complete, scored groups in order of completion, oldest first."""
    uniform_streak: dict[int, int] = msgspec.field(default_factory=dict)
    """Prompt id → its latest groups in a row whose rewards were all equal (skip_uniform)."""
    reward_sum: float = 0.0
    filtered_since_batch: int = 0
    """Groups dynamic sampling dropped since the last batch was taken (its bound's count)."""
    # Leases (LeaseTable).
    next_lease: int = 0
    to_lease: list[tuple[int, int]] = msgspec.field(default_factory=list)
    """(group id, slot index) of samples waiting for a lease, first in line first."""
    revoked_alive: dict[str, str] = msgspec.field(default_factory=dict)
    """Lease id → holder of the latest leases taken back while their holder was alive,
    oldest first: tokens that still arrive for them are wasted work, counted."""
    # Batches (BatchServer).
    served: dict[int, list[list[Sample]]] = msgspec.field(default_factory=dict)
    """Step → per-rank shares, kept after serving until a trainer checkpoint covers the
    step: a rank asking again (its answer was lost, or it restarted) gets the same share."""
    keep_served_from: int = 0
    """The oldest step a restarted trainer may resume at."""
    newest_consumed_version: int = 0
    staleness: dict[int, int] = msgspec.field(default_factory=dict)
    """Consumed samples by staleness (a histogram)."""
    counts: dict[str, int] = msgspec.field(default_factory=dict)
    """Event counters by name (every part adds to them)."""

    def __post_init__(self) -> None:
        # Counters read 0 for a name never counted, also after a restore.
        self.counts, self.staleness = Counter(self.counts), Counter(self.staleness)


class SavedState(msgspec.Struct):
    """``buffer_state.msgpack``: the buffer's state (``RolloutBuffer.save``) and the
    write-ahead log segment that follows it."""

    wal_segment: int
    state: bytes
