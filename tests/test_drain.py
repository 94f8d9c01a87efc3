"""A generator that leaves the run (drained, its slot going to another role) loses no
work: the buffer takes back every lease it holds at once, with the tokens it sent, and
another generator continues each sample from its last token with the same seed, so the
samples come out as if nobody had left.

The unit test drives the buffer through its ``Journal``; the socket test runs a real
``BufferServer`` and real generator loops over the embedded engine and the tiny model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import replace

from asyncrl.buffer.config import BufferConfig, RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.buffer.server import BufferServer
from asyncrl.buffer.wal import Journal, frame, replay
from asyncrl.config import save_json
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.generator.worker import GeneratorWorker
from asyncrl.liveness import EXIT_DRAINED
from asyncrl.metrics import MetricsConfig
from asyncrl.models import ModelConfig
from asyncrl.transport import TransportConfig
from asyncrl.wire import Chunk, SamplingSpec
from tests.runs import wait_for

PROMPTS, SAMPLES = 2, 2


def _prompts(position: int) -> tuple[int, list[int]]:
    return position, [3, 4, 5 + position % 3]


def _chunk(lease_id: str, seq: int, tokens: list[int], worker: str) -> Chunk:
    n = len(tokens)
    return Chunk(
        run_id="run",
        worker_id=worker,
        lease_id=lease_id,
        seq=seq,
        token_ids=tokens,
        logprobs=[-1.0] * n,
        versions=[0] * n,
    )


class _Log(list):
    def append(self, event) -> None:  # the WriteAheadLog's interface, in memory
        super().append(frame(event))


def test_a_drained_holder_hands_back_every_lease_with_its_tokens_and_a_replay_agrees():
    cfg = BufferConfig(prompts_per_batch=1, samples_per_prompt=2, max_staleness=None)
    buffer, log = RolloutBuffer(cfg, "run", _prompts, SamplingSpec(max_new_tokens=8)), _Log()
    journal = Journal(buffer, log)
    first, second = journal.lease("g0", 2, 0.0)
    journal.chunk(_chunk(first.lease_id, 0, [5, 6], "g0"), 0.5)
    buffer.leases.on_heartbeat("g0", 0.6, version=0, leases=[first.lease_id, second.lease_id])
    assert sorted(journal.leave("g0")) == sorted([first.lease_id, second.lease_id])
    counts = buffer.state.counts
    assert counts["leases_revoked_drained"] == counts["leases_reissued"] == 2
    assert "g0" not in buffer.leases.worker_versions  # its version no longer counts
    again = {lease.sample_index: lease for lease in journal.lease("g1", 2, 1.0)}
    assert again[first.sample_index].prefix_ids == [5, 6]
    assert again[second.sample_index].prefix_ids == []
    assert counts["leases_continued"] == 1
    assert journal.expire(1000.0) == {}  # nothing left to take from the one that left
    fresh = RolloutBuffer(cfg, "run", _prompts, SamplingSpec(max_new_tokens=8))
    assert replay(fresh, b"".join(log)) == len(log)
    assert fresh.save() == buffer.save()


def _config(run_dir, model_dir: str) -> RolloutConfig:
    return RolloutConfig(
        run_dir=str(run_dir),
        run_id="run",
        model=ModelConfig(path=model_dir),
        buffer=BufferConfig(
            prompts_per_batch=PROMPTS,
            samples_per_prompt=SAMPLES,
            max_staleness=0,
            heartbeat_timeout_s=30.0,
            progress_timeout_s=60.0,
        ),
        sampling=SamplingConfig(max_new_tokens=24, temperature=1.0),
        # Chunks of 8 tokens or 10 s: when g0 is drained it holds tokens not sent yet.
        transport=TransportConfig(chunk_tokens=8, chunk_ms=10_000.0, heartbeat_s=0.1),
        metrics=MetricsConfig(tensorboard=False, progress_bar=False, interval_s=60.0),
    )


class _CountingEngine(EmbeddedEngine):
    """The embedded engine, counting the tokens its steps generate."""

    generated = 0

    def step(self):
        out = super().step()
        self.generated += len(out.tokens)
        return out


def _generate(cfg: RolloutConfig, model_dir: str, drain_after_tokens: int | None):
    """Run the buffer and generator g0 until one batch of samples is complete; with
    ``drain_after_tokens``, g0 is drained once it has generated that many tokens and g1
    finishes the samples. Returns each sample's tokens, the buffer's counters and the
    workers."""
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, _prompts, cfg.sampling.spec(seed=7))
    server = BufferServer(cfg, buffer, InlineScoring(lambda *_: 1.0))
    threads = [threading.Thread(target=server.serve, daemon=True)]
    threads[0].start()
    engine_cfg = EmbeddedEngineConfig(max_slots=4, max_seq_len=64, threads=1)
    workers = []

    def start(worker_id: str) -> GeneratorWorker:
        worker = GeneratorWorker(cfg, worker_id, _CountingEngine(model_dir, engine_cfg))
        workers.append(worker)
        threads.append(threading.Thread(target=worker.run, daemon=True))
        threads[-1].start()
        return worker

    counts = buffer.state.counts
    try:
        first = start("g0")
        if drain_after_tokens is not None:
            wait_for(
                lambda: first.engine.generated >= drain_after_tokens, 60, "g0's tokens", poll_s=0.01
            )
            first.drain()
            threads[1].join(timeout=60)
            assert not threads[1].is_alive(), "the drained generator did not stop"
            start("g1")
        wait_for(
            lambda: len(buffer.state.ready) == PROMPTS, 120, "the batch's samples", poll_s=0.01
        )
    finally:
        for worker in workers:
            worker.stop()
        server.stop()
        for thread in threads:
            thread.join(timeout=30)
    tokens = {
        (group.group_id, slot.index): list(slot.token_ids)
        for group in buffer.state.groups.values()
        for slot in group.slots
    }
    return tokens, dict(counts), workers


def test_a_drained_generator_s_samples_are_continued_elsewhere_with_tokens_unchanged(
    tmp_path, tiny_model_dir
):
    """g0 is drained a few tokens into its samples; g1 continues them from the tokens g0
    sent. Every sample's tokens equal those of a run that nobody left (seeded draws: the
    token at a position depends on the sample's seed, not on who draws it); the buffer
    took the leases back as drained, not as a dead holder's, and no token was generated
    twice: every token g0 made reached the buffer before it left."""
    cfg = _config(tmp_path / "left", tiny_model_dir)
    tokens, counts, (g0, g1) = _generate(
        cfg, tiny_model_dir, drain_after_tokens=3 * PROMPTS * SAMPLES
    )
    reference, _, _ = _generate(_config(tmp_path / "stayed", tiny_model_dir), tiny_model_dir, None)
    assert len(tokens) == PROMPTS * SAMPLES and tokens == reference
    assert g0.leases_handed_back == counts["leases_revoked_drained"] >= 1
    assert counts["leases_continued"] >= 1  # g1 took at least one sample mid-way
    assert counts["leases_reissued"] == counts["leases_revoked_drained"]  # no other reason
    assert counts.get("tokens_revoked_alive", 0) == 0 and g0.leases_aborted == 0
    assert g0.engine.generated == g0.outbox.tokens_sent > 0
    assert g0.engine.generated + g1.engine.generated == sum(map(len, tokens.values()))
    assert g1.leases_handed_back is None and not g0.pending and not g0.desk.held


def test_sigusr1_drains_a_generator_process_which_exits_drained(tmp_path, tiny_model_dir):
    """The launcher's way to take a generator out: SIGUSR1 to its process. It hands its
    leases back and exits with ``EXIT_DRAINED`` (which the launcher does not restart)."""
    cfg = _config(tmp_path, tiny_model_dir)
    cfg = replace(cfg, transport=replace(cfg.transport, chunk_tokens=1, chunk_ms=10.0))
    save_json(cfg, tmp_path / "rollout.json")
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, _prompts, cfg.sampling.spec(seed=7))
    server = BufferServer(cfg, buffer, InlineScoring(lambda *_: 1.0))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    args = ["--config", str(tmp_path / "rollout.json"), "--worker-id", "g0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(tmp_path / "g0.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.generator.worker", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_for(
            lambda: buffer.state.counts["tokens_received"] > 0,
            120,
            "g0's first tokens",
            poll_s=0.01,
        )
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
        thread.join(timeout=30)
    assert code == EXIT_DRAINED, (tmp_path / "g0.log").read_text()[-2000:]
    counts = buffer.state.counts
    assert counts["leases_revoked_drained"] >= 1 and not buffer.leases.active
    assert counts["leases_revoked_holder_silent"] == 0
