"""The elastic placement's loop in the launchers (``asyncrl.launcher.elastic``): it reads
a run's metrics as they are written, asks the controller (``tests/test_elastic.py``) for a
move and asks the role pools for the count it wants, logging each check; the settings it
refuses before any process starts; and the run report's figures of its checks."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.launcher import elastic as elastic_loop
from asyncrl.launcher.elastic import ElasticLoop
from asyncrl.launcher.pool import GENERATORS, REWARDS, RolePool
from asyncrl.launcher.supervise import Supervised
from asyncrl.metrics import MetricsConfig, read_metrics
from asyncrl.report import elastic_figures

from .test_elastic import CFG


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["num_generators=5"], "num_generators=5 is where an elastic run starts"),
        (["elastic.window_steps=6"], "elastic.window_steps=6 must be at least 1 and at most"),
        (["elastic.min_generators=0"], "elastic.min_generators=0 must be at least 1"),
        (["elastic.window_s=90"], "elastic.window_s=90 must be above 0 and at most"),
        (["elastic.trainer_idle_low=0.5"], "elastic.trainer_idle_low=0.5 must be below"),
        (["elastic.max_step=0"], "elastic.max_step=0 must be at least 1"),
    ],
)
def test_an_elastic_setting_that_cannot_work_is_refused_before_any_process(
    tmp_path, overrides, message
):
    cfg = load_experiment(Path(__file__).resolve().parents[1] / "experiments" / "tiny_grpo.py")
    cfg = apply_overrides(cfg, ["placement=elastic", f"run_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=message):
        cfg.finalize()


def _trainer_steps(path, steps: int, wait_s: float) -> None:
    with open(path, "a") as f:
        for i in range(steps):
            record = {"process": "trainer", "step": i, "time": 0.0, "train/step_s": 0.1}
            record.update({"train/wait_for_batch_s": wait_s, "train/tokens": 500.0})
            f.write(json.dumps(record) + "\n")


def test_the_loop_reads_the_run_and_asks_the_pool_for_the_controller_s_count(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "--worker-id", "g0"]
    procs = [Supervised("generator_0", sleeper, logs / "generator_0.log", restartable=True)]
    pool = RolePool(tmp_path, procs)
    metrics = MetricsConfig(tensorboard=False, progress_bar=False)
    loop = ElasticLoop(tmp_path, replace(CFG, window_s=1.0), 2, {GENERATORS: pool}, metrics)
    clock = [loop.last_check]
    monkeypatch.setattr(elastic_loop.time, "monotonic", lambda: clock[0])
    _trainer_steps(tmp_path / "metrics.jsonl", steps=20, wait_s=0.2)  # idle 67%
    try:
        clock[0] += elastic_loop.CHECK_S
        loop.adjust(procs)  # the first steps read: a window of training not seen yet
        assert not pool.path.exists()
        for _ in range(2):  # a window of training, then one of signals for their trend
            clock[0] += elastic_loop.CHECK_S
            _trainer_steps(tmp_path / "metrics.jsonl", steps=20, wait_s=0.2)
            loop.adjust(procs)
        assert pool.path.read_text() == "2\n" and [p.name for p in procs][-1] == "generator_1"
    finally:
        for p in procs:
            if p.proc is not None:
                p.kill()
                p.proc.wait()
    [_, check] = [r for r in read_metrics(tmp_path) if r["process"] == "controller"]
    assert check["elastic/move"] == 1 and check["elastic/generators"] == 2
    assert check["elastic/trainer_idle"] == pytest.approx(2 / 3)
    history = (tmp_path / "control" / "generators.log").read_text()
    assert "want 2: elastic: trainer idle 67% > 25%" in history


def test_the_loop_moves_reward_servers_on_the_buffer_s_queue(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [
        Supervised("generator_0", [*sleep, "--worker-id", "g0"], logs / "g.log", restartable=True),
        Supervised("reward_0", [*sleep, "--worker-id", "r0"], logs / "r.log", restartable=True),
    ]
    pools = {GENERATORS: RolePool(tmp_path, procs), REWARDS: RolePool(tmp_path, procs, REWARDS)}
    metrics = MetricsConfig(tensorboard=False, progress_bar=False)
    loop = ElasticLoop(tmp_path, replace(CFG, window_s=1.0), 2, pools, metrics, batch_samples=8)
    clock = [loop.last_check]
    monkeypatch.setattr(elastic_loop.time, "monotonic", lambda: clock[0])
    path = tmp_path / "metrics.jsonl"
    try:
        for i in range(4):  # 12 samples queued (1.5 batches), the server busy all the time
            _trainer_steps(path, steps=20, wait_s=0.2)
            buffer = {"process": "buffer", "step": i, "time": 10.0 * i, "buffer/ready_groups": 0}
            buffer.update({"buffer/reward_model_queue": 12, "buffer/reward_model_busy_s": 10.0 * i})
            path.open("a").write(json.dumps(buffer) + "\n")
            clock[0] += elastic_loop.CHECK_S
            loop.adjust(procs)
        assert pools[REWARDS].path.read_text() == "2\n" and not pools[GENERATORS].path.exists()
        assert [p.name for p in procs][-1] == "reward_1" and procs[-1].argv[-1] == "r1"
    finally:
        for p in procs:
            if p.proc is not None:
                p.kill()
                p.proc.wait()
    [check] = [r for r in read_metrics(tmp_path) if "elastic/reward_move" in r]
    assert check["elastic/reward_move"] == 1 and check["elastic/reward_servers"] == 2
    assert check["elastic/reward_queue"] == 1.5 and check["elastic/reward_busy"] == 1.0
    assert check["elastic/generators"] == 1
    assert "want 2: elastic: trainer idle 67%" in (tmp_path / "control" / "rewards.log").read_text()
    # Without two buffer records there is no busy share: it reads as busy, never as idle.
    loop.busy.clear()
    assert loop._signals(1, reward_servers=2).reward_busy == 1.0


def test_the_run_report_gives_the_time_at_each_role_count_and_the_moves():
    checks = [
        {"process": "controller", "time": t, "elastic/generators": g}
        for t, g in ((10.0, 1), (12.0, 2), (14.0, 2), (20.0, 1), (22.0, 1))
    ]
    checks[1]["elastic/move"], checks[3]["elastic/move"] = 1.0, -1.0
    assert elastic_figures([{"process": "trainer", "time": 1.0}, *checks]) == {
        "seconds_at_generators": {"1": 4.0, "2": 8.0},
        "moves": [
            {"at_s": 12.0, "delta": 1, "generators": 2},
            {"at_s": 20.0, "delta": -1, "generators": 1},
        ],
    }
    assert elastic_figures([{"process": "trainer", "time": 1.0}]) is None
    # With lend_waits, lending is a role of 0 or 1 with moves of its own.
    for check, on in zip(checks, (0, 0, 1, 1, 0)):
        check["elastic/lending"] = on
    checks[2]["elastic/lending_move"], checks[4]["elastic/lending_move"] = 1.0, -1.0
    lending = elastic_figures(checks)
    assert lending["seconds_at_lending"] == {"0": 4.0, "1": 8.0}
    assert lending["moves"][1:3] == [
        {"at_s": 14.0, "delta": 1, "lending": 1},
        {"at_s": 20.0, "delta": -1, "generators": 1},
    ]
    assert lending["moves"][-1] == {"at_s": 22.0, "delta": -1, "lending": 0}
