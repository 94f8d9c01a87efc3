"""A generator's self-measurement: idle fraction, tokens/s, step times split by whether a
weight update was in flight, and each update's arrival-to-staged and arrival-to-flip
times; plus ``asyncrl.report`` (``tools/run_report.py``) over hand-made run files."""

from __future__ import annotations

import json

import pytest

from asyncrl import report as run_report
from asyncrl.generator.stats import GeneratorStats, step_time_stats


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


def test_superseded_update_is_not_timed_as_a_flip():
    stats = GeneratorStats()
    for version in (1, 2):  # v2 arrives before v1 was staged: the engine skips v1
        stats.weights_offered(version, stats.weights_arriving())
    stats.observe_weights(version=2, staged_version=-1)  # staged and flipped in one turn
    w = stats.window(version=2)
    assert not stats.updating(version=2)
    assert w["generator/weight_flip_s_max"] == w["generator/weight_flip_s"]  # one flip timed
    assert w["generator/weights_received"] == 2


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
