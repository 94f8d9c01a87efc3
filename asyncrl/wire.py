"""The wire protocol: one ``msgspec.Struct`` per message, msgpack-encoded, tagged by class
name, each carrying the protocol version and the run id (docs/architecture.md, Messages).

Who sends what:

    LeaseRequest   generator -> buffer    "I can take N more samples"
    LeaseGrant     buffer -> generator    Leases: each one sample of one prompt to generate
    LeaseRevoked   buffer -> generator    leases taken back: abort them, send nothing more
    Chunk          generator -> buffer    new tokens of a lease, streamed as they are made
    Heartbeat      generator/trainer -> buffer
    Leaving        generator -> buffer    drained: every lease back, no more grants
    BatchRequest   trainer rank -> buffer
    Batch          buffer -> trainer rank
    VersionAnnounce trainer -> buffer     the newest published weights version (or the
                                          version a restarted trainer resumes at)
    CheckpointAnnounce trainer -> buffer  the oldest checkpoint kept (older batches can go)
    WeightsAnnounce a whole state in one message, raw tensor frames following (what the
                   weights benchmark compares the buckets against)
    WeightsBucket  trainer -> generators  one bucket of a version (anchor or delta), one frame
    AnchorRequest  generator -> trainer   "send the whole weights": missed a delta, bad checksum
    WeightsOnDisk  trainer -> generators  a version as an HF directory (remote servers load it)
    WeightsByTransfer trainer -> generators  a version the trainer sends into a server on request
    TransferAsk    generator -> trainer   "send that version into this server now"
    TransferDone   trainer -> generator   the answer: done, or why not
    ProbeReport    generator -> trainer   the probe's logprobs under weights just flipped in

Tensors never go through msgpack: ``asyncrl.weights.frames`` sends them as raw frames
after a header. Nothing here, or anywhere on a socket, is pickled. ``WireDecoder``
turns bad frames into counted ``WireError`` kinds instead of exceptions that could crash
a process.

Why one file: it is the protocol: every message a process may send, with the codec that
refuses any other, so a reader sees in one place what can cross a socket.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Literal

import msgspec

PROTOCOL_VERSION = 1

log = logging.getLogger(__name__)


class Message(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Fields every message carries; subclasses are tagged with their class name."""

    protocol: int = PROTOCOL_VERSION
    run_id: str


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
    (``left``) naming what it took back, possibly nothing: the generator may then exit."""

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


class TensorMeta(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]


class WeightsAnnounce(Message):
    version: int
    tensors: list[TensorMeta]
    """One raw frame follows the header for each entry, in this order."""
    lineage: str = ""
    """Which trainer process made these weights. A generator takes any version from a new
    lineage (a trainer restarted from a checkpoint goes back to that version), and only
    newer versions from the one it has."""


class TensorSpan(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    """Byte offset in the version's flat buffer (``asyncrl.weights.codec.Layout``)."""


class WeightsBucket(Message):
    """One byte range of a weights version's flat buffer; one raw frame follows: the
    range's bytes (``kind="anchor"``) or, compressed if ``compressed``, their byte-shuffled
    XOR with the same range of version ``base`` (``kind="delta"``)."""

    version: int
    lineage: str
    kind: Literal["anchor", "delta"]
    base: int
    """The version a delta applies to (the anchor's own version for an anchor)."""
    index: int
    count: int
    """Buckets in this version; they are sent in order."""
    start: int
    end: int
    total: int
    """Bytes of the whole flat buffer."""
    checksum: int
    """CRC-32 of the range's bytes in ``version``, checked after applying."""
    itemsize: int
    """Element size of the delta's byte shuffle."""
    compressed: bool = False
    layout: list[TensorSpan] = []
    """The tensors of the flat buffer: in an anchor's first bucket."""


class AnchorRequest(Message):
    """Generator -> trainer rank 0: send the newest version whole; this generator holds
    ``have`` (-1: nothing it can apply a delta to) and says ``why``."""

    worker_id: str
    have: int
    why: str


class ProbeReport(Message):
    """Generator -> trainer rank 0 (``transport.weights.probe_text``): the engine's
    logprobs of the probe's tokens after the first (temperature 1) under weights
    ``version`` of ``lineage``, scored when they were flipped in."""

    worker_id: str
    version: int
    lineage: str
    logprobs: list[float]


class WeightsOnDisk(Message):
    """Weights ``version`` are the complete Hugging Face directory ``path`` (absolute), for
    generators whose servers load weights from disk (``DiskWeightPublisher``)."""

    version: int
    path: str
    lineage: str = ""
    """As in ``WeightsAnnounce``."""


class WeightsByTransfer(Message):
    """Weights ``version`` wait on trainer rank 0, which sends them into a server itself
    when asked on ``endpoint`` (a REP socket), for generators whose vLLM servers take
    weights by vLLM's weight transfer (``VllmTransferPublisher``)."""

    version: int
    endpoint: str
    lineage: str = ""
    """As in ``WeightsAnnounce``."""


class TransferAsk(Message):
    """Generator -> trainer rank 0: send weights ``version`` of ``lineage`` into the server
    at ``url``, which the generator has paused and drained; answered by ``TransferDone``.
    Past ``deadline`` (``time.time()``) the generator has given up: no transfer starts."""

    worker_id: str
    version: int
    url: str
    lineage: str
    deadline: float


class TransferDone(Message):
    """Trainer rank 0 -> generator: the server at ``url`` runs ``version`` (``ok``), or
    ``why`` not (a newer version replaced it, or the transfer failed)."""

    version: int
    url: str
    ok: bool
    why: str = ""
    touched: bool = False
    """Not ``ok``, and the server's weights may have been partly replaced."""


ANY_MESSAGE = (
    LeaseRequest
    | Lease
    | LeaseGrant
    | LeaseRevoked
    | Chunk
    | Heartbeat
    | Leaving
    | BatchRequest
    | Batch
    | VersionAnnounce
    | CheckpointAnnounce
    | WeightsAnnounce
    | WeightsOnDisk
    | WeightsByTransfer
    | TransferAsk
    | TransferDone
    | WeightsBucket
    | AnchorRequest
    | ProbeReport
)

ErrorKind = Literal["decode", "protocol", "run_id", "unexpected", "frames"]


class WireError(Exception):
    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


class WireDecoder:
    """Decodes frames into messages of the expected types for one run; counts failures.

    ``decode`` raises ``WireError``; ``try_decode`` returns None instead, after counting the
    failure by kind and logging the first of each kind.
    """

    def __init__(self, run_id: str, expected: type | None = None) -> None:
        self.run_id = run_id
        self._decoder = msgspec.msgpack.Decoder(expected or ANY_MESSAGE)
        self.errors: Counter[str] = Counter()

    def decode(self, frame: bytes | memoryview) -> Message:
        try:
            message = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError("decode", str(e)) from None
        if message.protocol != PROTOCOL_VERSION:
            raise WireError("protocol", f"protocol {message.protocol}, expected {PROTOCOL_VERSION}")
        if message.run_id != self.run_id:
            raise WireError("run_id", f"run id {message.run_id!r}, expected {self.run_id!r}")
        return message

    def try_decode(self, frame: bytes | memoryview, where: str = "") -> Message | None:
        try:
            return self.decode(frame)
        except WireError as e:
            self.count(e.kind, f"{where}: {e}")
            return None

    def count(self, kind: str, detail: str) -> None:
        if self.errors[kind] == 0:
            log.warning(
                "dropping a bad frame (%s); further ones are only counted: %s", kind, detail[:300]
            )
        self.errors[kind] += 1
