"""Reward scoring for the buffer process: a pool of worker processes that score finished
trajectories with the task's verifier, so that a slow, hanging or crashing reward function
never blocks or takes down the buffer.

The buffer submits (key, split, example index, completion text) and polls for (key, reward)
pairs. Each worker rebuilds the task once from its ``TaskConfig``, so only plain data crosses
the process boundary. The pool owns the worker processes, the items in flight and the
counters: every submitted item comes out of ``poll`` exactly once, with its reward, or with
0.0 after an error, a timeout, or a second death of the worker scoring it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import time
from collections.abc import Callable, Hashable
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.queues import SimpleQueue
from typing import Any, Literal

from asyncrl.tasks import build_task
from asyncrl.tasks.base import Split, Task, TaskConfig, score_or_error
from asyncrl.wire.rewards import ASK_EVERY_S

log = logging.getLogger(__name__)

# An item whose worker died under it is re-submitted once; a second death scores it 0.0.
MAX_WORKER_DEATHS = 2


@dataclass
class RewardConfig:
    workers: int = 1
    """Scoring processes. 0 scores inline in the caller's thread, where `timeout_s` cannot be
    enforced: nothing can interrupt a call from inside the thread that is running it."""
    timeout_s: float = 5.0
    """A score call running longer than this gives reward 0.0, and the workers are restarted
    because a running call cannot be cancelled. Timed from when the call starts in a worker
    (as seen by `poll`), so time queued or in worker start-up never counts."""
    source: Literal["verifier", "model", "mixed"] = "verifier"
    """Where rewards come from: the task's verifier (in the workers above), a reward model
    (`model_path`, scored in a thread of the buffer process or by `model_servers`), or
    "mixed": both, as `verifier_weight * verifier + model_weight * model`."""
    model_path: str = ""
    """HF directory of the reward model (a value-head model; see
    `asyncrl.buffer.reward_model`). Required unless source is "verifier"."""
    verifier_weight: float = 1.0
    """Weight of the verifier's reward when source is "mixed" (unused otherwise)."""
    model_weight: float = 1.0
    """Weight of the reward model's score when source is "mixed" (unused otherwise)."""
    model_batch_size: int = 64
    """Sequences per reward-model forward at most; fewer when fewer are waiting."""
    model_threads: int = 1
    """torch intra-op threads of the reward-model thread's forwards (0: torch's default).
    Set inside that thread, where torch's OpenMP build keeps it to that thread, so the
    rest of the process (e.g. the colocated trainer) keeps its own count. Each reward
    server's threads too."""
    model_servers: int = 0
    """Reward servers the run starts: processes of their own (`reward_K`,
    `asyncrl.buffer.reward_server`) that score for the buffer, each on its own slot, their
    number changed while the run goes on through `RUN_DIR/control/rewards` or by the
    elastic controller. 0: the reward model runs in a thread of the buffer process, which
    suits a model much cheaper than the policy's generation."""
    model_timeout_s: float = 120.0
    """A reward server that holds a batch this long without answering (or, free, asks
    nothing for as long) is taken for dead: its batches go to another server."""

    def check(self) -> None:
        """Raise ValueError, naming the field, if the reward source cannot be used."""
        if self.source not in ("verifier", "model", "mixed"):
            raise ValueError(f'reward.source {self.source!r} is not "verifier", "model" or "mixed"')
        if self.source != "verifier" and not self.model_path:
            raise ValueError(f'reward.model_path must be set when reward.source is "{self.source}"')
        if self.model_servers < 0 or (self.model_servers and self.source == "verifier"):
            raise ValueError(
                f"reward.model_servers={self.model_servers} needs a reward model "
                f'(reward.source "model" or "mixed", got {self.source!r}) and cannot be negative'
            )
        if self.model_timeout_s <= 2 * ASK_EVERY_S:
            raise ValueError(
                f"reward.model_timeout_s={self.model_timeout_s:g} must be above "
                f"{2 * ASK_EVERY_S:g} s: a free reward server asks for work every {ASK_EVERY_S:g} s"
            )
        if self.model_batch_size < 1 or self.model_threads < 0:
            raise ValueError(
                f"reward.model_batch_size must be >= 1 and reward.model_threads >= 0, got "
                f"{self.model_batch_size} and {self.model_threads}"
            )


@dataclass
class _Item:
    """One submitted completion, until ``poll`` reports it."""

    key: Hashable
    split: Split
    index: int
    completion: str
    future: Future[tuple[float, str | None]] | None = None
    """None when the executor refused it (already broken); poll then restarts the pool."""
    started_at: float | None = None
    """When poll learned that a worker began scoring it; None while queued."""
    worker_deaths: int = 0
    """Pool breaks that happened while it was being scored."""


def load_task_factory(path: str | None) -> Callable[[TaskConfig], Task]:
    """The function named by ``path`` ("module:function"), or ``build_task`` for None."""
    if path is None:
        return build_task
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f'scorer_factory {path!r} is not "module:function"')
    return getattr(importlib.import_module(module), name)


def score_safely(task: Task, split: Split, index: int, completion: str) -> tuple[float, str | None]:
    """(reward, None), or (0.0, the error) when the lookup or the scorer raises."""
    # Returned as text, not raised: an exception that cannot be unpickled in the parent
    # would break the whole ProcessPoolExecutor instead of failing one item.
    try:
        example = task.examples(split)[index]
    except Exception as e:
        return 0.0, f"{type(e).__name__}: {e}"
    return score_or_error(task, example, completion)


# Worker-process state, set once per worker by _init_worker.
_worker_task: Task | None = None
_worker_started: SimpleQueue[int] | None = None


def _init_worker(task_cfg: dict[str, Any], factory: str | None, started: SimpleQueue[int]) -> None:
    global _worker_task, _worker_started
    _worker_task = load_task_factory(factory)(TaskConfig(**task_cfg))
    _worker_started = started


def _score_in_worker(
    item_id: int, split: Split, index: int, completion: str
) -> tuple[float, str | None]:
    assert _worker_task is not None and _worker_started is not None
    # Announce the start so the parent times the call, not its wait in the queue. The put is
    # synchronous (SimpleQueue has no feeder thread), so the announcement is out even when
    # scoring then kills this process: the parent needs it to know whom to blame.
    _worker_started.put(item_id)
    return score_safely(_worker_task, split, index, completion)


def _lost(item: _Item) -> bool:
    """Whether the pool broke (a worker died) with ``item`` in it."""
    future = item.future
    return future is None or (future.done() and isinstance(future.exception(), BrokenExecutor))


class RewardPool:
    """Scores completions in worker processes (or inline); see the module docstring.

    Not thread-safe: one thread submits and polls. Timeouts and dead workers are noticed
    in ``poll``, so the caller polls regularly (its event loop does). Workers are spawned,
    so a script that makes a pool needs the ``if __name__ == "__main__":`` guard."""

    def __init__(
        self, task_cfg: TaskConfig, cfg: RewardConfig, scorer_factory: str | None = None
    ) -> None:
        """``scorer_factory``: "module:function" that each worker calls with the TaskConfig
        to get the object it scores with (``examples`` and ``score`` are used); None is
        ``build_task``. A name rather than a callable because workers are spawned."""
        if cfg.workers < 0 or cfg.timeout_s <= 0:
            raise ValueError(f"RewardConfig needs workers >= 0 and timeout_s > 0, got {cfg}")
        self.cfg = cfg
        self._task_cfg = asdict(task_cfg)
        self._factory = scorer_factory
        factory = load_task_factory(scorer_factory)  # a typo fails here, not in every worker
        self._inline_task = factory(TaskConfig(**self._task_cfg)) if cfg.workers == 0 else None
        self._pending: dict[int, _Item] = {}
        self._next_id = 0
        self._results: list[tuple[Hashable, float]] = []
        self._counts = {"scored": 0, "errors": 0, "timeouts": 0, "restarts": 0}
        self._error_logged = False
        self._executor: ProcessPoolExecutor | None = None
        self._started: SimpleQueue[int] | None = None
        if cfg.workers > 0:
            self._start_executor()

    def submit(self, key: Hashable, split: Split, example_index: int, completion: str) -> None:
        """Schedule scoring ``completion`` against ``examples(split)[example_index]``; its
        reward comes out of ``poll`` under ``key`` (keys need not be unique)."""
        item = _Item(key, split, example_index, completion)
        if self._inline_task is not None:
            reward, error = score_safely(self._inline_task, split, example_index, completion)
            self._finish(item, reward, "errors" if error else "scored", error)
            return
        self._pending[self._next_id] = item
        self._dispatch(self._next_id, item)
        self._next_id += 1

    def poll(self) -> list[tuple[Hashable, float]]:
        """(key, reward) of the items finished since the last call, in any order; never
        blocks for long. Also where timeouts and dead workers are handled."""
        if self._executor is not None:
            self._collect()
        results, self._results = self._results, []
        return results

    def pending(self) -> int:
        """Submitted items that ``poll`` has not yet returned."""
        return len(self._pending) + len(self._results)

    def counters(self) -> dict[str, int]:
        """Items finished as "scored", "errors" or "timeouts" (each item in exactly one),
        and "restarts" of the worker pool."""
        return dict(self._counts)

    def close(self) -> None:
        """Stop the workers, killing any stuck in a call; items still pending are dropped."""
        if self._executor is not None:
            self._kill_executor()
            self._executor = None
        self._pending.clear()

    def _start_executor(self) -> None:
        # spawn, not fork: the buffer process runs threads and sockets that a forked child
        # would inherit in an undefined state.
        ctx = multiprocessing.get_context("spawn")
        self._started = ctx.SimpleQueue()
        self._executor = ProcessPoolExecutor(
            max_workers=self.cfg.workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(self._task_cfg, self._factory, self._started),
        )

    def _kill_executor(self) -> None:
        assert self._executor is not None and self._started is not None
        # ProcessPoolExecutor cannot cancel a running call, and shutdown(wait=False) leaves
        # its workers running until their call returns, which a hung call never does. Its
        # private `_processes` (pid -> Process) is the only handle on them; shutdown clears
        # it, so read it first.
        processes = list((self._executor._processes or {}).values())
        self._executor.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.kill()
        for p in processes:
            p.join(timeout=5.0)
        self._started.close()

    def _dispatch(self, item_id: int, item: _Item) -> None:
        assert self._executor is not None
        item.started_at = None
        try:
            item.future = self._executor.submit(
                _score_in_worker, item_id, item.split, item.index, item.completion
            )
        except BrokenExecutor:
            item.future = None

    def _drain_started(self) -> None:
        assert self._started is not None
        now = time.monotonic()
        while not self._started.empty():
            item = self._pending.get(self._started.get())
            if item is not None and item.started_at is None:
                item.started_at = now

    def _collect(self) -> None:
        """Take finished results, time out stuck calls, restart the pool if needed."""
        self._drain_started()
        now = time.monotonic()
        restart = False
        for item_id, item in list(self._pending.items()):
            future = item.future
            if _lost(item):
                restart = True
            elif future is not None and future.done():
                error = future.exception()
                if error is None:
                    reward, message = future.result()
                    self._finish(
                        self._pending.pop(item_id),
                        reward,
                        "errors" if message else "scored",
                        message,
                    )
                else:  # raised past score_safely (e.g. SystemExit): still only this item
                    self._finish(self._pending.pop(item_id), 0.0, "errors", repr(error))
            elif item.started_at is not None and now - item.started_at > self.cfg.timeout_s:
                self._finish(self._pending.pop(item_id), 0.0, "timeouts")
                restart = True
        if restart:
            self._restart()

    def _restart(self) -> None:
        """Replace the executor and re-submit every pending item; an item that was being
        scored when a worker died is blamed, and scores 0.0 at its second death."""
        assert self._executor is not None
        if any(_lost(item) for item in self._pending.values()):
            # Announcements written before the death may have arrived since _collect drained.
            self._drain_started()
            running = [item for item in self._pending.values() if item.started_at is not None]
            # Nothing running: a worker died before scoring anything (its task failed to
            # build?), so blame every item; that bounds the restarts.
            for item in running or list(self._pending.values()):
                item.worker_deaths += 1
            log.warning(
                "reward worker died; restarting the pool (%d items pending)", len(self._pending)
            )
        self._kill_executor()
        self._start_executor()
        self._counts["restarts"] += 1
        for item_id, item in list(self._pending.items()):
            if item.worker_deaths >= MAX_WORKER_DEATHS:
                self._finish(self._pending.pop(item_id), 0.0, "errors", "worker died twice")
            else:
                self._dispatch(item_id, item)

    def _finish(self, item: _Item, reward: float, outcome: str, detail: str | None = None) -> None:
        self._counts[outcome] += 1
        self._results.append((item.key, reward))
        if outcome == "timeouts":
            log.warning(
                "reward timed out after %.1f s on %s:%d", self.cfg.timeout_s, item.split, item.index
            )
        elif outcome == "errors":
            # Once loudly so a broken verifier is visible; the count tells the rest.
            level = logging.DEBUG if self._error_logged else logging.WARNING
            log.log(level, "reward failed on %s:%d: %s", item.split, item.index, detail)
            self._error_logged = True
