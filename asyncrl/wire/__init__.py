"""The wire protocol: one ``msgspec.Struct`` per message, msgpack-encoded, tagged by class
name, each carrying the protocol version and the run id (docs/architecture.md, Messages).

Who sends what:

    LeaseRequest   generator -> buffer    "I can take N more samples"
    LeaseGrant     buffer -> generator    Leases: each one sample of one prompt to generate
    LeaseRevoked   buffer -> generator    leases taken back: abort them, send nothing more
    Chunk          generator -> buffer    new tokens of a lease, streamed as they are made
    Heartbeat      generator/trainer -> buffer
    Leaving        generator -> buffer    drained: every lease back, no more grants;
                   reward server -> buffer  drained or stopping: its batches go to others
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
    ScoreAsk       reward server -> buffer  "I am free for a batch"
    ScoreJob       buffer -> reward server  sequences to score
    ScoreResult    reward server -> buffer  their scores

Tensors never go through msgpack: ``asyncrl.weights.frames`` sends them as raw frames
after a header. Nothing here, or anywhere on a socket, is pickled. ``WireDecoder``
turns bad frames into counted ``WireError`` kinds instead of exceptions that could crash
a process.

The messages live in ``asyncrl.wire.buffer`` (the buffer at one end),
``asyncrl.wire.rewards`` (the buffer and its reward servers) and ``asyncrl.wire.weights``
(weights between the trainer and the generators); this module is
the codec, and ``ANY_MESSAGE`` the one list of what a socket may carry.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Literal

import msgspec

from asyncrl.wire.base import PROTOCOL_VERSION, Message
from asyncrl.wire.buffer import (
    Batch,
    BatchRequest,
    CheckpointAnnounce,
    Chunk,
    EpisodeFigures,
    Heartbeat,
    Lease,
    LeaseGrant,
    LeaseRequest,
    LeaseRevoked,
    Leaving,
    Sample,
    SamplingSpec,
    VersionAnnounce,
)
from asyncrl.wire.rewards import ScoreAsk, ScoreJob, ScoreResult
from asyncrl.wire.weights import (
    AnchorRequest,
    ProbeReport,
    TensorMeta,
    TensorSpan,
    TransferAsk,
    TransferDone,
    WeightsAnnounce,
    WeightsBucket,
    WeightsByTransfer,
    WeightsOnDisk,
)

log = logging.getLogger(__name__)

__all__ = [
    "ANY_MESSAGE",
    "AnchorRequest",
    "Batch",
    "BatchRequest",
    "CheckpointAnnounce",
    "Chunk",
    "EpisodeFigures",
    "ErrorKind",
    "Heartbeat",
    "Lease",
    "LeaseGrant",
    "LeaseRequest",
    "LeaseRevoked",
    "Leaving",
    "Message",
    "PROTOCOL_VERSION",
    "ProbeReport",
    "Sample",
    "SamplingSpec",
    "ScoreAsk",
    "ScoreJob",
    "ScoreResult",
    "TensorMeta",
    "TensorSpan",
    "TransferAsk",
    "TransferDone",
    "VersionAnnounce",
    "WeightsAnnounce",
    "WeightsBucket",
    "WeightsByTransfer",
    "WeightsOnDisk",
    "WireDecoder",
    "WireError",
    "encode",
]

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
    | ScoreAsk
    | ScoreJob
    | ScoreResult
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
