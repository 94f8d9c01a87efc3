"""The messages between the trainer and the generators about weights: versions sent as
buckets (or one whole state), on disk, or by a server's own transfer; a generator's asks
for an anchor or a transfer; and the flip probe's report (``asyncrl.wire`` lists who sends
which). Tensors themselves never go through msgpack: ``asyncrl.weights.frames`` sends them
as raw frames after one of these headers."""

from __future__ import annotations

from typing import Literal

import msgspec

from asyncrl.wire.base import Message


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
