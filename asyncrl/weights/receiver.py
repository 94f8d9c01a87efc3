"""A generator's side of the bucketed weights: a mirror of the newest complete version.

``WeightsReceiver.accept`` takes the buckets in the order they arrive (one socket, so in
the order sent, some possibly dropped): an anchor's buckets overwrite the mirror, a
delta's are XORed into it, and each range is checked against its checksum. When a
version's last bucket lands, the caller gets a copy of the mirror as tensors (the engine
adopts them; the mirror goes on to the next delta). A delta whose base the mirror does
not hold, a missing bucket, a bad checksum or a version left half-received for
``timeout_s`` raise ``NeedAnchor``: the mirror is no longer trusted until an anchor has
rebuilt it, and the caller asks the trainer for one.
"""

from __future__ import annotations

import time

import torch

from asyncrl.weights.codec import Layout, apply_delta, check_layout, checksum
from asyncrl.wire import WeightsBucket


class NeedAnchor(Exception):
    """The mirror cannot take this bucket; the message says why."""


class WeightsReceiver:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.layout: Layout | None = None
        self.flat: torch.Tensor | None = None
        """The mirror, uint8 ``[layout.total]``."""
        self.lineage, self.version = "", -1
        """Whose weights and which version the mirror holds whole (-1: none it can trust)."""
        self.partial: WeightsBucket | None = None
        """The last bucket applied of a version not yet complete."""
        self.partial_since = 0.0
        self.waiting: str | None = "nothing received yet"
        """Why the mirror is not usable, while it waits for an anchor."""

    def accept(self, bucket: WeightsBucket, payload) -> tuple[int, dict] | None:
        """Apply one bucket; ``(version, tensors)`` once it completes a version."""
        if bucket.index == 0:
            if not self._start(bucket):
                return None
        elif not self._continues(bucket):
            return None
        try:
            self._apply(bucket, payload)
        except ValueError as e:
            self._fail(f"bucket {bucket.index} of v{bucket.version}: {e}")
        if bucket.index < bucket.count - 1:
            self.partial, self.partial_since = bucket, self.partial_since or time.monotonic()
            return None
        self.partial, self.partial_since, self.waiting = None, 0.0, None
        self.lineage, self.version = bucket.lineage, bucket.version
        return bucket.version, self.layout.views(self.flat.clone())

    def expire(self, now: float) -> None:
        """``NeedAnchor`` when a started version has been incomplete for ``timeout_s``."""
        if self.partial is not None and now - self.partial_since > self.timeout_s:
            p = self.partial
            self._fail(
                f"v{p.version} stalled: {p.index + 1} of {p.count} buckets in "
                f"{now - self.partial_since:.0f} s"
            )

    def trainer_is(self, lineage: str) -> None:
        """The trainer now running is ``lineage``: unless the mirror holds its weights or
        some are arriving, wait (and ask) for its anchor."""
        if lineage and lineage != self.lineage and self.partial is None and self.waiting is None:
            self.version, self.waiting = -1, f"a new trainer (lineage {lineage})"

    # ---- internals -----------------------------------------------------------------
    def _holds(self, bucket: WeightsBucket) -> bool:
        return bucket.lineage == self.lineage and bucket.version == self.version

    def _start(self, bucket: WeightsBucket) -> bool:
        if self._holds(bucket):
            return False  # an anchor sent again for others, or a duplicate: nothing new
        if bucket.kind == "anchor":
            try:
                check_layout(bucket.layout, bucket.total)
            except ValueError as e:
                self._fail(f"anchor v{bucket.version}'s layout: {e}")
            spans = tuple(bucket.layout)
            if self.layout is None or self.layout.spans != spans:
                self.layout = Layout(spans, bucket.total, bucket.itemsize)
                self.flat = torch.empty(bucket.total, dtype=torch.uint8)
            self.version = -1  # being overwritten
        elif self.waiting is not None:
            raise NeedAnchor(f"delta v{bucket.version} while {self.waiting}")
        elif bucket.lineage != self.lineage or bucket.base != self.version:
            self._fail(f"delta v{bucket.base}->v{bucket.version}, mirror holds v{self.version}")
        self.partial, self.partial_since = None, time.monotonic()
        return True

    def _continues(self, bucket: WeightsBucket) -> bool:
        p = self.partial
        if p is None and (self._holds(bucket) or self.waiting is not None):
            return False  # the rest of a version skipped above, or of one that failed
        same = p is not None and (p.lineage, p.version, p.kind) == (
            bucket.lineage,
            bucket.version,
            bucket.kind,
        )
        if not same or bucket.index != p.index + 1:
            have = f"bucket {p.index} of v{p.version}" if p is not None else "no version"
            self._fail(f"bucket {bucket.index} of v{bucket.version} after {have}")
        return True

    def _apply(self, bucket: WeightsBucket, payload) -> None:
        if self.layout is None or bucket.total != self.layout.total:
            have = "no layout" if self.layout is None else f"a layout of {self.layout.total}"
            raise ValueError(f"{bucket.total} bytes for {have}")
        if not 0 <= bucket.start < bucket.end <= bucket.total:
            raise ValueError(f"range {bucket.start}..{bucket.end} of {bucket.total}")
        target = self.flat[bucket.start : bucket.end]
        if bucket.kind == "anchor":
            if len(payload) != target.numel():
                raise ValueError(f"{len(payload)} bytes for a range of {target.numel()}")
            target.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        else:
            apply_delta(target, payload, bucket.itemsize, bucket.compressed)
        if checksum(target) != bucket.checksum:
            raise ValueError("checksum differs")

    def _fail(self, why: str) -> None:
        self.version, self.partial, self.partial_since, self.waiting = -1, None, 0.0, why
        raise NeedAnchor(why)
