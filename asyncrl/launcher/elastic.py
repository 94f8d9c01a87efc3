"""The elastic placement at run time (``placement=elastic``): the launcher reads the run's
metrics as they are written, asks the controller (``asyncrl.elastic``) for a move, and
carries it out through the generator pool (``asyncrl.launcher.pool``) by writing the
count it wants to ``RUN_DIR/control/generators``.

What it reads from ``RUN_DIR/metrics.jsonl`` (new lines every ``CHECK_S``, timed by when
they were read, since each process's ``time`` counts from its own start):

- the trainer's steps: ``train/wait_for_batch_s`` against the whole step (with
  ``train/step_s`` and ``train/weight_publish_s``) gives its idle share, and with
  ``train/tokens`` the trained tokens/s over the steps' own time
  (``asyncrl.elastic.signals``);
- the buffer's ``buffer/ready_groups``, in batches of ``buffer.prompts_per_batch``.

Every check is logged as process ``controller`` (``elastic/generators``, the signals, and
``elastic/move`` on a move), so TensorBoard and ``tools/run_report.py`` show the roles
over time; a move is also said, with its reason, on the launcher's output.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import from_dict
from asyncrl.elastic import Controller, ElasticConfig, Signals, StepRecord, signals
from asyncrl.launcher.pool import GeneratorPool, generator_pool
from asyncrl.launcher.supervise import Supervised, say
from asyncrl.metrics import MetricsConfig, MetricsLogger

CHECK_S = 2.0
"""How often the metrics are read and the controller asked."""


class ElasticLoop:
    """The launcher's ``adjust`` for an elastic run: the controller, then the pool."""

    def __init__(
        self,
        run_dir: Path,
        cfg: ElasticConfig,
        batch_groups: int,
        pool: GeneratorPool,
        metrics: MetricsConfig,
    ) -> None:
        self.cfg, self.batch_groups, self.pool = cfg, batch_groups, pool
        self.path = run_dir / "metrics.jsonl"
        self.offset = 0  # how far the metrics file has been read
        self.controller = Controller(cfg)
        self.steps: deque[tuple[float, StepRecord]] = deque()  # (read at, step)
        self.ready = 0.0
        self.training_since: float | None = None  # when the first trained step was read
        self.last_check = time.monotonic()
        self.checks = 0
        self.log = MetricsLogger(run_dir, "controller", metrics)

    def adjust(self, procs: list[Supervised]) -> None:
        now = time.monotonic()
        if now - self.last_check >= CHECK_S:
            self.last_check = now
            try:
                self._check(now, len(self.pool.live(procs)))
            except (OSError, ValueError, KeyError) as e:  # the run goes on as it is
                say(f"elastic: no decision this time ({type(e).__name__}: {e})")
        self.pool.adjust(procs)

    def _check(self, now: float, generators: int) -> None:
        self._read(now)
        if self.training_since is None or now - self.training_since < self.cfg.window_s:
            return  # a window of training not seen yet (start-up is no steady state)
        if not self.steps:
            return  # no step in the window (a long one, a restart): nothing to judge by
        s = self._signals(generators)
        move = self.controller.decide(now, s)
        scalars = {
            "elastic/generators": float(generators + (move.delta if move else 0)),
            "elastic/trainer_idle": s.trainer_idle,
            "elastic/ready_batches": s.ready_batches,
            "elastic/trained_tokens_per_s": s.trained_tokens_per_s,
        }
        if move is not None:
            cfg, want = self.cfg, generators + move.delta
            want = max(cfg.min_generators, min(cfg.max_generators, want))
            scalars["elastic/move"] = float(want - generators)
            scalars["elastic/generators"] = float(want)
            self.pool.want(want, f"elastic: {move.reason}")
        self.checks += 1
        self.log.log(self.checks, scalars)

    def _read(self, now: float) -> None:
        """Take in the metrics lines written since the last read (whole lines only)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a writer on another node: one record less
            if "train/step_s" in record:
                self.training_since = self.training_since or now
                waited = record.get("train/wait_for_batch_s", 0.0)
                step = StepRecord(
                    seconds=record["train/step_s"]
                    + waited
                    + record.get("train/weight_publish_s", 0.0),
                    waited=waited,
                    tokens=record.get("train/tokens", 0.0),
                )
                self.steps.append((now, step))
            elif "buffer/ready_groups" in record:
                self.ready = record["buffer/ready_groups"]
        while self.steps and self.steps[0][0] < now - self.cfg.window_s:
            self.steps.popleft()

    def _signals(self, generators: int) -> Signals:
        ready = self.ready / self.batch_groups
        return signals(generators, [step for _, step in self.steps], ready)


def run_adjuster(
    run_dir: Path, procs: list[Supervised]
) -> Callable[[list[Supervised]], None] | None:
    """What the supervisor runs every turn for the run in ``run_dir``, from its saved
    config (both launchers): the elastic loop for ``placement=elastic``, the generator
    pool alone for any other run with generators, nothing for a run without them."""
    pool = generator_pool(run_dir, procs)
    path = run_dir / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if pool is None or config.get("placement") != "elastic":
        return pool.adjust if pool is not None else None
    loop = ElasticLoop(
        run_dir,
        from_dict(ElasticConfig, config.get("elastic", {})),
        int(config["buffer"]["prompts_per_batch"]),
        pool,
        from_dict(MetricsConfig, config.get("metrics", {})),
    )
    return loop.adjust
