"""The elastic placement at run time (``placement=elastic``): the launcher reads the run's
metrics as they are written, asks the controller (``asyncrl.elastic``) for a move, and
carries it out through the role's pool (``asyncrl.launcher.pool``) by writing the count
it wants to ``RUN_DIR/control/generators`` or ``RUN_DIR/control/rewards``. With
``elastic.lend_waits``, a lending move writes ``1`` or ``0`` to ``RUN_DIR/control/lending``,
which the trainer reads before each batch it asks for (``asyncrl.generator.lent``).

What it reads from ``RUN_DIR/metrics.jsonl`` (new lines every ``CHECK_S``, timed by when
they were read, since each process's ``time`` counts from its own start):

- the trainer's steps: ``train/wait_for_batch_s`` against the whole step (with
  ``train/step_s`` and ``train/weight_publish_s``) gives its idle share, and with
  ``train/tokens`` the trained tokens/s over the steps' own time
  (``asyncrl.elastic.signals``);
- the buffer's ``buffer/ready_groups``, in batches of ``buffer.prompts_per_batch``;
- with reward servers, the buffer's ``buffer/reward_model_queue`` (samples waiting for a
  server, in batches) and ``buffer/reward_model_busy_s`` (its rate over the servers,
  timed by the buffer's own clock, is their busy share).

Every check is logged as process ``controller`` (``elastic/generators``,
``elastic/reward_servers``, ``elastic/lending``, the signals, and ``elastic/move``,
``elastic/reward_move`` or ``elastic/lending_move`` on a move), so TensorBoard and
``tools/run_report.py`` show the roles over time; a move is also said, with its reason,
on the launcher's output.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import from_dict
from asyncrl.elastic import LENDING, Controller, ElasticConfig, Move
from asyncrl.elastic_signals import Signals, StepRecord, signals, windowed
from asyncrl.launcher.pool import GENERATORS, REWARDS, Role, RolePool, role_pools
from asyncrl.launcher.supervise import Supervised, say
from asyncrl.liveness import LendSwitch
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
        pools: dict[Role, RolePool],
        metrics: MetricsConfig,
        batch_samples: int = 0,
    ) -> None:
        self.cfg, self.batch_groups = cfg, batch_groups
        self.batch_samples = batch_samples  # a batch's samples, the reward queue's unit
        self.pool: RolePool = pools[GENERATORS]
        self.rewards: RolePool | None = pools.get(REWARDS)
        self.path = run_dir / "metrics.jsonl"
        self.offset = 0  # how far the metrics file has been read
        self.controller = Controller(cfg)
        self.steps: deque[tuple[float, StepRecord]] = deque()  # (read at, step)
        self.ready = 0.0
        self.reward_queue = 0.0  # samples waiting for a reward server, latest
        self.busy: deque[tuple[float, float]] = deque()  # (buffer time, servers' busy s)
        self.training_since: float | None = None  # when the first trained step was read
        self.last_check = time.monotonic()
        self.checks = 0
        self.log = MetricsLogger(run_dir, "controller", metrics)
        self.lending = LendSwitch(run_dir)
        if cfg.lend_waits:
            self.lending.set(False)  # the run starts without lending; moves turn it on

    def adjust(self, procs: list[Supervised]) -> None:
        now = time.monotonic()
        if now - self.last_check >= CHECK_S:
            self.last_check = now
            try:
                rewards = len(self.rewards.live(procs)) if self.rewards else 0
                self._check(now, len(self.pool.live(procs)), rewards)
            except (OSError, ValueError, KeyError) as e:  # the run goes on as it is
                say(f"elastic: no decision this time ({type(e).__name__}: {e})")
        self.pool.adjust(procs)
        if self.rewards is not None:
            self.rewards.adjust(procs)

    def _check(self, now: float, generators: int, reward_servers: int = 0) -> None:
        self._read(now)
        if self.training_since is None or now - self.training_since < self.cfg.window_s:
            return  # a window of training not seen yet (start-up is no steady state)
        if not self.steps:
            return  # no step in the window (a long one, a restart): nothing to judge by
        s = self._signals(generators, reward_servers)
        move = self.controller.decide(now, s)
        scalars = {
            "elastic/generators": float(generators),
            "elastic/trainer_idle": s.trainer_idle,
            "elastic/ready_batches": s.ready_batches,
            "elastic/trained_tokens_per_s": s.trained_tokens_per_s,
        }
        if self.cfg.lend_waits:
            scalars["elastic/lending"] = float(s.lending)
        if self.rewards is not None:
            scalars["elastic/reward_servers"] = float(reward_servers)
            scalars["elastic/reward_queue"] = s.reward_queue
            scalars["elastic/reward_busy"] = s.reward_busy
        if move is not None:
            scalars.update(self._carry_out(move, generators, reward_servers))
        self.checks += 1
        self.log.log(self.checks, scalars)

    def _carry_out(self, move: Move, generators: int, reward_servers: int) -> dict[str, float]:
        """Ask the move's pool for its new count (within the configured range); the
        scalars that record it."""
        cfg = self.cfg
        if move.role == LENDING:
            on = move.delta > 0
            self.lending.set(on)
            say(
                f"elastic: {'lending' if on else 'no longer lending'} the trainer's waits: {move.reason}"
            )
            return {"elastic/lending_move": float(move.delta), "elastic/lending": float(on)}
        if move.role == "rewards" and self.rewards is not None:
            want = max(
                cfg.min_reward_servers, min(cfg.max_reward_servers, reward_servers + move.delta)
            )
            self.rewards.want(want, f"elastic: {move.reason}")
            return {
                "elastic/reward_move": float(want - reward_servers),
                "elastic/reward_servers": float(want),
            }
        want = max(cfg.min_generators, min(cfg.max_generators, generators + move.delta))
        self.pool.want(want, f"elastic: {move.reason}")
        return {"elastic/move": float(want - generators), "elastic/generators": float(want)}

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
                self.reward_queue = record.get("buffer/reward_model_queue", 0.0)
                if self.busy and record["time"] < self.busy[-1][0]:
                    self.busy.clear()  # a restarted buffer: its clock and count begin again
                if "buffer/reward_model_busy_s" in record:
                    self.busy.append((record["time"], record["buffer/reward_model_busy_s"]))
        window = windowed(self.steps, now, self.cfg.window_s, self.cfg.window_steps)
        while len(self.busy) > 2 and self.busy[1][0] < self.busy[-1][0] - window:
            self.busy.popleft()  # keeps one record at or before the window's start

    def _signals(self, generators: int, reward_servers: int = 0) -> Signals:
        ready = self.ready / self.batch_groups
        s = signals(generators, [step for _, step in self.steps], ready)
        s = s._replace(lending=self.cfg.lend_waits and self.lending.on)
        if not reward_servers:
            return s
        busy = 1.0  # not measured yet (a buffer just started): no server is given back on it
        if len(self.busy) >= 2 and self.busy[-1][0] > self.busy[0][0]:
            (t0, b0), (t1, b1) = self.busy[0], self.busy[-1]
            busy = min(1.0, (b1 - b0) / ((t1 - t0) * reward_servers))
        queue = self.reward_queue / max(self.batch_samples, 1)
        return s._replace(reward_servers=reward_servers, reward_queue=queue, reward_busy=busy)


def run_adjuster(
    run_dir: Path, procs: list[Supervised]
) -> Callable[[list[Supervised]], None] | None:
    """What the supervisor runs every turn for the run in ``run_dir``, from its saved
    config (both launchers): the elastic loop for ``placement=elastic``, the role pools
    alone for any other run with generators or reward servers, nothing for a run without
    them."""
    pools = role_pools(run_dir, procs)
    path = run_dir / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if GENERATORS not in pools or config.get("placement") != "elastic":
        return _each(list(pools.values())) if pools else None
    buffer = config["buffer"]
    loop = ElasticLoop(
        run_dir,
        from_dict(ElasticConfig, config.get("elastic", {})),
        int(buffer["prompts_per_batch"]),
        pools,
        from_dict(MetricsConfig, config.get("metrics", {})),
        batch_samples=int(buffer["prompts_per_batch"]) * int(buffer["samples_per_prompt"]),
    )
    return loop.adjust


def _each(pools: list[RolePool]) -> Callable[[list[Supervised]], None]:
    """One supervisor turn's ``adjust`` for every pool."""

    def adjust(procs: list[Supervised]) -> None:
        for pool in pools:
            pool.adjust(procs)

    return adjust
