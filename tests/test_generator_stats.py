"""A generator's self-measurement: idle fraction, tokens/s, step times split by whether a
weight update was in flight, each update's arrival-to-staged and arrival-to-flip times,
slot occupancy and each weights version's batch tail; plus ``asyncrl.report``
(``tools/run_report.py``) over hand-made run files."""

from __future__ import annotations

import json

import pytest

from asyncrl import report as run_report
from asyncrl.engine.base import EngineStatus, Finished, GeneratedToken, StepOutput
from asyncrl.generator.stats import GeneratorStats, batch_tail, step_time_stats


def test_step_time_stats():
    assert step_time_stats("steady_step", []) == {}
    got = step_time_stats("x", [i / 1000 for i in range(1, 101)])  # 1 … 100 ms
    assert got["x_ms_mean"] == pytest.approx(50.5)
    assert got["x_ms_p50"] == pytest.approx(50.5)
    assert got["x_ms_p99"] == pytest.approx(99.01)


def test_window_idle_fraction_and_update_split():
    stats = GeneratorStats()
    stats.on_loop(0.3, stepped=False)  # waiting for leases
    for _ in range(7):
        stats.on_step(0.01, tokens=4, during_update=False)
        stats.on_loop(0.1, stepped=True)
    assert not stats.updating(version=0)
    arrived = stats.weights_arriving()
    assert stats.updating(version=0)  # frames in hand count as an update in flight
    stats.weights_offered(1, arrived)
    assert stats.updating(version=0) and not stats.updating(version=1)
    stats.observe_weights(version=0, staged_version=1)
    stats.on_step(0.05, tokens=4, during_update=True)  # the flip step
    stats.on_loop(0.1, stepped=True)
    stats.observe_weights(version=1, staged_version=-1)
    assert not stats.updating(version=1)

    w = stats.window(version=1)
    assert w["generator/window_s"] == pytest.approx(1.1)
    assert w["generator/idle_fraction"] == pytest.approx(0.3 / 1.1)
    assert w["generator/tokens_per_s"] == pytest.approx(32 / 1.1)
    assert (w["generator/steps"], w["generator/update_steps"]) == (8, 1)
    assert w["generator/steady_step_ms_p99"] == pytest.approx(10.0)
    assert w["generator/update_step_ms_p99"] == pytest.approx(50.0)
    assert 0 <= w["generator/weight_stage_s"] <= w["generator/weight_flip_s"]
    assert (w["generator/weights_received"], w["generator/version"]) == (1, 1)
    # A new window starts empty (no step-time keys without steps); the summary keeps all.
    stats.on_loop(0.5, stepped=False)
    w2 = stats.window(version=1)
    assert w2["generator/idle_fraction"] == 1.0 and "generator/steady_step_ms_p99" not in w2
    summary = stats.summary(version=1)
    assert summary["loop_s"] == pytest.approx(1.6) and summary["update_steps"] == 1
    assert summary["weights_received"] == 1 and "update_step_ms_p99" in summary


def test_update_steps_are_compared_with_steady_steps_of_their_batch_size():
    """Updates fall on full batches: a step of 64 sequences at 2x the steady 64-sequence
    step is a ratio of 2, however fast the steady 4-sequence steps are."""
    stats = GeneratorStats()
    for _ in range(10):
        stats.on_step(0.002, tokens=4, during_update=False)
        stats.on_step(0.010, tokens=64, during_update=False)
    stats.on_step(0.020, tokens=64, during_update=True)
    stats.on_step(0.002, tokens=4, during_update=True)
    stats.on_step(0.050, tokens=7, during_update=True)  # no steady step of 7: left out
    summary = stats.summary(version=0)
    assert summary["update_step_ratio_p50"] == pytest.approx(1.5)
    assert summary["update_step_ratio_p99"] == pytest.approx(1.99)


def test_update_steps_are_compared_with_steady_steps_that_prefilled_alike():
    """Where prefill is known, a decode-only update step is compared with decode-only
    steady steps and a prefilling one with prefilling ones: new leases make a step slower
    whether or not weights are on their way."""
    stats = GeneratorStats()
    for _ in range(10):
        stats.on_step(0.010, tokens=64, during_update=False, prefill_tokens=0)
        stats.on_step(0.030, tokens=64, during_update=False, prefill_tokens=200)
    stats.on_step(0.010, tokens=64, during_update=True, prefill_tokens=0)
    stats.on_step(0.030, tokens=64, during_update=True, prefill_tokens=150)
    summary = stats.summary(version=0)
    # Against the mixed 20 ms mean they would be 0.5 and 1.5: a p99 of 1.49.
    assert summary["update_step_ratio_p50"] == pytest.approx(1.0)
    assert summary["update_step_ratio_p99"] == pytest.approx(1.0)


def test_update_steps_p99_is_set_against_steady_steps_in_their_mix():
    """Steady steps are mostly small decode-only batches; updates fall on full batches
    that prefill. At the same cost per kind the matched steady p99 is the update steps'
    own, where the plain steady p99 is the small batches' (10 ms against 50); pooled
    unweighted, the two matched kinds would give 10 ms too."""
    stats = GeneratorStats()
    for _ in range(4000):
        stats.on_step(0.010, tokens=8, during_update=False, prefill_tokens=0)
    for seconds in (0.030, 0.050):
        for _ in range(10):
            stats.on_step(seconds, tokens=64, during_update=False, prefill_tokens=100)
    stats.on_step(0.030, tokens=64, during_update=False, prefill_tokens=0)
    for _ in range(20):
        stats.on_step(0.050, tokens=64, during_update=True, prefill_tokens=100)
        stats.on_step(0.010, tokens=8, during_update=True, prefill_tokens=0)
    summary = stats.summary(version=0)
    assert summary["steady_step_ms_p99"] == pytest.approx(10.0)
    assert summary["update_step_ms_p99"] == pytest.approx(50.0)
    assert summary["steady_step_ms_p99_matched"] == pytest.approx(50.0)


def test_an_update_step_of_unknown_kind_is_matched_by_every_steady_step_of_its_batch():
    """An engine that does not say what a step prefilled: its update steps match all the
    steady steps of their batch size, whatever those prefilled."""
    stats = GeneratorStats()
    for seconds, prefill in ((0.010, 0), (0.020, 0), (0.040, 100)):
        stats.on_step(seconds, tokens=3, during_update=False, prefill_tokens=prefill)
    stats.on_step(0.080, tokens=3, during_update=True)
    summary = stats.summary(version=0)
    assert summary["update_step_ratio_p50"] == pytest.approx(0.080 / (0.070 / 3))
    assert summary["steady_step_ms_p99_matched"] == pytest.approx(40.0)


def test_superseded_update_is_not_timed_as_a_flip():
    stats = GeneratorStats()
    for version in (1, 2):  # v2 arrives before v1 was staged: the engine skips v1
        stats.weights_offered(version, stats.weights_arriving())
    stats.observe_weights(version=2, staged_version=-1)  # staged and flipped in one turn
    w = stats.window(version=2)
    assert not stats.updating(version=2)
    assert w["generator/weight_flip_s_max"] == w["generator/weight_flip_s"]  # one flip timed
    assert (w["generator/weights_received"], w["generator/weights_flipped"]) == (2, 1)


class FakeClock:
    """Seconds the test sets by hand, for ``GeneratorStats(clock=...)``."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _status(running: int, waiting: int, free: int) -> EngineStatus:
    return EngineStatus(running, waiting, free, 0, -1, 0, None)


def _output(version: int, tokens: int, finished: list[str]) -> StepOutput:
    return StepOutput(
        tokens=[GeneratedToken(f"r{i}", 7, -1.0, version) for i in range(tokens)],
        finished=[Finished(f"r{i}", reason, 3) for i, reason in enumerate(finished)],
        version=version,
    )


def test_slot_occupancy_is_weighted_by_turn_time_with_idle_turns_empty():
    stats = GeneratorStats()
    stats.on_loop(1.0, stepped=False)
    assert "generator/slot_occupancy" not in stats.window(0)  # the caller never told slots
    stats.on_loop(1.0, stepped=False)  # idle: no slot in use
    stats.on_step(0.01, tokens=3, during_update=False)
    # 2 running and 1 waiting that the step admits, of 4 slots: 3/4 busy for 2 s
    stats.on_output(_output(0, 3, []), _status(running=2, waiting=1, free=2))
    stats.on_loop(2.0, stepped=True)
    stats.on_step(0.01, tokens=1, during_update=False)
    stats.on_output(_output(0, 1, []), _status(running=1, waiting=5, free=0))  # full
    stats.on_loop(1.0, stepped=True)
    w = stats.window(0)
    assert w["generator/slot_occupancy"] == pytest.approx((0 + 0.75 * 2 + 1.0) / 4)
    stats.on_loop(3.0, stepped=False)
    assert stats.window(0)["generator/slot_occupancy"] == 0.0  # a window of idling
    assert stats.summary(0)["slot_occupancy"] == pytest.approx(2.5 / 8)


def test_batch_tail_per_weights_version():
    """Version 0: its first step starts at t=0, ten leases finish at t=2 … 10 and 15 (an
    abort does not count): 90% were done at t=10, the last at 15: a 5 s tail of 15 s. The
    first step under version 1 closes version 0; version 1, still open, is not counted."""
    clock = FakeClock()
    stats = GeneratorStats(clock=clock)

    def step(t: float, version: int, finished: list[str]) -> None:
        clock.t = t
        stats.on_step(1.0, tokens=4, during_update=False)
        stats.on_output(_output(version, 4, finished), _status(4, 0, 0))
        stats.on_loop(1.0, stepped=True)

    step(1.0, 0, [])
    for t in [2, 3, 4, 5, 6, 7, 8, 9, 10, 15]:
        step(float(t), 0, ["eos"] if t != 9 else ["length", "abort"])
    assert "generator/tail_s" not in stats.window(0)  # version 0 still open
    step(20.0, 1, [])
    step(21.0, 1, ["eos", "eos"])
    w = stats.window(1)
    assert (w["generator/tail_batches"], w["generator/tail_s"]) == (1, 5.0)
    assert w["generator/batch_gen_s"] == 15.0 and w["generator/tail_fraction"] == 1 / 3
    summary = stats.summary(1)
    assert summary["tail_batches"] == 1 and summary["tail_s_mean"] == 5.0
    assert batch_tail(0.0, [4.0]) == (4.0, 0.0)  # one lease: no tail
    assert batch_tail(0.0, [float(t) for t in range(1, 21)]) == (20.0, 2.0)  # p90 = 18th


def test_run_report_on_hand_made_run(tmp_path):
    lines = [
        {"process": "trainer", "step": 0, "time": 1.0, "eval/accuracy": 0.1},
        *[
            {
                "process": "trainer",
                "step": s,
                "time": 30.0 * s,
                "train/loss": 0.5,
                "train/tokens_per_s": 100.0,
                "train/wait_for_batch_s": 3.0,
                "train/tokens": 600,
            }
            for s in (1, 2, 3, 4)
        ],
        {"process": "trainer", "step": 4, "time": 130.0, "eval/accuracy": 0.4},
        {
            "process": "generator_g0",
            "step": 1,
            "time": 5.0,
            "generator/window_s": 10.0,
            "generator/idle_s": 2.0,
            "generator/tokens": 500.0,
        },
        {
            "process": "generator_g0",
            "step": 3,
            "time": 15.0,
            "generator/window_s": 10.0,
            "generator/idle_s": 6.0,
            "generator/tokens": 300.0,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"proc')
    (tmp_path / "summary.json").write_text(
        json.dumps({"steps": 4, "wall_time_s": 140.0, "train_time_s": 120.0})
    )
    (tmp_path / "generator_g0_summary.json").write_text(
        json.dumps({"update_step_ms_p99": 9.0, "steady_step_ms_p99": 3.0})
    )
    (tmp_path / "buffer_counters.json").write_text(
        json.dumps({"buffer/staleness_10": 1, "buffer/staleness_2": 5, "buffer/staleness_0": 2})
    )
    r = run_report.report(tmp_path, [0, 2, 5])
    assert (r["steps"], r["train_time_s"]) == (4, 120.0)
    assert r["trained_tokens_per_s"] == 20.0 and r["train_step_tokens_per_s"] == 100.0
    assert r["generated_tokens_per_s"] == 40.0 and r["generator_idle_fraction"] == 0.4
    assert r["trainer_idle_fraction"] == 0.1
    assert (r["step_ms_p99_update"], r["step_ms_p99_steady"]) == (9.0, 3.0)
    assert list(r["staleness_histogram"].items()) == [("0", 2), ("2", 5), ("10", 1)]
    assert r["accuracy_at_min"] == {"0": 0.1, "2": 0.4, "5": None}
    # No length figures from the trainer, no occupancy or tails from the generator: null.
    assert r["length_p50"] is None and r["truncated_frac"] is None
    assert r["slot_occupancy"] is None and r["tail_s_total"] is None


def _window(worker: str, seconds: float, **scalars: float) -> dict:
    record = {"process": f"generator_{worker}", "step": 1, "time": 1.0}
    record.update({"generator/window_s": seconds, "generator/idle_s": 0.0})
    record.update({"generator/tokens": 10.0, **{f"generator/{k}": v for k, v in scalars.items()}})
    return record


def test_run_report_lengths_slot_occupancy_and_tails(tmp_path):
    steps = [  # step, p50, p90, p99, max, mean, truncated_frac, samples
        (1, 10, 50, 200, 300, 30, 0.0, 8),
        (2, 20, 60, 250, 512, 40, 0.25, 8),
        (3, 30, 70, 260, 400, 50, 0.5, 16),
    ]
    keys = ["p50", "p90", "p99", "max", "mean", "truncated_frac", "samples"]
    lines = [
        {
            "process": "trainer",
            "step": step,
            "time": 10.0 * step,
            "train/loss": 0.1,
            "train/tokens_per_s": 1.0,
            **{f"length/{k}": float(v) for k, v in zip(keys, values)},
        }
        for step, *values in steps
    ]
    lines += [
        _window("g0", 10.0, slot_occupancy=0.5, tail_s=2.0, tail_batches=1.0, batch_gen_s=8.0),
        _window("g0", 10.0, slot_occupancy=0.9),
        _window("g0", 10.0),  # a window without occupancy (a loop that never told slots)
        _window("g1", 20.0, slot_occupancy=0.1, tail_s=4.0, tail_batches=2.0, batch_gen_s=12.0),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = run_report.report(tmp_path, [1])
    assert (r["length_p50"], r["length_p90"], r["length_p99"]) == (20.0, 60.0, 250.0)
    assert (r["length_max"], r["length_mean"]) == (512.0, 42.5)  # mean by sample: 1360 / 32
    assert r["truncated_frac"] == 0.3125  # (0 + 2 + 8) / 32 samples
    assert r["generators"]["g0"]["slot_occupancy"] == 0.7
    assert r["slot_occupancy"] == 0.4  # (0.5·10 + 0.9·10 + 0.1·20) / 40 s
    assert (r["tail_s_total"], r["tail_s_mean"], r["tail_fraction"]) == (6.0, 2.0, 0.3)
    assert r["generators"]["g1"]["tail_fraction"] == pytest.approx(1 / 3, abs=1e-4)
