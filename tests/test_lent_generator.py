"""A trainer rank that generates while it waits (``generate_while_waiting``): its lent
generator steps only while the gate is open (the trainer's wait), never beside the
trainer, and makes the tokens any generator would; through the launcher, the lent
generator's tokens reach the buffer and its books balance."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.buffer.server import BufferServer
from asyncrl.config import ConfigError
from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.generator.lent import Gate, LentWorker
from asyncrl.stages.rl_config import RLExperiment
from tests.runs import assert_lent_drained, run_short_grpo, trained_steps
from tests.test_drain import PROMPTS, _config, _CountingEngine, _generate, _prompts


class _TimedEngine(_CountingEngine):
    """Counts its tokens and notes when each step ran."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[float, float]] = []

    def step(self):
        start = time.monotonic()
        out = super().step()
        self.steps.append((start, time.monotonic()))
        return out


def _longer(cfg):
    """Samples of 48 tokens: on a fast machine 24 fit in two turns of the gate."""
    return replace(cfg, sampling=replace(cfg.sampling, max_new_tokens=48))


def test_a_lent_generator_steps_only_while_its_gate_is_open_and_makes_the_same_tokens(
    tmp_path, tiny_model_dir
):
    """Closed at first, it generates nothing; then the gate opens and closes in turn, as
    a trainer's waits and steps would: no engine step overlaps a closed spell (``close``
    returns only once the step in progress ends), the samples complete, and their tokens
    are a plain generator's."""
    cfg = _longer(_config(tmp_path / "lent", tiny_model_dir))
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, _prompts, cfg.sampling.spec(seed=7))
    server = BufferServer(cfg, buffer, InlineScoring(lambda *_: 1.0))
    threads = [threading.Thread(target=server.serve, daemon=True)]
    threads[0].start()
    gate = Gate()
    # The reference's engine settings, threads included: torch's intra-op thread count is
    # process-wide state that earlier tests leave behind, and a sum split over other
    # threads rounds differently, which can move a sampled token.
    engine_cfg = EmbeddedEngineConfig(max_slots=4, max_seq_len=64, threads=1)
    engine = _TimedEngine(tiny_model_dir, engine_cfg)
    worker = LentWorker(cfg, "lent0", engine, gate)
    threads.append(threading.Thread(target=worker.run, daemon=True))
    threads[1].start()
    closed: list[tuple[float, float]] = []
    try:
        time.sleep(1.0)
        # The trainer's time: nothing ran.
        assert engine.generated == 0 and not engine.steps, (engine.generated, engine.steps)
        deadline = time.monotonic() + 120
        while len(buffer.state.ready) < PROMPTS:
            assert time.monotonic() < deadline, "the lent generator never finished the batch"
            gate.open()
            time.sleep(0.02)  # a few decode steps: the samples span several turns
            gate.close()
            shut = time.monotonic()
            time.sleep(0.05)  # the trainer's step: nothing may decode
            closed.append((shut, time.monotonic()))
    finally:
        worker.stop()
        server.stop()
        for thread in threads:
            thread.join(timeout=30)
    assert len(closed) >= 3, "too few turns of the gate to show anything"
    overlaps = [(s, c) for s in engine.steps for c in closed if s[0] < c[1] and s[1] > c[0]]
    assert not overlaps, f"{len(overlaps)} engine steps ran while the gate was closed"
    tokens = {
        (group.group_id, slot.index): list(slot.token_ids)
        for group in buffer.state.groups.values()
        for slot in group.slots
    }
    plain = _longer(_config(tmp_path / "plain", tiny_model_dir))
    reference, _, _ = _generate(plain, tiny_model_dir, None)
    assert tokens == reference, (tokens, reference)
    assert engine.generated == worker.outbox.tokens_sent > 0, worker.outbox.tokens_sent


def test_generate_while_waiting_is_refused_where_the_trainer_cannot_lend():
    with pytest.raises(ConfigError, match="generate_while_waiting"):
        RLExperiment(generate_while_waiting=True, placement="colocated").finalize()


def test_a_trainer_generating_while_it_waits_feeds_the_buffer_through_the_launcher(
    tmp_path, tiny_model_dir
):
    """``tiny_grpo`` with one generator and the trainer lending its waits, to its last
    step: generator ``lent0`` sent tokens, was drained at the end (its leases handed
    back), and the books balance: nothing lost, nothing taken back for a dead holder, no
    token wasted."""
    run_dir = tmp_path / "run"
    run_short_grpo(run_dir, tiny_model_dir, "rl.max_steps=40", "generate_while_waiting=true")
    assert trained_steps(run_dir) == 40
    assert_lent_drained(run_dir)
