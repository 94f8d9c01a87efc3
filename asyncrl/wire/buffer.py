"""The messages with the buffer at one end: leases and their chunks from the generators,
heartbeats, batches for the trainer ranks, and the trainer's announcements of versions and
checkpoints (``asyncrl.wire`` lists who sends which)."""

from __future__ import annotations

from typing import Literal

import msgspec

from asyncrl.wire.base import Message


class SamplingSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    stop: list[str] = []
    """Stop strings (``SamplingConfig.stop``); absent from older messages, which decode
    with none."""


class LeaseRequest(Message):
    worker_id: str
    capacity: int
    """How many more samples the generator can take now."""
    incarnation: str = ""
    """Unique per start of the generator process: a restart under the same ``worker_id``
    shows as a new one, and the leases the dead process held are re-issued at once."""


class Lease(Message):
    lease_id: str
    """Unique per issue: a re-issued sample gets a new lease id."""
    prompt_id: int
    group_id: int
    """Samples of one prompt share a group (GRPO); ``sample_index`` is 0 … n-1 in it."""
    sample_index: int
    prompt_ids: list[int]
    sampling: SamplingSpec
    prefix_ids: list[int] = []
    """Tokens already generated for this sample by an earlier holder of the lease; the
    generator continues after them. ``prefix_logprobs[i]`` and ``prefix_versions[i]`` belong
    to ``prefix_ids[i]``."""
    prefix_logprobs: list[float] = []
    prefix_versions: list[int] = []
    prefix_mask: list[int] = []
    """Episodes: 1 for each prefix token the model generated, 0 for the environment's
    (observations); empty means all 1. An episode's prefix always ends at a turn's end."""
    prefix_frames: bytes = b""
    """Pictures: the frames an earlier holder sent (``Chunk.frames``, concatenated); the
    generator continues from the last one."""
    min_version: int = -1
    """The oldest weights its tokens may come from: the trainer's version less η when it
    was issued (-1: no bound). A generator with older weights holds it until newer ones
    are in, since tokens sampled before would make the sample too stale to train."""


class LeaseGrant(Message):
    """The buffer's answer to a LeaseRequest: at least one lease (it waits until it has one)."""

    leases: list[Lease]


class LeaseRevoked(Message):
    """The buffer took these leases of ``worker_id`` back (no new chunk for too long, or
    one lost) and leases their samples again: the generator aborts their requests and
    sends no more chunks for them. Also the answer to a chunk for a lease the buffer no
    longer has, so a generator that missed the first one stops all the same."""

    worker_id: str
    lease_ids: list[str]
    left: bool = False
    """The answer to the worker's ``Leaving``: all it held, taken back; it may exit."""


class EpisodeFigures(msgspec.Struct, kw_only=True):
    """What a finished episode reports (the buffer sums them into its counters)."""

    turns: int = 0
    """Model turns."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Tool calls that raised or timed out, and environment steps that raised."""
    env_us: int = 0
    """Microseconds its environment worked (building, replaying, answering)."""
    replay_mismatches: int = 0
    """Recorded observations its rebuilt environment answered otherwise (must be 0)."""


class Chunk(Message):
    worker_id: str
    lease_id: str
    seq: int
    """0, 1, 2 … per lease: the buffer assembles chunks in this order and drops repeats."""
    token_ids: list[int]
    logprobs: list[float]
    """``logprobs[i]`` is the behavior logprob of ``token_ids[i]``."""
    versions: list[int]
    """``versions[i]`` is the weights version that produced ``token_ids[i]``."""
    finished: bool = False
    finish_reason: str | None = None
    loss_mask: list[int] = []
    """Episodes: 1 for each token the model generated (trained), 0 for the environment's
    (observations: logprob 0, version -1); empty means all 1. An episode's chunks carry
    whole turns (a model turn and the observation that answered it)."""
    reward: float | None = None
    """Episodes, on the finishing chunk: the environment's reward, which is the sample's
    reward (no verifier runs)."""
    episode: EpisodeFigures | None = None
    """Episodes, on the finishing chunk: the episode's figures, for the buffer's metrics."""
    frames: bytes = b""
    """Pictures (``asyncrl.image``): the float32 frames of the denoising steps this chunk
    reports, one per step (``token_ids`` holds the steps' indices), after the start
    noise in a lease's first chunk. The buffer concatenates them in order; their meaning
    is the image generator's and trainer's (``asyncrl.image.frames``)."""


class Heartbeat(Message):
    worker_id: str
    kind: Literal["generator", "trainer"]
    version: int
    """Weights version the worker runs now."""
    running: int = 0
    counters: dict[str, float] = {}
    incarnation: str = ""
    """As ``LeaseRequest.incarnation`` (generators; trainers leave it empty)."""
    leases: list[str] | None = None
    """A generator's leases now: granted and not yet finished or aborted (waiting for
    weights, generating, or between an episode's turns). The buffer takes back a lease its
    live holder stops listing (its grant or last chunks were lost). None: not reported."""


class Leaving(Message):
    """A generator leaves the run, drained (its slot goes to another role): it asks for
    no more leases, and every token it generated was sent in the chunks before this
    message on the same socket. The buffer takes back every lease it holds at once
    (``leases_revoked_drained``), each sample first in line with its tokens as the next
    holder's prefix, grants this process nothing more, and answers with ``LeaseRevoked``
    (``left``) naming what it took back, possibly nothing: the generator may then exit.

    A reward server sends it too, on the buffer's reward socket, when it stops or is
    drained: every batch it answered went before it, and what it still held goes to
    another server at once."""

    worker_id: str
    incarnation: str
    """As ``LeaseRequest.incarnation``: the process that leaves (a later start under the
    same worker id joins again)."""


class BatchRequest(Message):
    step: int
    rank: int
    world_size: int


class Sample(msgspec.Struct, kw_only=True):
    """One finished trajectory as the trainer receives it; per-token lists have one
    entry per token of ``prompt_ids + completion_ids`` (prompt entries: logprob 0,
    version -1, loss mask 0; an episode's observations likewise)."""

    prompt_id: int
    group_id: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float
    finish_reason: str | None = None
    frames: bytes = b""
    """Pictures: every frame its chunks carried, in order (``Chunk.frames``)."""


class Batch(Message):
    step: int
    rank: int
    samples: list[Sample]


class VersionAnnounce(Message):
    version: int
    resumed: bool = False
    """The trainer (re)started at ``version`` (its checkpoint's step): the buffer goes back
    to it and serves the batches of the steps it already served again."""


class CheckpointAnnounce(Message):
    """The oldest trainer checkpoint kept is at ``step``: batches of earlier steps will
    never be asked for again."""

    step: int
