"""Leases that suit long generations: a lease is taken back when its holder is silent
(presumed dead), stuck behind a lost chunk, or alive without progress for
``progress_timeout_s``, never for its total length. A live holder is told
(``LeaseRevoked``) and aborts the request in its engine; tokens that still arrive for
such a lease are counted as ``tokens_revoked_alive``.

Unit tests drive ``LeaseTable`` through the ``Journal`` with a simulated clock; the
socket tests run a real ``BufferServer`` in a thread, with the test as the generator or
with a ``GeneratorWorker`` over a fake engine that gets stuck on its first request.

Why one file: one mechanism, lease ownership, from the table's rules under a simulated clock
to the buffer and a generator over real sockets.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
import zlib

import msgspec
import pytest
import zmq

from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring, buffer_counters
from asyncrl.buffer.server import BufferServer
from asyncrl.buffer.wal import Journal, Revoked, frame, read_events, replay
from asyncrl.config import ConfigError, apply_overrides, from_dict
from asyncrl.engine.base import EngineStatus, Finished, GeneratedToken, Request, StepOutput
from asyncrl.engine.leases import SamplingConfig
from asyncrl.generator.worker import GeneratorWorker
from asyncrl.metrics import MetricsConfig
from asyncrl.transport import TransportConfig, make_socket, read_endpoints
from asyncrl.wire import Chunk, LeaseRequest, LeaseRevoked, SamplingSpec, WireDecoder, encode
from tests.runs import wait_for


def _prompts(position: int) -> tuple[int, list[int]]:
    return position, [3, 4, 5]


def _buffer(**cfg_fields) -> RolloutBuffer:
    cfg = BufferConfig(prompts_per_batch=1, samples_per_prompt=1, max_staleness=None, **cfg_fields)
    return RolloutBuffer(cfg, "run", _prompts, SamplingSpec(max_new_tokens=64))


def _chunk(lease_id: str, seq: int, tokens: list[int], worker: str = "g0", done=False) -> Chunk:
    return Chunk(
        run_id="run",
        worker_id=worker,
        lease_id=lease_id,
        seq=seq,
        token_ids=tokens,
        logprobs=[-1.0] * len(tokens),
        versions=[0] * len(tokens),
        finished=done,
        finish_reason="length" if done else None,
    )


class _Log(list):
    """The Journal's write-ahead log, in memory."""

    def append(self, event) -> None:
        super().append(frame(event))


@pytest.mark.parametrize(("eta", "expected"), [(None, [-1, -1]), (0, [5, 7]), (2, [3, 5])])
def test_a_lease_names_the_oldest_weights_it_may_start_under(eta, expected):
    """The trainer's version less η at the issue: older tokens would be too stale."""
    cfg = BufferConfig(prompts_per_batch=1, samples_per_prompt=1, max_staleness=eta)
    buffer = RolloutBuffer(cfg, "run", _prompts, SamplingSpec(max_new_tokens=64))
    journal, got = Journal(buffer), []
    for version in (5, 7):
        journal.version(version)
        got += [lease.min_version for lease in journal.lease("g0", 1, 0.0)]
    assert got == expected


def test_a_slow_but_alive_holder_keeps_its_lease():
    """30 minutes of heartbeats every 5 s and a chunk every 240 s (the first after 250 s
    in its engine's queue): far past any fixed lease timeout of a few minutes, and past
    ``progress_timeout_s`` counted from the issue; the lease is never taken back and the
    sample finishes with every token."""
    buffer = _buffer(progress_timeout_s=300.0)
    journal = Journal(buffer)
    [lease] = journal.lease("g0", 1, 0.0)
    t, seq, next_chunk = 0.0, 0, 250.0
    while t < 1800.0:
        t += 5.0
        buffer.leases.on_heartbeat("g0", t)
        if t >= next_chunk:
            journal.chunk(_chunk(lease.lease_id, seq, [7, 8]), t)
            seq, next_chunk = seq + 1, next_chunk + 240.0
        assert journal.expire(t) == {}, f"taken back at t={t}"
    journal.chunk(_chunk(lease.lease_id, seq, [9], done=True), t)
    [slot] = buffer.state.groups[lease.group_id].slots
    assert slot.token_ids == [7, 8] * seq + [9] and slot.finish_reason == "length"
    assert buffer.state.counts["leases_reissued"] == 0


def test_a_silent_holder_loses_its_lease_and_the_next_holder_continues_from_its_tokens():
    """No heartbeat for ``heartbeat_timeout_s``: presumed dead, nobody is told, and its
    late chunks (it was not dead after all) are not counted as revoked-alive waste."""
    buffer = _buffer(heartbeat_timeout_s=10.0)
    journal = Journal(buffer)
    [lease] = journal.lease("g0", 1, 0.0)
    journal.chunk(_chunk(lease.lease_id, 0, [5, 6]), 1.0)
    assert journal.expire(11.0) == {}  # 10 s silent: not yet
    assert journal.expire(11.5) == {}  # taken back, and nobody to tell
    assert lease.lease_id not in buffer.leases.active
    counts = buffer.state.counts
    assert counts["leases_revoked_holder_silent"] == counts["leases_reissued"] == 1
    [again] = journal.lease("g1", 1, 12.0)
    assert (again.group_id, again.sample_index) == (lease.group_id, lease.sample_index)
    assert again.lease_id != lease.lease_id and again.prefix_ids == [5, 6]
    journal.chunk(_chunk(lease.lease_id, 1, [9, 9, 9]), 12.0)  # the old holder, late
    assert counts["chunks_unknown_lease"] == 1 and counts["tokens_revoked_alive"] == 0


def test_a_live_holder_without_progress_loses_its_lease_and_is_told():
    """Heartbeats keep coming but no chunk for ``progress_timeout_s`` after the last one:
    taken back, its holder named for a ``LeaseRevoked``, the sample re-leased with its
    prefix; the tokens the holder still sends for it are counted."""
    buffer = _buffer(progress_timeout_s=300.0)
    journal = Journal(buffer)
    [lease] = journal.lease("g0", 1, 0.0)
    journal.chunk(_chunk(lease.lease_id, 0, [5, 6]), 10.0)
    for t in range(15, 315, 5):
        buffer.leases.on_heartbeat("g0", float(t))
        assert journal.expire(float(t)) == {}, f"taken back at t={t}"
    assert journal.expire(310.5) == {"g0": [lease.lease_id]}
    counts = buffer.state.counts
    assert counts["leases_revoked_no_progress"] == 1 and counts["tokens_revoked_alive"] == 0
    journal.chunk(_chunk(lease.lease_id, 1, [7, 8, 9]), 311.0)  # sent before it heard
    assert counts["tokens_revoked_alive"] == 3
    [again] = journal.lease("g0", 1, 312.0)
    assert again.prefix_ids == [5, 6]


def test_a_restarted_holder_loses_its_old_leases_at_once_and_keeps_its_new_ones():
    """A generator restarted under the same worker id heartbeats again within the timeout,
    so its dead process's leases would wait ``progress_timeout_s``; its new incarnation
    takes them back at the next ``expire``, nobody told, tokens kept as the prefix."""
    buffer = _buffer(heartbeat_timeout_s=10.0, progress_timeout_s=300.0)
    journal = Journal(buffer)
    buffer.leases.on_incarnation("g0", "pid1")
    [old] = journal.lease("g0", 1, 0.0)
    journal.chunk(_chunk(old.lease_id, 0, [5, 6]), 1.0)
    buffer.leases.on_incarnation("g0", "pid1")  # the same process: nothing happens
    assert journal.expire(2.0) == {}
    buffer.leases.on_incarnation("g0", "pid2")  # its first message after the restart
    buffer.leases.on_heartbeat("g0", 3.0)
    [new] = journal.lease("g0", 1, 3.0)  # answered before the next expire
    assert journal.expire(3.1) == {}  # taken back, and nobody to tell
    assert old.lease_id not in buffer.leases.active and new.lease_id in buffer.leases.active
    assert buffer.state.counts["leases_revoked_holder_restarted"] == 1
    [again] = journal.lease("g0", 1, 4.0)
    assert again.prefix_ids == [5, 6] and again.group_id == old.group_id
    assert journal.expire(5.0) == {} and new.lease_id in buffer.leases.active


def test_a_lease_its_live_holder_stops_listing_is_taken_back_with_its_tokens():
    """A buffer that died after journalling a lease's chunk but before the last one came
    (the holder sent it to the dead process) would wait ``progress_timeout_s`` for a
    sample its holder thinks finished. The holder's heartbeats list the leases it holds:
    one it no longer lists, ``heartbeat_timeout_s`` after its issue, is taken back (nobody
    told) and issued again from its tokens; one just issued, or listed, is left alone."""
    buffer = _buffer(heartbeat_timeout_s=2.0, progress_timeout_s=300.0)
    journal = Journal(buffer)
    [lost, kept] = journal.lease("g0", 2, 0.0)
    journal.chunk(_chunk(lost.lease_id, 0, [5, 6]), 0.5)
    buffer.leases.on_heartbeat("g0", 1.0, 0, [kept.lease_id])  # too soon to judge
    assert journal.expire(1.0) == {}
    buffer.leases.on_heartbeat("g0", 2.5, 0, [kept.lease_id])
    assert journal.expire(2.5) == {}  # taken back, and nobody to tell
    assert lost.lease_id not in buffer.leases.active and kept.lease_id in buffer.leases.active
    assert buffer.state.counts["leases_revoked_not_held"] == 1
    [again] = journal.lease("g0", 1, 3.0)
    assert again.group_id == lost.group_id and again.prefix_ids == [5, 6]
    buffer.leases.on_heartbeat("g0", 4.0, 0, [kept.lease_id])  # the new one not listed yet
    assert journal.expire(4.0) == {} and again.lease_id in buffer.leases.active
    buffer.leases.on_heartbeat("g0", 9.0)  # a heartbeat with no list keeps the last one
    assert journal.expire(9.0) == {} and kept.lease_id in buffer.leases.active


def test_a_lease_stuck_behind_a_lost_chunk_is_taken_back_and_its_holder_told():
    buffer = _buffer(gap_timeout_s=5.0)
    journal = Journal(buffer)
    [lease] = journal.lease("g0", 1, 0.0)
    journal.chunk(_chunk(lease.lease_id, 0, [5]), 1.0)
    journal.chunk(_chunk(lease.lease_id, 2, [7]), 2.0)  # seq 1 was lost
    buffer.leases.on_heartbeat("g0", 7.5)
    assert journal.expire(7.5) == {"g0": [lease.lease_id]}
    assert buffer.state.counts["leases_revoked_gap"] == 1
    assert journal.lease("g1", 1, 8.0)[0].prefix_ids == [5]  # what came before the gap


def test_tokens_revoked_alive_stays_zero_without_stalls():
    """Samples that finish, and a holder that dies: nothing counted, yet the counter is
    logged (at 0) from the start."""
    buffer = _buffer(heartbeat_timeout_s=10.0)
    journal = Journal(buffer)
    assert (
        buffer_counters(buffer, InlineScoring(lambda *_: 0.0))["buffer/tokens_revoked_alive"] == 0
    )
    t = 0.0
    for _ in range(5):
        for lease in journal.lease("g0", 1, t):
            journal.chunk(_chunk(lease.lease_id, 0, [5, 6]), t + 1)
            journal.chunk(_chunk(lease.lease_id, 1, [7], done=True), t + 2)
        t += 3.0
        buffer.leases.on_heartbeat("g0", t)
        assert journal.expire(t) == {}
    [lease] = journal.lease("g1", 1, t)  # g1 streams once, then dies
    journal.chunk(_chunk(lease.lease_id, 0, [5], worker="g1"), t)
    journal.expire(t + 20.0)
    journal.chunk(_chunk(lease.lease_id, 1, [6], worker="g1"), t + 21.0)
    counts = buffer.state.counts
    assert counts["leases_reissued"] == 1 and counts["tokens_revoked_alive"] == 0


def test_a_replay_gives_the_same_state_and_tells_nobody():
    """Revocations are logged with their reasons: replayed, they give the same state and
    counters (the replay calls ``revoke`` and has no socket to tell anyone through); a
    record without reasons still reads."""
    buffer, log = _buffer(progress_timeout_s=1.0), _Log()
    journal = Journal(buffer, log)
    [lease] = journal.lease("g0", 1, 0.0)
    journal.chunk(_chunk(lease.lease_id, 0, [5]), 0.5)
    buffer.leases.on_heartbeat("g0", 2.0)
    assert journal.expire(2.0) == {"g0": [lease.lease_id]}
    journal.chunk(_chunk(lease.lease_id, 1, [6, 7]), 2.1)
    fresh = _buffer(progress_timeout_s=1.0)
    assert replay(fresh, b"".join(log)) == len(log)
    assert fresh.save() == buffer.save()
    assert fresh.state.counts["tokens_revoked_alive"] == 2
    body = msgspec.msgpack.encode(["Revoked", ["run:9"]])
    record = struct.pack("<II", len(body), zlib.crc32(body)) + body
    assert list(read_events(record)) == [Revoked(["run:9"], [])]


def test_an_override_of_the_old_lease_timeout_names_its_replacement(tmp_path):
    with pytest.raises(ConfigError, match="buffer.progress_timeout_s"):
        apply_overrides(RolloutConfig(), ["buffer.lease_timeout_s=600"])
    with pytest.raises(ConfigError, match="progress_timeout_s"):
        from_dict(BufferConfig, {"lease_timeout_s": 120.0})


# ---- over sockets ------------------------------------------------------------------


def _config(tmp_path) -> RolloutConfig:
    return RolloutConfig(
        run_dir=str(tmp_path),
        run_id="run",
        buffer=BufferConfig(
            prompts_per_batch=1,
            samples_per_prompt=1,
            max_staleness=0,
            heartbeat_timeout_s=60.0,
            progress_timeout_s=2.0,  # well above a step of the fake engine on a busy machine
        ),
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.0),
        transport=TransportConfig(chunk_tokens=1, chunk_ms=10.0, heartbeat_s=0.1),
        metrics=MetricsConfig(tensorboard=False, progress_bar=False, interval_s=60.0),
    )


def _serve(cfg: RolloutConfig, version: int = 0) -> tuple[BufferServer, threading.Thread]:
    """A buffer server on its own thread, its trainer at ``version``."""
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, _prompts, cfg.sampling.spec())
    buffer.batches.set_version(version)
    server = BufferServer(cfg, buffer, InlineScoring(lambda *_: 1.0))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return server, thread


@contextlib.contextmanager
def _generating(cfg: RolloutConfig, engine, version: int = 0):
    """A buffer server and a real generator loop over ``engine``, both stopped after."""
    server, thread = _serve(cfg, version)
    worker = GeneratorWorker(cfg, "g0", engine)
    generating = threading.Thread(target=worker.run, daemon=True)
    generating.start()
    try:
        yield server, worker
    finally:
        worker.stop()
        generating.join(timeout=30)
        server.stop()
        thread.join(timeout=30)


def test_the_buffer_tells_a_live_holder_and_again_when_it_streams_into_the_lease(tmp_path):
    """The test is the generator: one chunk, then nothing for the lease. The buffer sends
    ``LeaseRevoked`` on the leases socket; a chunk sent after that is counted and answered
    with another ``LeaseRevoked``."""
    cfg = _config(tmp_path)
    server, thread = _serve(cfg)
    ctx, decoder = zmq.Context(), WireDecoder("run")
    try:
        ends = read_endpoints(tmp_path, "buffer", timeout_s=60)
        dealer = make_socket(ctx, zmq.DEALER, cfg.transport, identity="g0")
        push = make_socket(ctx, zmq.PUSH, cfg.transport)
        dealer.connect(ends["leases"])
        push.connect(ends["chunks"])
        dealer.send(encode(LeaseRequest(run_id="run", worker_id="g0", capacity=1)))
        assert dealer.poll(30_000)
        [lease] = decoder.decode(dealer.recv()).leases
        push.send(encode(_chunk(lease.lease_id, 0, [5, 6])))
        told = []
        for _ in range(2):
            assert dealer.poll(30_000), "no LeaseRevoked"
            told.append(decoder.decode(dealer.recv()))
            push.send(encode(_chunk(lease.lease_id, 1 + len(told), [7, 8, 9])))
        wait_for(
            lambda: server.buffer.state.counts["tokens_revoked_alive"] == 6,
            30,
            "the count",
            poll_s=0.02,
        )
    finally:
        server.stop()
        thread.join(timeout=30)
        ctx.destroy(linger=0)
    assert told == [LeaseRevoked(run_id="run", worker_id="g0", lease_ids=[lease.lease_id])] * 2
    counts = server.buffer.state.counts
    assert counts["leases_revoked_no_progress"] == 1 and counts["tokens_received"] == 2


class _StuckFirstEngine:
    """A fake engine: one token per running request per step; its first request stops
    after two tokens and never finishes (a request stuck in the engine), the others run
    to their budget."""

    def __init__(self) -> None:
        self.running: dict[str, list[int]] = {}  # request id -> [tokens left, until stuck]
        self.submitted: list[Request] = []
        self.aborted: list[str] = []
        self._finished: list[Finished] = []

    def submit(self, request: Request) -> None:
        stuck_after = 2 if not self.submitted else -1
        self.submitted.append(request)
        self.running[request.request_id] = [request.params.max_new_tokens, stuck_after]

    def step(self) -> StepOutput:
        time.sleep(0.005)
        tokens, finished, self._finished = [], self._finished, []
        for rid, state in list(self.running.items()):
            if state[1] == 0:
                continue  # stuck
            tokens.append(GeneratedToken(rid, 10 + state[0], -0.5, 0))
            state[0], state[1] = state[0] - 1, state[1] - 1
            if state[0] == 0:
                del self.running[rid]
                finished.append(Finished(rid, "length", 0))
        return StepOutput(tokens, finished, 0)

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)
            self._finished.append(Finished(request_id, "abort", 0))

    def stage_weights(self, weights, version: int, *, wait: bool = False) -> None:
        pass

    def status(self) -> EngineStatus:
        n = len(self.running)
        return EngineStatus(n, 0, 2 - n, 0, -1, 0, None)

    def close(self) -> None:
        pass


def test_a_generator_aborts_a_lease_taken_back_for_no_progress(tmp_path):
    """A real generator loop over an engine whose first request gets stuck after two
    tokens: the buffer takes the lease back after ``progress_timeout_s``, the generator
    aborts the request in its engine and drops it, and gets the sample again with those
    two tokens as its prefix; the sample completes with nothing wasted."""
    engine = _StuckFirstEngine()
    with _generating(_config(tmp_path), engine) as (server, worker):
        wait_for(
            lambda: len(server.buffer.state.ready) == 1, 60, "the sample to complete", poll_s=0.02
        )
    first, second = engine.submitted
    assert engine.aborted == [first.request_id] and worker.leases_aborted == 1
    assert not worker.pending
    assert second.prompt_ids == first.prompt_ids + [16, 15]  # the stuck request's two tokens
    [group] = server.buffer.state.groups.values()
    assert group.slots[0].token_ids == [16, 15, 14, 13, 12, 11]
    counts = server.buffer.state.counts
    assert counts["leases_revoked_no_progress"] == 1 and counts["tokens_revoked_alive"] == 0


class _WeightsLateEngine(_StuckFirstEngine):
    """A fake engine at weights version 0 that flips, at its next step, to whatever the
    test stages; records the version each request was submitted under."""

    def __init__(self) -> None:
        super().__init__()
        self.version, self.staged = 0, -1
        self.versions_at_submit: list[int] = []

    def submit(self, request: Request) -> None:
        self.versions_at_submit.append(self.version)
        self.submitted.append(request)
        self.running[request.request_id] = [request.params.max_new_tokens, -1]

    def step(self) -> StepOutput:
        if self.staged >= 0:
            self.version, self.staged = self.staged, -1
        out = super().step()
        tokens = [
            GeneratedToken(t.request_id, t.token_id, t.logprob, self.version) for t in out.tokens
        ]
        return StepOutput(tokens, out.finished, self.version)

    def status(self) -> EngineStatus:
        n = len(self.running)
        return EngineStatus(n, 0, 2 - n, self.version, self.staged, 0, None)


def test_a_generator_holds_a_lease_until_weights_of_its_min_version_are_in(tmp_path):
    """At η = 0 and trainer version 1 a lease needs version-1 weights: a generator still
    at version 0 holds it (samples begun then would be dropped as stale) and starts it
    once version 1 is staged, flipping it in with a step of its idle engine."""
    engine = _WeightsLateEngine()
    with _generating(_config(tmp_path), engine, version=1) as (server, worker):  # η = 0
        wait_for(lambda: len(worker.desk.held) == 2, 30, "two leases granted and held", poll_s=0.02)
        time.sleep(0.5)
        assert engine.submitted == [] and len(worker.desk.held) == 2
        engine.staged = 1
        wait_for(
            lambda: len(server.buffer.state.ready) == 2, 60, "both samples to complete", poll_s=0.02
        )
    assert worker.desk.held == []
    assert engine.versions_at_submit == [1, 1]
    for group in server.buffer.state.groups.values():
        assert group.slots[0].versions == [1] * 6
