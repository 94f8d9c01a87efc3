"""The buffer's side of reward scoring as a role of its own: reward servers
(``asyncrl.buffer.reward_server``, processes ``reward_K``) ask for work, and the buffer
hands each a batch of queued sequences (``asyncrl.wire.rewards``).

``RewardDispatch`` has the interface of the in-process ``RewardModelScorer`` (``submit``,
``poll``, ``pending``, ``counters``, ``close``), so ``Scoring`` uses either the same way.
It binds one ROUTER socket (``RUN_DIR/endpoints/rewards.json``) and is driven from the
buffer's event loop: ``poll`` takes what arrived, gives work to free servers and returns
the scores; it never waits.

Nothing submitted is lost or scored twice into the buffer. A batch is held against its
server until its answer comes. When the server leaves (``Leaving``: drained or stopped),
comes back as a new process (a ``ScoreAsk`` from a new incarnation), or stays silent past
``timeout_s``, its batches go back to the front of the queue for another server; an
answer that comes later for such a batch is dropped and counted (``late_results``).

Figures (through ``counters``, logged by the buffer as ``buffer/reward_model_*``): the
queue (sequences waiting for a server), sequences in service, servers known, the mean
latency from submit to score of the latest sequences and the servers' mean time on a
batch; scored, errors (scored 0), batches, batches sent again, the servers' busy seconds.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.transport import bind, close_context, read_endpoints, server_socket, write_endpoints
from asyncrl.wire import Leaving, ScoreAsk, ScoreJob, ScoreResult, WireDecoder, encode

DRAIN = 1000  # messages taken per poll, so a flood never holds the buffer's loop
LATENCY_WINDOW = 256  # sequences whose submit-to-score latency the mean is over


@dataclass
class _Queued:
    key: Hashable
    ids: list[int]
    submitted_at: float


@dataclass
class _Job:
    identity: bytes
    items: list[_Queued]
    sent_at: float


@dataclass
class _Server:
    """A reward server as the buffer knows it: by its socket identity."""

    worker_id: str
    incarnation: str
    seen_at: float
    jobs: set[str] = field(default_factory=set)


class RewardDispatch:
    """Queued sequences to reward servers, scores back (see the module docstring)."""

    def __init__(self, cfg: RolloutConfig) -> None:
        self.batch_size = cfg.reward.model_batch_size
        self.timeout_s = cfg.reward.model_timeout_s
        self.run_id = cfg.run_id
        self.ctx = zmq.Context()
        self.sock = server_socket(self.ctx, zmq.ROUTER, cfg.transport, cfg.run_dir)
        # A restarted reward server comes back under its identity: it takes the route over.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        before = read_endpoints(cfg.run_dir, "rewards", timeout_s=0) or {}
        endpoint = bind(self.sock, cfg.transport, cfg.run_dir, "rewards", before.get("jobs", ""))
        write_endpoints(cfg.run_dir, "rewards", {"jobs": endpoint})
        self.decoder = WireDecoder(cfg.run_id)
        self.token = f"{os.getpid()}-{time.time_ns()}"  # job ids never repeat across restarts
        self.next_job = 0
        self.queue: deque[_Queued] = deque()
        self.jobs: dict[str, _Job] = {}
        self.servers: dict[bytes, _Server] = {}
        self.free: deque[bytes] = deque()  # servers that asked and hold no batch
        self.results: list[tuple[Hashable, float]] = []
        self.outstanding = 0  # submitted and not yet returned by poll
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.service: deque[float] = deque(maxlen=LATENCY_WINDOW)  # servers' s per batch
        self.counts = {"scored": 0, "errors": 0, "batches": 0, "resent": 0, "late_results": 0}
        self.busy_s = 0.0  # the servers' time on answered batches, all together

    def submit(self, key: Hashable, ids: list[int]) -> None:
        """Queue ``ids`` (prompt + completion token ids); its score comes out of ``poll``
        under ``key``."""
        self.queue.append(_Queued(key, list(ids), time.monotonic()))
        self.outstanding += 1

    def poll(self) -> list[tuple[Hashable, float]]:
        """Take the servers' messages, send work to free servers, and return (key, score)
        of the sequences scored since the last call."""
        now = time.monotonic()
        for _ in range(DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:  # identity and one message, nothing else
                self.decoder.count("frames", f"rewards: {len(frames)} frames")
                continue
            identity, frame = frames
            message = self.decoder.try_decode(frame, "rewards")
            if message is not None:
                self._handle(identity, message, now)
        self._time_out(now)
        self._dispatch(now)
        results, self.results = self.results, []
        self.outstanding -= len(results)
        return results

    def pending(self) -> int:
        """Submitted sequences that ``poll`` has not yet returned."""
        return self.outstanding

    def counters(self) -> dict[str, float]:
        """The counts above, ``busy_s`` (the servers' seconds on answered batches: its rate
        over servers is their busy share), frames dropped by kind (``bad_frames_*``), and
        the gauges: ``queue``, ``in_service``,
        ``servers``, ``latency_s`` and ``service_s`` (means over the latest sequences and
        batches)."""
        out: dict[str, float] = dict(self.counts)
        out["busy_s"] = self.busy_s
        out.update({f"bad_frames_{k}": v for k, v in self.decoder.errors.items()})
        out["queue"] = len(self.queue)
        out["in_service"] = sum(len(job.items) for job in self.jobs.values())
        out["servers"] = len(self.servers)
        if self.latencies:
            out["latency_s"] = sum(self.latencies) / len(self.latencies)
        if self.service:
            out["service_s"] = sum(self.service) / len(self.service)
        return out

    def close(self) -> None:
        """Close the socket; whatever is queued or in service is dropped (the buffer's own
        state keeps those samples unscored, to score again when it starts again)."""
        self.sock.close(linger=0)
        close_context(self.ctx)

    def _handle(self, identity: bytes, message, now: float) -> None:
        if isinstance(message, ScoreAsk):
            server = self.servers.get(identity)
            if server is not None and server.incarnation != message.incarnation:
                self._take_back(identity)  # the process that held them is gone
                server = None
            if server is None:
                server = self.servers[identity] = _Server(
                    message.worker_id, message.incarnation, now
                )
            server.seen_at = now
            if not server.jobs and identity not in self.free:
                self.free.append(identity)
        elif isinstance(message, ScoreResult):
            self._answered(identity, message, now)
        elif isinstance(message, Leaving):
            self._take_back(identity)
        else:
            self.decoder.count("unexpected", f"rewards: {type(message).__name__}")

    def _answered(self, identity: bytes, result: ScoreResult, now: float) -> None:
        job = self.jobs.get(result.job_id)
        if job is None or job.identity != identity or len(result.scores) != len(job.items):
            self.counts["late_results"] += 1  # sent again already, or not ours: dropped
            return
        del self.jobs[result.job_id]
        server = self.servers.get(identity)
        if server is not None:
            server.jobs.discard(result.job_id)
            server.seen_at = now
        for item, score in zip(job.items, result.scores):
            good = score is not None and math.isfinite(score)
            self.counts["scored" if good else "errors"] += 1
            self.results.append((item.key, float(score) if good else 0.0))
            self.latencies.append(now - item.submitted_at)
        self.counts["batches"] += 1
        self.service.append(result.seconds)
        self.busy_s += result.seconds

    def _take_back(self, identity: bytes) -> None:
        """Every batch ``identity`` holds goes to the front of the queue, in order; the
        server is forgotten until it asks again."""
        server = self.servers.pop(identity, None)
        if identity in self.free:
            self.free.remove(identity)
        if server is None:
            return
        for job_id in sorted(server.jobs, reverse=True):
            job = self.jobs.pop(job_id)
            self.queue.extendleft(reversed(job.items))
            self.counts["resent"] += 1

    def _time_out(self, now: float) -> None:
        # A free server asks again every few seconds; a busy one answers within the
        # timeout of its batch's sending. Silent past it: dead or cut off.
        silent = [i for i, server in self.servers.items() if now - server.seen_at > self.timeout_s]
        for identity in silent:
            self._take_back(identity)

    def _dispatch(self, now: float) -> None:
        while self.free and self.queue:
            identity = self.free.popleft()
            n = min(self.batch_size, len(self.queue))
            items = [self.queue.popleft() for _ in range(n)]
            job_id = f"{self.token}-{self.next_job}"
            self.next_job += 1
            self.jobs[job_id] = _Job(identity, items, now)
            server = self.servers[identity]
            server.jobs.add(job_id)
            server.seen_at = now  # its time to answer counts from here
            job = ScoreJob(run_id=self.run_id, job_id=job_id, sequences=[i.ids for i in items])
            self.sock.send_multipart([identity, encode(job)])
