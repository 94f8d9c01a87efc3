"""Trainer rank 0's side of the bucketed weights (``BucketPublisher``).

``publish`` starts a thread that reads the parameters (``FullParameters``: gathered one
at a time) into one of two staging buffers, cast to the wire dtype, and returns. The
sender thread, at a lower priority (``asyncrl.background``), sends each bucket as soon as
it is filled: an anchor (the bytes) for a lineage's first version, every ``anchor_every``
versions and when a generator asks; otherwise a delta against the other buffer, which
holds the previous version. The two buffers then swap roles. The trainer goes on
meanwhile; its next optimizer step waits until the parameters have been read
(``asyncrl.trainer.readout``). A ``publish`` that finds the sender still on the previous
version waits for it, at most ``timeout_s``, and then fails saying which bucket it was
stuck on.

Generators ask for an anchor on a PULL socket (``AnchorRequest``); requests that arrive
together are answered by one anchor of the newest version sent. The PUB socket keeps at
most two versions of buckets per subscriber: one that stops reading (a frozen process)
loses buckets instead of holding the trainer or its memory, and asks for an anchor once
it runs again.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import zmq

from asyncrl.background import yield_cpu
from asyncrl.interfaces import FullParameters
from asyncrl.transport import RunSite, bind, close_context, server_socket, write_endpoints
from asyncrl.weights.codec import Layout, checksum, encode_delta
from asyncrl.wire import AnchorRequest, WeightsBucket, WireDecoder, encode

log = logging.getLogger(__name__)


def new_lineage() -> str:
    """An id for this trainer process's weights (see ``WeightsBucket.lineage``)."""
    return f"{os.getpid()}-{time.time_ns()}"


class BucketPublisher:
    def __init__(self, site: RunSite) -> None:
        self.site, self.wcfg = site, site.transport.weights
        self.bucket_bytes = self.wcfg.bucket_mb << 20
        self.lineage = new_lineage()
        self.ctx = zmq.Context()
        self.pub = self.pull = None  # bound at the first publish, once the layout is known
        self.layout: Layout | None = None
        self.flats: list[torch.Tensor] = []
        self.cond = threading.Condition()
        self.job: tuple[int, int, FullParameters] | None = None  # version, buffer, source
        self.filled = 0  # bytes of the job's buffer read so far (by the filler thread)
        self.fill_error: BaseException | None = None
        self.sent: tuple[int, int] | None = None  # (version, buffer) sent last
        self.progress = ""  # what the sender is doing, for a timeout's message
        self.deltas_since_anchor = 0
        self.anchor_wanted = False
        self.anchors_requested = 0
        self.closed = False
        self.failed: BaseException | None = None  # the sender thread's end, if it crashed
        self.history: list[dict] = []
        """Per version sent: ``version``, ``kind``, ``bytes`` (payloads), ``full_bytes``,
        ``encode_s`` (the thread's encoding time), ``send_s`` (its first bucket to its last)."""
        self.thread = threading.Thread(target=self._guarded, name="weights-sender", daemon=True)

    # ---- the trainer's side ----------------------------------------------------------
    def publish(self, version: int, params: FullParameters) -> float:
        start = time.perf_counter()
        if self.layout is None:
            self._open(params)
        self._wait_idle()
        slot = 0 if self.sent is None else 1 - self.sent[1]
        with self.cond:
            self.filled, self.fill_error = 0, None
            self.job = (version, slot, params)
            self.cond.notify_all()
        # Started here, at the trainer's priority: the next optimizer step waits for this
        # read, while the encoding and sending run niced on the sender's thread.
        read = threading.Thread(target=self._fill, args=(slot, params), name="weights-read")
        read.daemon = True  # a read stuck in a gather must not hold the interpreter at exit
        read.start()
        return time.perf_counter() - start

    def republish(self) -> None:
        """Nothing: a generator that joined since asks for an anchor itself."""

    def wait_sent(self) -> None:
        """Block until the last published version has gone out (benchmarks, tests)."""
        self._wait_idle()

    def close(self) -> None:
        if self.layout is not None and self.failed is None:
            try:
                self._wait_idle()  # the last version is gathered by every rank: finish it
            except TimeoutError as e:
                log.warning("closing with a version unsent: %s", e)
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=self.wcfg.timeout_s)
        close_context(self.ctx, linger=1000)

    def _open(self, params: FullParameters) -> None:
        dtype = None if self.wcfg.dtype == "train" else getattr(torch, self.wcfg.dtype)
        specs = [(name, dtype or d, shape) for name, d, shape in params.specs]
        self.layout = Layout.of(specs)
        # Zeros: the alignment padding is sent too, and must not carry stale memory.
        self.flats = [torch.zeros(self.layout.total, dtype=torch.uint8) for _ in range(2)]
        buckets = len(self.layout.ranges(self.bucket_bytes))
        t, run_dir = self.site.transport, self.site.run_dir
        self.pub = server_socket(self.ctx, zmq.PUB, t, run_dir)
        # Two versions' worth per subscriber: past that a stalled one loses buckets.
        self.pub.setsockopt(zmq.SNDHWM, 2 * buckets + 4)
        self.pull = server_socket(self.ctx, zmq.PULL, t, run_dir)
        endpoints = {
            "weights": bind(self.pub, t, run_dir, "trainer-weights"),
            "anchors": bind(self.pull, t, run_dir, "trainer-anchors"),
            # A restarted trainer binds the same ipc paths: the lineage tells generators
            # that the anchor it sent while they reconnected was probably lost.
            "lineage": self.lineage,
        }
        write_endpoints(run_dir, "trainer", endpoints)
        self.thread.start()

    def _wait_idle(self) -> None:
        with self.cond:
            if not self.cond.wait_for(
                lambda: self.job is None or self.failed is not None, self.wcfg.timeout_s
            ):
                raise TimeoutError(
                    f"the weights sender has not finished v{self.job[0]} in "
                    f"{self.wcfg.timeout_s:.0f} s (transport.weights.timeout_s): {self.progress}"
                )
            if self.failed is not None:
                raise RuntimeError(f"the weights sender failed: {self.failed!r}")

    # ---- the sender thread -----------------------------------------------------------
    def _guarded(self) -> None:
        yield_cpu()  # encoding and sending: what generators decode beside, on shared cores
        try:
            self._run()
        except BaseException as e:  # publish raises it: the trainer never waits on a dead thread
            log.exception("the weights sender failed")
            if self.job is not None and hasattr(self.job[2].tensors, "close"):
                self.job[2].tensors.close()  # marks the readout done: no step waits on it
            with self.cond:
                self.failed = e
                self.cond.notify_all()

    def _run(self) -> None:
        decoder = WireDecoder(self.site.run_id, expected=AnchorRequest)
        while True:
            while self.pull.poll(0):
                request = decoder.try_decode(self.pull.recv(), "anchor requests")
                if request is not None:
                    log.info("%s asks for an anchor: %s", request.worker_id, request.why)
                    self.anchor_wanted = True
                    self.anchors_requested += 1
            with self.cond:
                self.cond.wait_for(lambda: self.closed or self.job is not None, 0.1)
                if self.closed:
                    return
                job = self.job
            if job is not None:
                self._send(*job)
                with self.cond:
                    self.sent, self.job = job[:2], None
                    self.cond.notify_all()
            elif self.anchor_wanted and self.sent is not None:
                self.anchor_wanted = False
                self._send(*self.sent)

    def _send(self, version: int, slot: int, params: FullParameters | None = None) -> None:
        """Send version ``version``: a new one read from ``params`` into buffer ``slot`` (a
        delta unless an anchor is due), or without ``params`` the last one again, whole."""
        anchor = params is None or self._anchor_due()
        record = {"version": version, "kind": "anchor" if anchor else "delta", "bytes": 0}
        record |= {"full_bytes": 0, "encode_s": 0.0, "send_s": time.perf_counter()}
        base = version if anchor else self.sent[0]
        ranges = self.layout.ranges(self.bucket_bytes)
        for index, (start, end) in enumerate(ranges):
            self.progress = f"v{version}: bucket {index + 1} of {len(ranges)}"
            # A version sent again is in its buffer already; a new one waits for the read.
            if params is not None and not self._wait_read(version, end):
                return  # closed while reading: the version is not sent
            head = (version, base, index, len(ranges), start, end)
            self._send_bucket(record, slot, anchor, *head)
        record["send_s"] = time.perf_counter() - record["send_s"]
        self.history.append(record)
        self.progress = f"v{version} sent"

    def _wait_read(self, version: int, end: int) -> bool:
        """Wait until the read has filled the buffer up to ``end``; False if closed first."""
        with self.cond:
            self.cond.wait_for(lambda: self.filled >= end or self.fill_error or self.closed)
            if self.fill_error is not None:
                raise RuntimeError(f"reading v{version}'s parameters failed") from self.fill_error
            return self.filled >= end

    def _anchor_due(self) -> bool:
        every = self.wcfg.anchor_every
        anchor = self.sent is None or self.anchor_wanted or self.deltas_since_anchor + 1 >= every
        self.deltas_since_anchor = 0 if anchor else self.deltas_since_anchor + 1
        self.anchor_wanted = self.anchor_wanted and not anchor  # it answers every request
        return anchor

    def _fill(self, slot: int, params: FullParameters) -> None:
        """Copy ``params`` into buffer ``slot``, moving ``filled`` on after each tensor
        (``fill_error`` if the read fails)."""
        views = self.layout.views(self.flats[slot])
        spans = iter(self.layout.spans)
        try:
            for name, tensor in params.tensors:
                span = next(spans)
                if span.name != name:
                    raise ValueError(f"parameter {name!r} where the layout has {span.name!r}")
                views[name].copy_(tensor.reshape(span.shape))  # casts to the wire dtype
                with self.cond:
                    self.filled = span.offset + views[name].nbytes
                    self.cond.notify_all()
            missing = next(spans, None)
            if missing is not None:
                raise ValueError(f"the parameters ended before {missing.name!r}")
            with self.cond:
                self.filled = self.layout.total  # the tail's alignment padding is zeros
                self.cond.notify_all()
        except BaseException as e:
            if hasattr(params.tensors, "close"):
                params.tensors.close()  # marks the readout done: no step waits on it
            with self.cond:
                self.fill_error = e
                self.cond.notify_all()

    def _send_bucket(self, record, slot, anchor, version, base, index, count, start, end):
        began = time.perf_counter()
        new = self.flats[slot][start:end]
        header = WeightsBucket(
            run_id=self.site.run_id,
            version=version,
            lineage=self.lineage,
            kind="anchor" if anchor else "delta",
            base=base,
            index=index,
            count=count,
            start=start,
            end=end,
            total=self.layout.total,
            checksum=checksum(new),
            itemsize=self.layout.itemsize,
            compressed=not anchor and self.wcfg.compress_level > 0,
            layout=list(self.layout.spans) if anchor and index == 0 else [],
        )
        if anchor:
            payload = new.numpy().tobytes()  # the buffer is reused: zmq gets its own bytes
        else:
            old = self.flats[self.sent[1]][start:end]
            payload = encode_delta(new, old, self.layout.itemsize, self.wcfg.compress_level)
        record["encode_s"] += time.perf_counter() - began
        record["bytes"] += len(payload)
        record["full_bytes"] += end - start
        self.pub.send_multipart([encode(header), payload], copy=False)
