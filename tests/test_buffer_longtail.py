"""The buffer in the long-tail regime: batches take the oldest groups first, the trainer
waits for a straggler rather than drop it for staleness, and completion lengths are
counted for what finished and what was trained on."""

from __future__ import annotations

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.wire import Chunk, Lease, SamplingSpec


def _prompts(position: int) -> tuple[int, list[int]]:
    return position, [1, 2, position]


def _reward(prompt_id: int, completion: list[int], reason: str | None) -> float:
    return float(completion[-1] % 2)  # token 3 scores 1, token 4 scores 0: a spread


def _finish(buffer: RolloutBuffer, lease: Lease, version: int, length: int) -> None:
    """Stream ``length`` tokens of ``version`` for ``lease`` in one final chunk."""
    tokens = [5] * (length - 1) + [3 + lease.sample_index % 2]
    chunk = Chunk(
        run_id="run",
        worker_id="g",
        lease_id=lease.lease_id,
        seq=0,
        token_ids=tokens,
        logprobs=[0.0] * length,
        versions=[version] * length,
        finished=True,
        finish_reason="eos",
    )
    buffer.leases.on_chunk(chunk, 0.0)


def _two_groups(stale_policy: str) -> tuple[RolloutBuffer, InlineScoring, list[Lease]]:
    """One prompt a batch, η = 1: group 0 is leased at version 0, the trainer moves to
    version 1, group 1 is leased and finishes (short) while group 0 is still generating."""
    cfg = BufferConfig(
        prompts_per_batch=1, samples_per_prompt=2, max_staleness=1, stale_policy=stale_policy
    )
    buffer = RolloutBuffer(cfg, "run", _prompts, SamplingSpec())
    scoring = InlineScoring(_reward)
    first = buffer.leases.lease("g", 2, 0.0)
    buffer.batches.set_version(1)
    second = buffer.leases.lease("g", 2, 0.0)
    assert [lease.group_id for lease in first + second] == [0, 0, 1, 1]
    # Group 0's first sample finished at version 0; the other is the long one still going.
    _finish(buffer, first[0], version=0, length=2)
    for lease in second:
        _finish(buffer, lease, version=1, length=3)
    scoring.pump(buffer)
    return buffer, scoring, first


def test_the_trainer_waits_for_a_straggler_that_would_turn_stale():
    buffer, scoring, first = _two_groups("wait")
    # Step 1 could take group 1, but group 0 would then be too stale for step 2.
    assert buffer.batches.batch_for(1, 0, 1) is None
    assert buffer.batches.steps_waited == 1
    assert buffer.batches.batch_for(1, 0, 1) is None  # asking again counts no second wait
    assert buffer.batches.steps_waited == 1
    _finish(buffer, first[1], version=1, length=40)
    scoring.pump(buffer)
    # Both are ready now: the group with the oldest tokens goes first, though it finished last.
    assert {s.group_id for s in buffer.batches.batch_for(1, 0, 1)} == {0}
    assert {s.group_id for s in buffer.batches.batch_for(2, 0, 1)} == {1}
    counts = buffer.state.counts
    assert counts["groups_stale"] == 0
    assert counts["samples_finished"] == counts["samples_consumed"] == 4
    assert counts["completion_tokens_finished"] == counts["completion_tokens_consumed"] == 48
    assert counts["completion_tokens_ready"] == 48 and counts["samples_ready"] == 4
    buffer.check_accounting()


def test_dropping_goes_on_without_the_straggler_and_drops_it_stale():
    buffer, scoring, first = _two_groups("drop")
    assert {s.group_id for s in buffer.batches.batch_for(1, 0, 1)} == {1}
    _finish(buffer, first[1], version=1, length=40)
    scoring.pump(buffer)
    assert buffer.batches.batch_for(2, 0, 1) is None  # group 0 is two versions old: dropped
    counts = buffer.state.counts
    assert counts["groups_stale"] == 1 and counts["samples_stale"] == 2
    assert counts["completion_tokens_stale"] == 42
    assert counts["completion_tokens_consumed"] == 6
    buffer.check_accounting()


def test_batches_take_the_oldest_tokens_first_not_the_first_finished():
    cfg = BufferConfig(prompts_per_batch=1, samples_per_prompt=2, max_staleness=None)
    buffer = RolloutBuffer(cfg, "run", _prompts, SamplingSpec())
    scoring = InlineScoring(_reward)
    old = buffer.leases.lease("g", 2, 0.0)
    buffer.batches.set_version(3)
    new = buffer.leases.lease("g", 2, 0.0)
    for lease in new:  # the newer group finishes first
        _finish(buffer, lease, version=3, length=2)
    scoring.pump(buffer)
    for lease in old:
        _finish(buffer, lease, version=0, length=9)
    scoring.pump(buffer)
    assert buffer.state.ready == [1, 0]
    assert {s.group_id for s in buffer.batches.batch_for(3, 0, 1)} == {0}
    assert {s.group_id for s in buffer.batches.batch_for(4, 0, 1)} == {1}


def test_the_report_compares_trained_and_finished_lengths_and_counts_drops():
    from asyncrl.buffer.scoring import buffer_counters
    from asyncrl.report import buffer_figures

    buffer, scoring, first = _two_groups("drop")
    buffer.batches.batch_for(1, 0, 1)
    _finish(buffer, first[1], version=1, length=40)
    scoring.pump(buffer)
    buffer.batches.batch_for(2, 0, 1)
    figures = buffer_figures(buffer_counters(buffer, scoring))
    assert figures["trained_mean_length"] == 3.0  # group 1: two samples of 3 tokens
    assert figures["finished_mean_length"] == 48 / 4
    assert figures["trained_vs_finished_length"] == 0.25
    assert figures["trained_vs_passed_length"] == 0.25  # no filter here: the same
    assert figures["dropped"]["stale"] == {"samples": 2, "tokens": 42}
    assert figures["tokens_revoked_alive"] == 0


def test_a_batch_served_ahead_of_the_trainer_s_version_is_counted_until_announced():
    """What a run that ends mid-step leaves served but untrained: the chaos books take it
    from the consumed samples before counting any as lost."""
    from asyncrl.buffer.scoring import buffer_counters

    buffer, scoring, _ = _two_groups("drop")
    buffer.batches.batch_for(1, 0, 1)  # step 1's batch, the trainer still at version 1
    ahead = buffer_counters(buffer, scoring)["buffer/samples_served_untrained"]
    assert ahead == 2 == buffer.state.counts["samples_consumed"]
    buffer.batches.set_version(2)  # step 1 trained
    assert buffer_counters(buffer, scoring)["buffer/samples_served_untrained"] == 0
