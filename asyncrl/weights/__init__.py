"""Weights from the trainer to the generators' embedded engines, in buckets, by deltas
(docs/design.md, Weights without stopping generation).

- ``config``: ``WeightSyncConfig`` (``transport.weights``): dtype on the wire, bucket size,
  how often a full anchor goes out, compression, the timeout.
- ``codec``: the flat layout every version is cut from, and what a bucket carries: the
  bytes themselves (an anchor) or their XOR against the previous version, byte-shuffled
  and compressed (a delta), with a checksum of the result.
- ``sender``: trainer rank 0. ``publish`` copies the parameters, as they are gathered,
  into a staging buffer; a thread encodes and sends the buckets while training goes on,
  and answers generators that ask for an anchor.
- ``receiver``: a generator's mirror of the last complete version. Anchors overwrite it,
  deltas are XORed into it, each bucket checked; a gap or a bad checksum empties it and
  asks for an anchor. A complete version is handed to the engine's staging.
"""
