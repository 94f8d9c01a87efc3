"""Reward scoring as a role of its own: the buffer's ``RewardDispatch`` against real
reward-server processes (``python -m asyncrl.buffer.reward_server``) on the tiny reward
model. Every submitted sequence comes back once, with the score the in-process scorer
gives, while servers are frozen and killed mid-batch, drained, and started anew."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.reward_dispatch import RewardDispatch
from asyncrl.buffer.reward_model import score_sequences
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import ConfigError, save_json
from asyncrl.liveness import EXIT_DRAINED
from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model
from tests.runs import (
    assert_books_balance,
    records,
    run_then_stop,
    short_grpo_command,
    trained_steps,
    wait_for,
)


def _config(tmp_path: Path, rm_path: str, batch: int = 4, timeout_s: float = 6.0):
    reward = RewardConfig(
        workers=0,
        source="model",
        model_path=rm_path,
        model_batch_size=batch,
        model_servers=2,
        model_timeout_s=timeout_s,
    )
    cfg = RolloutConfig(run_dir=str(tmp_path), run_id="rw", reward=reward)
    path = tmp_path / "rollout.json"
    save_json(cfg, path)
    return cfg, path


def _server(path: Path, worker_id: str, tmp_path: Path) -> subprocess.Popen:
    log = open(tmp_path / f"{worker_id}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.buffer.reward_server", "--config", str(path)]
        + ["--worker-id", worker_id],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _sequences(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, 20, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 30, (n,), generator=g)
    ]


def _collect(dispatch: RewardDispatch, got: dict, until, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        for key, score in dispatch.poll():
            assert key not in got, f"{key} scored twice"
            got[key] = score
        assert time.monotonic() < deadline, f"stuck: {dispatch.counters()}"
        time.sleep(0.01)


def _holds_a_batch(dispatch: RewardDispatch, worker_id: str) -> bool:
    return any(job.identity == worker_id.encode() for job in dispatch.jobs.values())


def _freeze_holding_a_batch(dispatch, got, proc, worker_id: str, more) -> None:
    """SIGSTOP ``proc`` while it waits for work, then have ``more()`` send some: the
    buffer gives the waiting server a batch it cannot answer. Stopping a server while it
    scores races its answer (a batch takes milliseconds here); this does not."""
    identity = worker_id.encode()
    # After a poll a server is free only while nothing is queued: it is waiting for work.
    _collect(dispatch, got, lambda: identity in dispatch.free)
    proc.send_signal(signal.SIGSTOP)
    more()
    _collect(dispatch, got, lambda: _holds_a_batch(dispatch, worker_id), 10.0)


def test_reward_servers_score_every_sequence_once_through_kills_and_drains(tmp_path, rm_dir):
    cfg, path = _config(tmp_path, rm_dir)
    dispatch = RewardDispatch(cfg)
    rm = load_model(ModelConfig(path=rm_dir, head="value")).eval()
    seqs = _sequences(240)
    expected = {i: score_sequences(rm, [s], 0)[0] for i, s in enumerate(seqs)}
    got: dict[int, float] = {}
    procs = {w: _server(path, w, tmp_path) for w in ("r0", "r1")}
    unsent = iter(enumerate(seqs))

    def send(n: int) -> None:
        for i, s in itertools.islice(unsent, n):
            dispatch.submit(i, s)

    try:
        send(120)
        # r0 frozen while it holds a batch, then killed: its batch must go to another.
        _collect(dispatch, got, lambda: len(got) >= 8)
        _freeze_holding_a_batch(dispatch, got, procs["r0"], "r0", lambda: send(8))
        procs["r0"].kill()
        send(len(seqs))  # the rest
        _collect(dispatch, got, lambda: len(got) >= 160)
        # r1 drained while it works; r2 joins and scores the rest.
        procs["r1"].send_signal(signal.SIGUSR1)
        assert procs["r1"].wait(30) == EXIT_DRAINED
        procs["r2"] = _server(path, "r2", tmp_path)
        _collect(dispatch, got, lambda: len(got) == len(seqs))
        counters = dispatch.counters()
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        dispatch.close()
    assert sorted(got) == list(range(len(seqs)))
    assert dispatch.pending() == 0
    for i, score in got.items():  # the same score as alone in the buffer's own scorer
        assert score == pytest.approx(expected[i], abs=1e-5), i
    assert counters["resent"] >= 1  # the killed server's batch
    assert counters["scored"] == len(seqs) and counters["errors"] == 0
    assert counters["queue"] == 0 and counters["in_service"] == 0
    assert counters["latency_s"] > 0 and counters["service_s"] > 0


def test_a_late_answer_for_a_batch_sent_again_is_dropped(tmp_path, rm_dir):
    """A server frozen past the timeout answers after its batch went to another: the
    buffer keeps the other's scores and counts the late answer."""
    cfg, path = _config(tmp_path, rm_dir, batch=8, timeout_s=5.0)
    dispatch = RewardDispatch(cfg)
    got: dict[int, float] = {}
    first = _server(path, "r0", tmp_path)
    second = None
    try:
        _collect(dispatch, got, lambda: bool(dispatch.free))  # r0 asked for work
        first.send_signal(signal.SIGSTOP)
        for i, s in enumerate(_sequences(8)):
            dispatch.submit(i, s)
        _collect(dispatch, got, lambda: _holds_a_batch(dispatch, "r0"))  # the only batch
        second = _server(path, "r1", tmp_path)
        _collect(dispatch, got, lambda: len(got) == 8)  # after the timeout, by r1
        first.send_signal(signal.SIGCONT)
        _collect(dispatch, got, lambda: dispatch.counts["late_results"] >= 1, 30)
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
                p.wait()
        dispatch.close()
    assert dispatch.counts["resent"] == 1 and dispatch.counts["scored"] == 8


def test_reward_servers_need_a_reward_model_and_a_separate_process(tmp_path):
    with pytest.raises(ValueError, match="reward.model_servers=2 needs a reward model"):
        RewardConfig(model_servers=2).check()
    with pytest.raises(ValueError, match="reward.model_timeout_s=3 must be above 4"):
        RewardConfig(source="model", model_path="x", model_timeout_s=3).check()
    from asyncrl.config import apply_overrides, load_experiment

    cfg = load_experiment("experiments/tiny_grpo.py")
    overrides = [
        "placement=colocated",
        "reward.source=model",
        "reward.model_path=somewhere",
        "reward.model_servers=1",
    ]
    apply_overrides(cfg, overrides)
    with pytest.raises(ConfigError, match="placement=colocated runs one process: reward"):
        cfg.finalize()


def test_an_rl_run_starts_its_reward_servers_as_processes_of_their_own(tmp_path):
    from asyncrl.config import apply_overrides, load_experiment

    cfg = load_experiment("experiments/tiny_grpo.py")
    apply_overrides(
        cfg,
        [
            f"run_dir={tmp_path}",
            "reward.source=model",
            "reward.model_path=somewhere",
            "reward.model_servers=2",
            "reward.model_threads=2",
        ],
    )
    cfg.finalize()
    procs = {p.name: p for p in cfg.processes(str(tmp_path / "config.json"))}
    assert {"reward_0", "reward_1"} <= procs.keys()
    assert procs["reward_1"].module == "asyncrl.buffer.reward_server"
    assert procs["reward_1"].args[-2:] == ["--worker-id", "r1"]
    assert procs["reward_1"].restartable and procs["reward_1"].threads == 2
    saved = json.loads((tmp_path / "rollout.json").read_text())
    assert saved["reward"]["model_servers"] == 2


def _servers_known(run_dir: Path) -> float:
    """The reward servers the buffer knows, in its latest metrics."""
    known = [r["buffer/reward_model_servers"] for r in records(run_dir) if r["process"] == "buffer"]
    return known[-1] if known else 0.0


def test_a_reward_server_joins_and_leaves_a_running_run_losing_nothing(
    tmp_path, tiny_model_dir, rm_dir
):
    """Through the real local launcher: the reward model scored by a reward server of its
    own; asked for two, a second starts and scores; asked for one, it is drained, not
    restarted, and the run trains on. Every finished sample was scored once, none as an
    error, none sent again."""
    run_dir = tmp_path / "run"
    cmd = short_grpo_command(
        run_dir,
        tiny_model_dir,
        "rl.max_steps=1000000",
        "time_limit_s=600",  # bounds a broken run only: the test stops it
        "reward.source=model",
        f"reward.model_path={rm_dir}",
        "reward.model_servers=1",
        "reward.model_batch_size=4",
        "metrics.interval_s=0.5",
    )
    control = run_dir / "control" / "rewards"

    def steps(lines: list[str]) -> None:
        wait_for(lambda: trained_steps(run_dir) >= 2, 120, "a trained step", 0.2)
        control.write_text("2\n")
        wait_for(lambda: _servers_known(run_dir) == 2, 60, "reward_1 to ask for work", 0.2)
        after = trained_steps(run_dir)
        wait_for(lambda: trained_steps(run_dir) >= after + 5, 120, "steps with two servers", 0.2)
        control.write_text("1\n")
        wait_for(
            lambda: any("reward_1 left the run" in x for x in lines), 120, "reward_1 to go", 0.2
        )
        after = trained_steps(run_dir)
        wait_for(lambda: trained_steps(run_dir) >= after + 5, 120, "steps after reward_1 left", 0.2)

    code, out = run_then_stop(cmd, steps)
    assert code == 130, out[-3000:]
    assert "rewards: draining reward_1 (wanted: 1)" in out and "restart" not in out, out[-3000:]
    scored_by_1 = (run_dir / "logs" / "reward_1.log").read_text()
    assert " sequences scored" in scored_by_1 and "r1: 0 sequences" not in scored_by_1
    c = assert_books_balance(run_dir)
    assert c["buffer/samples_scored"] == c["buffer/reward_model_scored"] > 0, c
    assert c["buffer/reward_model_errors"] == 0 and c["buffer/reward_model_late_results"] == 0
    logged = [r for r in read_metrics(run_dir) if "buffer/reward_model_latency_s" in r]
    assert logged and max(r["buffer/reward_model_servers"] for r in logged) == 2


def test_a_bad_frame_on_the_reward_socket_is_counted_and_dropped(tmp_path, rm_dir):
    import zmq

    from asyncrl.transport import read_endpoints

    cfg, _ = _config(tmp_path, rm_dir)
    dispatch = RewardDispatch(cfg)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    try:
        peer.connect(read_endpoints(tmp_path, "rewards")["jobs"])
        peer.send(b"not msgpack")
        peer.send_multipart([b"two", b"frames"])
        _collect(dispatch, {}, lambda: len(dispatch.decoder.errors) == 2, 10)
        dispatch.submit(0, [3, 4, 5])
        assert dispatch.poll() == [] and dispatch.counters()["queue"] == 1  # still waiting
    finally:
        peer.close(0)
        ctx.term()
        dispatch.close()
    assert dispatch.counters()["bad_frames_decode"] == 1
    assert dispatch.counters()["bad_frames_frames"] == 1
