"""The elastic placement on a simulated GPU cluster: the controller the launcher runs
(``asyncrl.elastic.Controller``, the same code, not a copy) moves slots between generation
and training while the workload changes under it; every fixed split of the same cluster
runs the same workload for comparison (``asyncrl.sim.elastic_study``).

The cluster is ``slots`` slots of ``slot_gpus`` GPUs each, costed by ``asyncrl.sim.gpu``
(assumed figures, not measurements). A slot either generates (its engines join the
generator pool, simulated as one generator with all their slots) or trains (the trainer's
FSDP ranks). The workload changes in phases (``Phases``): response lengths grow linearly
in the policy version to ``length_growth`` times their start, and dynamic sampling drops
a share of groups that rises linearly from ``drop_start`` to ``drop_end``, as accuracy
rises. Costs follow the lengths: a longer context makes each decode step dearer per
sequence and leaves fewer sequences in an engine's KV cache, and a step trains more tokens.

A move is carried out as the real placement carries it out, at assumed costs
(``MoveCosts``):

- a slot from training to generation: the trainer finishes its step, checkpoints and
  restarts one slot smaller (``resize_s``), then the slot's engines start and load the
  weights (``engine_start_s``) before they take leases;
- a slot from generation to training: its engines are drained at once (their sequences
  go on in the rest of the pool, with the tokens they have), and the trainer restarts one
  slot larger at its next step boundary.

With a judge (``asyncrl.sim.scoring``), some slots score the finished samples; a judge
slot more is a generating slot fewer, drained at once, whose judge engines start
(``engine_start_s``) before they take samples; one fewer gives its slot back to
generation the same way. Neither restarts the trainer.

The controller sees what the launcher's loop shows it (``asyncrl.launcher.elastic``): the
trainer's idle share, ready batches and trained tokens/s over the latest ``window_s``,
every ``tick_s``; with a judge, also its queue (in batches) and busy share.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from asyncrl.elastic import Controller, Move
from asyncrl.elastic_signals import Signals, StepRecord, signals, windowed
from asyncrl.sim.buffer import SimBuffer
from asyncrl.sim.gpu import (
    GpuSpec,
    Workload,
    engine_shape,
    gpu_params,
    min_trainer_gpus,
    point_config,
)
from asyncrl.sim.model import length_factor
from asyncrl.sim.processes import Simulation
from asyncrl.sim.scoring import Judge, ScoringServer

COSTS = (
    "decode_fixed_s",
    "decode_per_seq_s",
    "prefill_per_token_s",
    "recompute_per_token_s",
    "weight_sync_s",
    "train_per_token_s",
    "train_fixed_s",
    "prep_per_token_s",
    "publish_s",
)
"""The ``SimParams`` fields that follow the lengths and the split; the workload's own
(lengths, schedules) stay as they were set."""


@dataclass
class Phases:
    """How the workload changes over a run (assumptions)."""

    steps: int = 120
    """Trainer steps of the run; every placement does the same work."""
    length_growth: float = 3.0
    """Mean response length at the last step over the first (DAPO and DeepSeek-R1 report
    lengths that grow several times over a run)."""
    drop_start: float = 0.2
    """Share of groups dynamic sampling drops (all rewards equal) at the first step."""
    drop_end: float = 0.7
    """… and at the last: most groups are all correct once accuracy is high."""


@dataclass
class MoveCosts:
    """What a move costs on a cluster (assumptions)."""

    resize_s: float = 120.0
    """The trainer's checkpoint, restart on the new slot count and reshard on resume."""
    engine_start_s: float = 60.0
    """A slot's inference engines starting and loading the newest weights."""


@dataclass
class ClusterRun:
    """One run's figures."""

    elastic: bool
    time_s: float
    """Simulated seconds to finish ``Phases.steps`` trainer steps."""
    trained_tokens: int
    moves: list[dict[str, Any]]
    seconds_at: dict[int, float]
    """Seconds spent at each count of generating slots."""
    resize_s: float
    """Seconds the trainer spent restarting for moves."""
    judge_busy: float | None = None
    """The judge's busy share over the run (None: no judge)."""
    step_ends_s: list[float] = dataclasses.field(default_factory=list)
    """When each trainer step ended, in order."""

    @property
    def trained_tokens_per_s(self) -> float:
        return self.trained_tokens / self.time_s if self.time_s else 0.0


class ElasticSimulation(Simulation):
    """The async placement on ``slots`` slots, ``generator_slots`` of them generating at
    first and ``judge.slots`` scoring (no judge: rewards cost nothing); ``controller``
    moves them (None: the split stays fixed; anything with a ``cfg`` and ``decide`` as
    ``Controller`` has, such as the study's ``OneMove``)."""

    tick_s = 30.0
    """How often the controller is shown the signals, as the launcher's loop does."""

    def __init__(
        self,
        w: Workload,
        gpu: GpuSpec,
        slots: tuple[int, int],
        generator_slots: int,
        phases: Phases,
        costs: MoveCosts,
        controller: Controller | None,
        max_staleness: int | None = 4,
        seed: int = 0,
        judge: Judge | None = None,
    ) -> None:
        count, self.slot_gpus = slots
        self.judge_slots = judge.slots if judge else 0
        if judge is not None and (judge.slots < 1 or judge.verdict_tokens < 1):
            raise ValueError(f"{judge}: a judge holds at least one slot and writes a token")
        if not 1 <= generator_slots < count - self.judge_slots:
            raise ValueError(
                f"generator_slots={generator_slots} must be within "
                f"1..{count - self.judge_slots - 1} ({self.judge_slots} judge slots)"
            )
        self.w, self.gpu, self.phases, self.costs = w, gpu, phases, costs
        self.controller = controller
        self.gen_slots = generator_slots
        self.train_slots = count - generator_slots - self.judge_slots
        self.fewest_training = math.ceil(min_trainer_gpus(w, gpu) / self.slot_gpus)
        self.tp, per_engine = engine_shape(w, gpu)
        params = gpu_params(w, gpu, self.train_slots * self.slot_gpus, self._nodes())
        params.filter_schedule = [(0, phases.drop_start), (phases.steps, phases.drop_end)]
        params.length_schedule = [(0, 1.0), (phases.steps, phases.length_growth)]
        cfg = point_config(w, per_engine, self._engines(), max_staleness, False, phases.steps)
        cfg = dataclasses.replace(cfg, seed=seed)
        super().__init__(cfg, params, SimBuffer(cfg, params, random.Random(seed)))
        if judge is not None:
            self.server = ScoringServer(self, judge.verdict_tokens)
            self._costs_now()
        self.pending = 0  # +1/-1: a move the trainer carries out at its next step boundary
        self.moving = False  # a move is under way (until the slot serves its new role)
        self.resize_s, self.moves = 0.0, []
        self.seconds_at: dict[int, float] = {}
        self.since = 0.0
        self.steps: deque[tuple[float, StepRecord]] = deque()  # (ended at, step)
        self.step_began = self.waited_before = 0.0
        self.ready: deque[tuple[float, float]] = deque()  # (time, ready batches)

    def _nodes(self) -> int:
        return max(1, math.ceil(self.gen_slots * self.slot_gpus / self.gpu.gpus_per_node))

    def _engines(self) -> int:
        return max(1, self.gen_slots * self.slot_gpus // self.tp)

    def _costs_now(self) -> None:
        """Costs for the lengths of the current version on the current split."""
        scale = length_factor(self.params.length_schedule, self.buffer.version)
        w = dataclasses.replace(self.w, response_mean=self.w.response_mean * scale)
        fresh = gpu_params(w, self.gpu, self.train_slots * self.slot_gpus, self._nodes())
        for name in COSTS:
            setattr(self.params, name, getattr(fresh, name))
        gen, per_engine = self.generators[0], engine_shape(w, self.gpu)[1]
        gen.replicas = self._engines()
        gen.slots = per_engine * gen.replicas
        if self._judged():
            engines = max(1, self.judge_slots * self.slot_gpus // self.tp)
            self.server.judge.resize(engines, per_engine)

    def _set_generating(self, gen_slots: int) -> None:
        now = self.loop.now
        self.seconds_at[self.gen_slots] = (
            self.seconds_at.get(self.gen_slots, 0.0) + now - self.since
        )
        self.gen_slots, self.since = gen_slots, now
        self._costs_now()

    # ---- steps and moves -----------------------------------------------------------------
    def start(self) -> None:
        super().start()
        if self.controller is not None:
            self.loop.after(self.tick_s, self._tick)

    def next_step(self) -> None:
        """Between two trainer steps: the costs of the new version, and a resize if due."""
        self._record_step()
        delta, self.pending = self.pending, 0
        if delta == 0:
            self._costs_now()
            self._request()
            return
        self.train_slots -= delta
        self._costs_now()
        self.resize_s += self.costs.resize_s
        self.loop.after(self.costs.resize_s, self._request)
        if delta > 0:  # the slots the trainer gave up start their engines
            wait = self.costs.resize_s + self.costs.engine_start_s
            self.loop.after(wait, self._engines_in, delta)
        else:
            self.loop.after(self.costs.resize_s, self._moved)

    def _request(self) -> None:
        """The trainer asks for its next batch: a step's time counts from here."""
        self.step_began, self.waited_before = self.loop.now, self.trainer.wait_s
        super().next_step()

    def _record_step(self) -> None:
        t = self.trainer
        step = StepRecord(
            seconds=self.loop.now - self.step_began,
            waited=t.wait_s - self.waited_before,
            tokens=t.step_ends[-1][1],
        )
        self.steps.append((self.loop.now, step))

    def _engines_in(self, added: int) -> None:
        self._set_generating(self.gen_slots + added)
        self._moved()
        self.generators[0].wake()  # idle for want of slots: it has more now

    def _moved(self) -> None:
        self.moving = False

    def _move(self, move: Move, s: Signals) -> None:
        judging = move.role == "rewards"
        generating = self.gen_slots - move.delta if judging else self.gen_slots + move.delta
        record = {
            "time_s": round(self.loop.now, 1),
            "step": self.trainer.step,
            "generator_slots": generating,
            "reason": move.reason,
            "trainer_idle": round(s.trainer_idle, 3),
            "ready_batches": round(s.ready_batches, 2),
            "trained_tokens_per_s": round(s.trained_tokens_per_s),
        }
        if self._judged():
            record["role"] = move.role
            record["judge_slots"] = self.judge_slots + (move.delta if judging else 0)
            record["judge_queue_batches"] = round(s.reward_queue, 2)
            record["judge_busy"] = round(s.reward_busy, 3)
        self.moves.append(record)
        self.moving = True
        if judging:  # the slot leaving its role is drained now; the other starts engines
            if move.delta > 0:
                self._set_generating(self.gen_slots - move.delta)
                self.loop.after(self.costs.engine_start_s, self._judges_in, move.delta)
            else:
                self._set_judging(self.judge_slots + move.delta)
                self.loop.after(self.costs.engine_start_s, self._engines_in, -move.delta)
            return
        self.pending = move.delta
        if move.delta < 0:  # drained now: their sequences go on in the rest of the pool
            self._set_generating(self.gen_slots + move.delta)

    def _set_judging(self, judge_slots: int) -> None:
        self.judge_slots = judge_slots
        self._costs_now()

    def _judges_in(self, added: int) -> None:
        self._set_judging(self.judge_slots + added)
        self._moved()

    def _tick(self) -> None:
        """What the launcher's loop does every check: the window's signals to the
        controller, once a window of training has passed and no move is under way."""
        if self.done:
            return
        now, cfg = self.loop.now, self.controller.cfg
        self.ready.append((now, len(self.buffer.ready) / self.cfg.prompts_per_batch))
        window = windowed(self.steps, now, cfg.window_s, cfg.window_steps)
        judged = self.server.judge.observe(window) if self._judged() else None
        while self.ready and self.ready[0][0] < now - window:
            self.ready.popleft()
        trained = self.trainer.step_ends
        if trained and now - trained[0][0] >= cfg.window_s and self.steps and not self.moving:
            ready = sum(r for _, r in self.ready) / len(self.ready)
            steps = [step for _, step in self.steps]
            s = signals(self.gen_slots, steps, ready, self.train_slots)
            s = s._replace(steps_left=self.phases.steps - self.trainer.step)
            if judged is not None:
                batch = self.cfg.prompts_per_batch * self.cfg.samples_per_prompt
                queue, busy = judged[0] / batch, judged[1]
                s = s._replace(
                    reward_servers=self.judge_slots, reward_queue=queue, reward_busy=busy
                )
                self._bound_controller()
            move = self.controller.decide(now, s)
            if move is not None:
                self._move(move, s)
        self.loop.after(self.tick_s, self._tick)

    def _bound_controller(self) -> None:
        """The controller's bounds: the slots each role can take from another now (a
        judge slot comes from generation; training keeps the slots its memory needs)."""
        self.controller.cfg = dataclasses.replace(
            self.controller.cfg,
            max_generators=self.gen_slots + self.train_slots - self.fewest_training,
            min_reward_servers=1,
            max_reward_servers=self.judge_slots + self.gen_slots - 1,
        )

    def run_to_end(self) -> ClusterRun:
        """The run to ``phases.steps`` trainer steps, its books checked."""
        self.start()
        self.loop.run(float("inf"), stop=lambda: self.done)
        self.buffer.check_accounting()
        return self.result()

    def result(self) -> ClusterRun:
        self._set_generating(self.gen_slots)
        return ClusterRun(
            elastic=self.controller is not None,
            time_s=self.loop.now,
            trained_tokens=sum(k for _, k in self.trainer.step_ends),
            moves=self.moves,
            seconds_at=dict(sorted(self.seconds_at.items())),
            resize_s=self.resize_s,
            judge_busy=self._judge_busy(),
            step_ends_s=[end for end, _ in self.trainer.step_ends],
        )

    def _judge_busy(self) -> float | None:
        return self.server.judge.busy_share() if self._judged() else None

    def _judged(self) -> bool:
        """Whether a judge scores the samples (rewards cost compute)."""
        return isinstance(self.server, ScoringServer)
