"""Messages between the buffer and its reward servers (``RewardConfig.model_servers``):
the buffer hands batches of token sequences to whichever server asks for work, and each
batch's scores come back under the batch's id.

Every batch the buffer sent is answered exactly once in its books: by its scores, or,
when its server left, restarted or went silent past ``RewardConfig.model_timeout_s``, by
sending it again to another server (a late answer of the first is then dropped, counted).
"""

from __future__ import annotations

from asyncrl.wire.base import Message

ASK_EVERY_S = 2.0
"""How often a free reward server asks again: a restarted buffer learns of it within this,
and the buffer's timeout for a silent server (``model_timeout_s``) must stay above it."""


class ScoreAsk(Message):
    """Reward server -> buffer: "I am free for a batch". Sent again every few seconds while
    it waits (a restarted buffer learns of it so). An ask from a new ``incarnation`` under a
    known ``worker_id`` means the old process died: its batches go to others at once."""

    worker_id: str
    incarnation: str


class ScoreJob(Message):
    """Buffer -> reward server: sequences (prompt + completion token ids) to score."""

    job_id: str
    """Unique in the run, across buffer restarts (it starts with the buffer process's
    own token), so an answer never lands on another batch."""
    sequences: list[list[int]]


class ScoreResult(Message):
    """Reward server -> buffer: a ``ScoreJob``'s scores, in its order. None for a sequence
    the model could not score (a failed forward, a non-finite value): the buffer gives it
    0 and counts it."""

    worker_id: str
    job_id: str
    scores: list[float | None]
    seconds: float = 0.0
    """The server's time on the batch (forward included), for the latency figures."""
