"""Lending the trainer's waits as an elastic move (``elastic.lend_waits``), the colocated ↔
async switch: the controller lends them where the trainer waits and no generator more can
be added, judges the move as any other and stops lending where the trainer is busy; the
launcher's loop carries it out through ``RUN_DIR/control/lending``; the trainer's
``LendingSource`` starts a lent generator when the switch is on and, switched off, drains
it (its leases go back to the buffer with their tokens) and frees its engine."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from dataclasses import replace

import pytest

from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.buffer.server import BufferServer
from asyncrl.config import ConfigError
from asyncrl.elastic import LENDING, Controller, ElasticConfig
from asyncrl.elastic_signals import Signals
from asyncrl.generator.lent import LendingSource
from asyncrl.launcher import elastic as elastic_loop
from asyncrl.launcher.elastic import ElasticLoop
from asyncrl.launcher.pool import GENERATORS, RolePool
from asyncrl.launcher.supervise import Supervised
from asyncrl.liveness import LendSwitch
from asyncrl.metrics import MetricsConfig, read_metrics
from asyncrl.stages.rl_config import RLExperiment
from tests.runs import assert_lent_drained, run_short_grpo
from tests.test_drain import PROMPTS, _config, _prompts
from tests.test_elastic import WAITING, feed
from tests.test_elastic_loop import _trainer_steps

CFG = ElasticConfig(min_generators=1, max_generators=1, dwell_s=60.0, lend_waits=True)
BUSY = dict(trainer_idle=0.0, ready_batches=0.0)


def test_a_waiting_trainer_at_the_most_generators_lends_its_waits_and_stops_when_busy():
    c = Controller(CFG)
    [(at, lend)] = feed(c, 0, 30, Signals(1, trained_tokens_per_s=100.0, **WAITING))
    assert at == 30 and (lend.role, lend.delta) == (LENDING, 1)
    assert "no generator more" in lend.reason
    # Judged a dwell later as a generator more is (+30%: kept); then the trainer is busy.
    lending = Signals(1, trained_tokens_per_s=130.0, lending=True, **WAITING)
    assert feed(c, 35, 90, lending) == []
    busy = Signals(1, trained_tokens_per_s=130.0, lending=True, **BUSY)
    [(_, stop)] = feed(c, 95, 150, busy)
    assert (stop.role, stop.delta) == (LENDING, -1) and "memory goes back" in stop.reason


def test_lending_that_does_not_pay_is_undone_and_a_generator_more_comes_first():
    c = Controller(CFG)
    feed(c, 0, 30, Signals(1, trained_tokens_per_s=100.0, **WAITING))
    lending = Signals(1, trained_tokens_per_s=101.0, lending=True, **WAITING)
    [(_, undo)] = feed(c, 35, 90, lending)
    assert (undo.role, undo.delta) == (LENDING, -1) and undo.reason.startswith("undo +1")
    # Where a generator more can still be added, that is the move; without lend_waits,
    # nothing lends.
    c = Controller(replace(CFG, max_generators=2))
    [(_, more)] = feed(c, 0, 30, Signals(1, trained_tokens_per_s=100.0, **WAITING))
    assert (more.role, more.delta) == ("generators", 1)
    c = Controller(replace(CFG, lend_waits=False))
    assert feed(c, 0, 300, Signals(1, trained_tokens_per_s=100.0, **WAITING)) == []


def test_the_loop_switches_the_trainer_s_lending_through_its_control_file(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "--worker-id", "g0"]
    procs = [Supervised("generator_0", sleeper, logs / "generator_0.log", restartable=True)]
    metrics = MetricsConfig(tensorboard=False, progress_bar=False)
    pools = {GENERATORS: RolePool(tmp_path, procs)}
    loop = ElasticLoop(tmp_path, replace(CFG, window_s=1.0), 2, pools, metrics)
    switch = LendSwitch(tmp_path)
    assert switch.path.read_text() == "0\n"  # the run starts without lending
    clock = [loop.last_check]
    monkeypatch.setattr(elastic_loop.time, "monotonic", lambda: clock[0])
    for _ in range(3):  # steps read, a window of training, then one for the trend
        _trainer_steps(tmp_path / "metrics.jsonl", steps=20, wait_s=0.2)  # idle 67%
        clock[0] += elastic_loop.CHECK_S
        loop.adjust(procs)
    assert switch.on and [p.name for p in procs] == ["generator_0"]
    [_, check] = [r for r in read_metrics(tmp_path) if r["process"] == "controller"]
    assert check["elastic/lending_move"] == 1 and check["elastic/lending"] == 1


class _Waiting:
    """A trainer's batch source that waits ``wait_s`` for each batch, and has none."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s, self.closed = wait_s, False

    def request_batch(self, step, world_size, *args, **kwargs):
        time.sleep(self.wait_s)

    def close(self) -> None:
        self.closed = True


def test_a_switched_lending_source_starts_a_lent_generator_and_frees_it_when_off(
    tmp_path, tiny_model_dir
):
    """Off: no lent generator. On: one joins and decodes while the trainer waits. Off
    again: it is drained, its leases handed back with their tokens, and its engine freed;
    on again, a new one joins under a new worker id and the batch completes."""
    cfg = _config(tmp_path / "run", tiny_model_dir)
    transport = replace(cfg.transport, chunk_tokens=1)  # a sample's tokens go out as made
    cfg = replace(cfg, sampling=replace(cfg.sampling, max_new_tokens=32), transport=transport)
    buffer = RolloutBuffer(cfg.buffer, cfg.run_id, _prompts, cfg.sampling.spec(seed=7))
    server = BufferServer(cfg, buffer, InlineScoring(lambda *_: 1.0))
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    switch = LendSwitch(cfg.run_dir)
    waiting = _Waiting(0.02)  # short waits, a few decode steps each: caught mid-sample
    source = LendingSource(waiting, cfg, 0, switch)
    try:
        source.request_batch(0, 1)
        assert source.worker is None  # no control file: not lending
        switch.set(True)
        deadline = time.monotonic() + 60
        while not (source.worker and any(p.seq for p in source.worker.pending.values())):
            assert time.monotonic() < deadline, "the lent generator began no sample"
            source.request_batch(0, 1)  # between calls the gate is closed: nothing steps
        engine = weakref.ref(source.worker.engine)
        first = source.worker
        switch.set(False)
        source.request_batch(0, 1)
        assert source.worker is None and first.leases_handed_back >= 1
        handed_back, first = first.leases_handed_back, None
        gc.collect()
        assert engine() is None, "the lent engine was not freed"
        switch.set(True)
        waiting.wait_s = 0.2
        deadline = time.monotonic() + 120
        while len(buffer.state.ready) < PROMPTS:
            assert time.monotonic() < deadline, "the batch never completed"
            source.request_batch(0, 1)
        assert source.worker.worker_id == "lent0-1"
    finally:
        source.close()
        server.stop()
        serving.join(timeout=30)
    counts = buffer.state.counts
    assert counts["leases_revoked_drained"] == handed_back
    assert counts["leases_continued"] >= 1 and counts.get("tokens_revoked_alive", 0) == 0
    assert source.inner.closed


def test_lending_moves_are_refused_outside_the_elastic_placement_or_beside_always_lending():
    with pytest.raises(ConfigError, match="elastic.lend_waits"):
        RLExperiment(elastic=ElasticConfig(lend_waits=True)).finalize()
    both = RLExperiment(
        placement="elastic", generate_while_waiting=True, elastic=ElasticConfig(lend_waits=True)
    )
    with pytest.raises(ConfigError, match="generate_while_waiting=True"):
        both.finalize()


def test_an_elastic_run_lends_the_trainer_s_waits_through_the_launcher(tmp_path, tiny_model_dir):
    """``tiny_grpo`` under ``placement=elastic`` with one generator at most and lending
    moves, at staleness 0, so that the trainer waits for every batch and the controller's
    first look lends: the launcher turns lending on, the trainer's lent generator sends
    tokens and is drained at the end, and the books balance."""
    run_dir = tmp_path / "run"
    output = run_short_grpo(
        run_dir,
        tiny_model_dir,
        # A time, not a step count: the controller lends after two windows and a trend
        # (some 16 s); a step count can end sooner (150 steps: 9 s on an unloaded machine).
        "rl.max_steps=100000",
        "time_limit_s=30",
        "buffer.max_staleness=0",
        "placement=elastic",
        "elastic.max_generators=1",
        "elastic.lend_waits=true",
        "elastic.dwell_s=8",
        "elastic.window_s=4",
    )
    assert "elastic: lending the trainer's waits" in output, output[-3000:]
    checks = [r for r in read_metrics(run_dir) if r["process"] == "controller"]
    assert any(r.get("elastic/lending_move") == 1 for r in checks), checks[-3:]
    assert_lent_drained(run_dir)
