"""Tests for asyncrl.buffer.rewards: the reward worker pool, inline scoring, and recovery
from scorers that raise, hang, or kill their worker.

The misbehaving scorers are module-level factories named by import path, because the
workers are spawned and rebuild their scorer from a name and a TaskConfig."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import pytest

from asyncrl.buffer.rewards import RewardConfig, RewardPool
from asyncrl.tasks import Example, Task, TaskConfig, build_task

TASK_CFG = TaskConfig(train_size=200, eval_size=20)
TRIGGER = "misbehave"
"""The completion on which the test scorers below raise, hang or die."""


class _Misbehaving:
    """The real task, except that scoring ``TRIGGER`` calls ``act`` first."""

    def __init__(self, cfg: TaskConfig, act: Callable[[], None]) -> None:
        self.task = build_task(cfg)
        self.act = act

    def examples(self, split):
        return self.task.examples(split)

    def score(self, example: Example, completion: str) -> float:
        if completion == TRIGGER:
            self.act()
        return self.task.score(example, completion)


def _raise() -> None:
    raise RuntimeError("verifier broke")


def failing_task(cfg: TaskConfig) -> _Misbehaving:
    return _Misbehaving(cfg, _raise)


def slow_task(cfg: TaskConfig) -> _Misbehaving:
    return _Misbehaving(cfg, lambda: time.sleep(60))


def crashing_task(cfg: TaskConfig) -> _Misbehaving:
    return _Misbehaving(cfg, lambda: os._exit(3))


# By the name pytest imported this module under, which the spawned workers import too.
FAILING, SLOW, CRASHING = (
    f"{__name__}:{f}" for f in ("failing_task", "slow_task", "crashing_task")
)


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(TASK_CFG)


@pytest.fixture(autouse=True)
def no_leftover_workers():
    yield
    assert _worker_processes() == [], "a test left reward workers running"


def _worker_processes() -> list[int]:
    """Live children of this process started by multiprocessing's spawn (the resource
    tracker, which lives as long as this process, is started differently)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[1]) == os.getpid() and b"spawn_main" in cmdline:
            children.append(int(stat.parent.name))
    return children


def _drain(pool: RewardPool, timeout_s: float = 30.0) -> dict[Hashable, float]:
    """Poll until nothing is pending; each key must come out exactly once."""
    deadline = time.monotonic() + timeout_s
    results: dict[Hashable, float] = {}
    while pool.pending():
        assert time.monotonic() < deadline, f"{pool.pending()} items still pending"
        for key, reward in pool.poll():
            assert key not in results, f"{key} reported twice"
            results[key] = reward
        time.sleep(0.02)
    assert pool.poll() == []
    return results


def _cases(task: Task) -> dict[tuple[str, int, str], tuple[str, float]]:
    """(split, index, kind) -> (completion, expected reward): the reference completion
    scores 1, an off-by-one answer and text without a number score 0."""
    cases = {}
    for split, indices in (("train", range(0, 200, 40)), ("eval", (0, 19))):
        for i in indices:
            ex = task.examples(split)[i]
            cases[(split, i, "right")] = (ex.completion, 1.0)
            cases[(split, i, "wrong")] = (f" {int(ex.answer) + 1}", 0.0)
            cases[(split, i, "empty")] = ("no idea", 0.0)
    return cases


def _submit_all(pool: RewardPool, cases) -> None:
    for (split, i, kind), (completion, _) in cases.items():
        pool.submit((split, i, kind), split, i, completion)


def test_workers_score_like_the_task(task):
    cases = _cases(task)
    pool = RewardPool(TASK_CFG, RewardConfig(workers=2))
    try:
        _submit_all(pool, cases)
        # The workers are still starting (a spawn and an import): a poll that waited for
        # them would return scores; this one returns before any exists.
        assert pool.poll() == [] and pool.pending() == len(cases)
        assert len(_worker_processes()) == 2
        results = _drain(pool)
    finally:
        pool.close()
    assert results == {key: reward for key, (_, reward) in cases.items()}
    assert pool.counters() == {"scored": len(cases), "errors": 0, "timeouts": 0, "restarts": 0}


def test_inline_gives_the_same_numbers(task):
    cases = _cases(task)
    pool = RewardPool(TASK_CFG, RewardConfig(workers=0))
    _submit_all(pool, cases)
    assert pool.pending() == len(cases)
    results = _drain(pool)
    pool.close()
    assert results == {key: reward for key, (_, reward) in cases.items()}
    assert results == {
        (split, i, kind): task.score(task.examples(split)[i], completion)
        for (split, i, kind), (completion, _) in cases.items()
    }
    assert pool.counters()["scored"] == len(cases)


@pytest.mark.parametrize("workers", [1, 0])
def test_raising_scorer_gives_zero_and_is_counted(task, workers):
    pool = RewardPool(TASK_CFG, RewardConfig(workers=workers), scorer_factory=FAILING)
    ex = task.examples("train")[5]
    try:
        pool.submit("before", "train", 5, ex.completion)
        pool.submit("raises", "train", 5, TRIGGER)
        pool.submit("after", "train", 5, ex.completion)
        pool.submit("bad index", "train", 10_000, ex.completion)
        results = _drain(pool)
    finally:
        pool.close()
    assert results == {"before": 1.0, "raises": 0.0, "after": 1.0, "bad index": 0.0}
    assert pool.counters() == {"scored": 2, "errors": 2, "timeouts": 0, "restarts": 0}


def test_hanging_scorer_times_out_and_nothing_is_lost(task):
    # One worker, so the items submitted after the hang wait behind it, are lost with the
    # killed worker and must be re-submitted; they must not time out for having waited,
    # nor while the new worker starts (which takes longer than the 1 s timeout).
    pool = RewardPool(TASK_CFG, RewardConfig(workers=1, timeout_s=1.0), scorer_factory=SLOW)
    train = task.examples("train")
    expected = {}
    try:
        for i in range(6):
            completion = TRIGGER if i == 2 else train[i].completion
            pool.submit(i, "train", i, completion)
            expected[i] = 0.0 if i == 2 else 1.0
        t = time.monotonic()
        results = _drain(pool)
        elapsed = time.monotonic() - t
    finally:
        pool.close()
    assert results == expected
    assert pool.counters() == {"scored": 5, "errors": 0, "timeouts": 1, "restarts": 1}
    assert elapsed < 60  # the hang was cut by the timeout, not slept out (the scorer sleeps 60 s)


def test_dead_worker_is_retried_once_then_scores_zero(task):
    pool = RewardPool(TASK_CFG, RewardConfig(workers=1), scorer_factory=CRASHING)
    train = task.examples("train")
    try:
        pool.submit("ok", "train", 0, train[0].completion)
        results = _drain(pool)  # scored by the first pool, before any death
        pool.submit("dies", "train", 1, TRIGGER)
        pool.submit("queued", "train", 2, train[2].completion)
        pool.submit("queued wrong", "train", 3, " nope")
        results |= _drain(pool)
    finally:
        pool.close()
    assert results == {"ok": 1.0, "dies": 0.0, "queued": 1.0, "queued wrong": 0.0}
    # The crasher is blamed for both deaths; the queued items never were, so they survive.
    assert pool.counters() == {"scored": 3, "errors": 1, "timeouts": 0, "restarts": 2}


def test_close_kills_a_stuck_worker(task):
    pool = RewardPool(TASK_CFG, RewardConfig(workers=2, timeout_s=30.0), scorer_factory=SLOW)
    submitted = time.monotonic()
    pool.submit("stuck", "train", 0, TRIGGER)
    pool.submit("fine", "train", 1, task.examples("train")[1].completion)
    deadline = time.monotonic() + 20
    while not pool.poll():  # "fine" done: the workers are up and "stuck" is sleeping
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert len(_worker_processes()) == 2
    pool.close()
    # "stuck" began its 60 s sleep after it was submitted: close killed it, not waited.
    assert time.monotonic() - submitted < 60
    assert _worker_processes() == []
    assert pool.pending() == 0
