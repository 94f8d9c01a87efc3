"""What a weights bucket carries, and the flat layout buckets are cut from.

A version is one flat byte buffer: every parameter in the sender's order, each at an
offset aligned to ``ALIGN`` bytes, in the wire dtype (``Layout``). Buckets are its
consecutive ``bucket_bytes`` ranges. An anchor bucket is the range's bytes; a delta
bucket is their XOR with the same range of the previous version, byte-shuffled (all
first bytes of each element, then all second bytes, …: the sign, exponent and high
mantissa bytes of a small update XOR to zero and line up into long zero runs) and
zlib-compressed. Either way the bucket's checksum is that of the range's bytes in the
new version, so the receiver checks what it rebuilt, not what travelled.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.wire import TensorSpan

ALIGN = 64
"""Byte alignment of each tensor (and of every bucket boundary): any dtype's view of an
aligned range is valid, and XOR runs over 8-byte words."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    spans: tuple[TensorSpan, ...]
    total: int
    """Bytes of the flat buffer (a multiple of ``ALIGN``)."""
    itemsize: int
    """Element size the delta's byte shuffle uses: the wire dtype's when every tensor has
    it, else 1 (no shuffle)."""

    @classmethod
    def of(cls, tensors: list[tuple[str, torch.dtype, torch.Size]]) -> Layout:
        spans, offset = [], 0
        for name, dtype, shape in tensors:
            spans.append(TensorSpan(name, str(dtype).removeprefix("torch."), list(shape), offset))
            offset += _aligned(shape.numel() * dtype.itemsize)
        sizes = {dtype.itemsize for _, dtype, _ in tensors}
        return cls(tuple(spans), max(offset, ALIGN), sizes.pop() if len(sizes) == 1 else 1)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of a flat uint8 buffer ``[total]``, as views of it."""
        out = {}
        for span in self.spans:
            dtype = getattr(torch, span.dtype)
            numel = int(np.prod(span.shape, dtype=np.int64))
            raw = flat[span.offset : span.offset + numel * dtype.itemsize]
            out[span.name] = raw.view(dtype).view(span.shape)
        return out

    def ranges(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each bucket."""
        step = _aligned(bucket_bytes)
        return [(s, min(s + step, self.total)) for s in range(0, self.total, step)]


def check_layout(spans: list[TensorSpan], total: int) -> None:
    """A received layout must stay inside its buffer and name each tensor once."""
    names = set()
    for span in spans:
        dtype = getattr(torch, span.dtype, None)
        if not isinstance(dtype, torch.dtype) or span.offset % ALIGN:
            raise ValueError(f"{span.name}: dtype {span.dtype!r} at offset {span.offset}")
        end = span.offset + int(np.prod(span.shape, dtype=np.int64)) * dtype.itemsize
        if min(span.shape, default=0) < 0 or end > total or span.name in names:
            raise ValueError(f"{span.name}: shape {span.shape} at {span.offset} in {total} bytes")
        names.add(span.name)


def checksum(data: torch.Tensor) -> int:
    """CRC-32 of a uint8 tensor's bytes."""
    return zlib.crc32(data.numpy())


def _words(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.int64) if data.numel() % 8 == 0 else data


def xor_into(target: torch.Tensor, other: torch.Tensor) -> None:
    """``target ^= other`` for uint8 tensors of one length, a word at a time."""
    _words(target).bitwise_xor_(_words(other))


def shuffle(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    if itemsize == 1:
        return data
    return data.view(-1, itemsize).t().contiguous().view(-1)


def unshuffle(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    if itemsize == 1:
        return data
    return data.view(itemsize, -1).t().contiguous().view(-1)


def encode_delta(new: torch.Tensor, old: torch.Tensor, itemsize: int, level: int) -> bytes:
    """The payload of a delta bucket: ``new ^ old`` shuffled, compressed at ``level``."""
    diff = new.clone()
    xor_into(diff, old)
    shuffled = shuffle(diff, itemsize).numpy()
    return zlib.compress(shuffled, level) if level else shuffled.tobytes()


def apply_delta(target: torch.Tensor, payload, itemsize: int, compressed: bool) -> None:
    """XOR a delta bucket's payload into ``target`` (the previous version's range).
    ``ValueError`` when the payload does not decompress to the range's size."""
    try:
        # Bounded: a corrupt or hostile payload never inflates past the range.
        raw = (
            zlib.decompressobj().decompress(payload, target.numel() + 1)
            if compressed
            else bytes(payload)
        )
    except zlib.error as e:
        raise ValueError(f"delta does not decompress: {e}") from None
    if len(raw) != target.numel():
        raise ValueError(f"delta of {len(raw)} bytes for a range of {target.numel()}")
    diff = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    xor_into(target, unshuffle(diff, itemsize))
