"""Sizes that fit and steps that never wait without bound: the engine's context sized to
the task, an over-long prompt refused before anything starts (and failed, not crashed
on, at run time), and dynamic sampling's bound and warning."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.fit import fit_context, prompt_sizes
from asyncrl.generator.buffer_link import Outbox
from asyncrl.generator.worker import GeneratorWorker
from asyncrl.wire import Chunk, Lease, SamplingSpec, WireDecoder


def _rl_config(model_dir: str, *overrides: str):
    cfg = load_experiment("experiments/tiny_grpo.py")
    apply_overrides(cfg, [f"model.path={model_dir}", *overrides])
    return cfg


def test_max_seq_len_defaults_to_the_longest_prompt_plus_the_budget(tiny_model_dir):
    cfg = _rl_config(
        tiny_model_dir,
        "engine.embedded.max_seq_len=0",
        "sampling.max_new_tokens=10",
        "task.train_size=300",
    )
    sizes = fit_context(cfg.task, cfg.model.path, cfg.engine, cfg.sampling.max_new_tokens)
    # The split RL draws from (tiny_grpo: problems in neither train nor eval).
    assert cfg.task.rl_split == "unseen" and sizes.longest_uid.startswith("unseen:")
    longest = prompt_sizes(replace(cfg.task, rl_split="train"), tiny_model_dir, "train").longest
    assert cfg.engine.embedded.max_seq_len == sizes.longest + 10
    assert 0 < longest <= sizes.longest


def test_a_prompt_that_cannot_fit_fails_before_anything_starts(tiny_model_dir):
    cfg = _rl_config(tiny_model_dir, "engine.embedded.max_seq_len=6", "task.train_size=50")
    with pytest.raises(ConfigError) as e:
        fit_context(cfg.task, cfg.model.path, cfg.engine, cfg.sampling.max_new_tokens)
    message = str(e.value)
    longest = prompt_sizes(cfg.task, tiny_model_dir, cfg.task.rl_split).longest
    assert f"is {longest} tokens" in message and "unseen:" in message
    assert "engine.embedded.max_seq_len=6" in message and "at least" in message


class _Push:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)


def test_the_generator_fails_a_request_its_engine_refuses(tiny_model_dir):
    """A prompt longer than the engine's context ends as an ``error`` chunk (its group
    fails in the buffer) instead of crashing the generator into a restart loop."""
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=2, max_seq_len=8))
    worker = GeneratorWorker.__new__(GeneratorWorker)
    worker.engine, worker.pending = engine, {}
    worker.requests_refused, worker.worker_id = 0, "g0"
    worker.episodes = None
    worker.cfg = replace(_rl_config(tiny_model_dir).rollout(), run_id="run")
    worker.outbox = Outbox(worker.cfg, "g0", _Push())
    lease = Lease(
        run_id="run",
        lease_id="L1",
        prompt_id=0,
        group_id=0,
        sample_index=0,
        prompt_ids=[3] * 9,
        sampling=SamplingSpec(),
    )
    worker._submit(lease, 0.0)
    assert worker.requests_refused == 1 and not worker.pending
    chunk = WireDecoder("run").decode(worker.outbox.push.sent[0])
    assert isinstance(chunk, Chunk) and chunk.finished and chunk.finish_reason == "error"
    engine.close()


def _uniform_buffer(max_filtered_batches: int) -> tuple[RolloutBuffer, InlineScoring]:
    cfg = BufferConfig(
        prompts_per_batch=1,
        samples_per_prompt=2,
        max_staleness=None,
        dynamic_sampling=True,
        max_filtered_batches=max_filtered_batches,
    )
    buffer = RolloutBuffer(cfg, "run", lambda p: (p, [1, 2, p]), SamplingSpec())
    return buffer, InlineScoring(lambda prompt_id, completion, reason: 1.0)


def _finish_one_group(buffer: RolloutBuffer, scoring: InlineScoring) -> None:
    for lease in buffer.leases.lease("g", 2, 0.0):
        chunk = Chunk(
            run_id="run",
            worker_id="g",
            lease_id=lease.lease_id,
            seq=0,
            token_ids=[5, 3],
            logprobs=[0.0, 0.0],
            versions=[0, 0],
            finished=True,
            finish_reason="eos",
        )
        buffer.leases.on_chunk(chunk, 0.0)
    scoring.pump(buffer)


def test_dynamic_sampling_keeps_uniform_groups_once_a_step_waited_its_bound():
    buffer, scoring = _uniform_buffer(max_filtered_batches=2)
    for _ in range(2):
        _finish_one_group(buffer, scoring)
        assert buffer.batches.batch_for(1, 0, 1) is None
    counts = buffer.state.counts
    assert counts["groups_filtered"] == 2 and counts["groups_kept_uniform"] == 0
    _finish_one_group(buffer, scoring)  # the bound is reached: this one is trained on
    assert counts["groups_kept_uniform"] == 1
    assert len(buffer.batches.batch_for(1, 0, 1)) == 2
    # The count starts again for the next step.
    _finish_one_group(buffer, scoring)
    assert counts["groups_filtered"] == 3 and buffer.batches.batch_for(2, 0, 1) is None
    buffer.check_accounting()


def test_without_a_bound_uniform_groups_are_always_dropped():
    buffer, scoring = _uniform_buffer(max_filtered_batches=0)
    for _ in range(5):
        _finish_one_group(buffer, scoring)
    assert buffer.state.counts["groups_filtered"] == 5
    assert buffer.batches.batch_for(1, 0, 1) is None


def test_dynamic_sampling_that_drops_most_groups_says_so(caplog):
    buffer, scoring = _uniform_buffer(max_filtered_batches=0)
    with caplog.at_level(logging.WARNING, logger="asyncrl.buffer.groups"):
        for _ in range(120):
            _finish_one_group(buffer, scoring)
    warnings = [r.getMessage() for r in caplog.records if "dynamic sampling" in r.getMessage()]
    assert len(warnings) == 1  # once a minute at most
    assert "dropped 100 of the last 100 complete groups" in warnings[0]
