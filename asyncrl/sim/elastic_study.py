"""The elastic study: the controller (``asyncrl.elastic``) on a simulated cluster against
every fixed split of the same slots, and against one move to the best of them at the
controller's first look (``OneMove``: the bound of any controller that must see the run
before it moves), and against ``per_step_bound`` (each step at its own best split, moves
free: what following the phases could gain at most). Each run is an
``asyncrl.sim.elastic.ElasticSimulation`` of the same workload and phases;
``tools/simulate.py elastic`` is its command line."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from asyncrl.elastic import Controller, ElasticConfig, Move
from asyncrl.elastic_signals import Signals
from asyncrl.sim.elastic import ClusterRun, ElasticSimulation, MoveCosts, Phases
from asyncrl.sim.gpu import GpuSpec, Workload, min_trainer_gpus
from asyncrl.sim.scoring import Judge

Split = tuple[int, int]
"""(generating, judging) slots; judging 0 where rewards cost nothing."""


class OneMove:
    """A stand-in for the controller that moves to ``split`` the first time it is shown
    signals and never again (a judge's slots first, then the generators', a move each):
    what a controller that must look before it moves could at best do from its start,
    had it been told the best fixed split."""

    def __init__(self, cfg: ElasticConfig, split: Split | int) -> None:
        self.cfg, self.done = cfg, False
        self.split = split if isinstance(split, tuple) else (split, 0)

    def decide(self, now: float, s: Signals) -> Move | None:
        generating, judging = self.split
        why = f"to the best fixed split at first sight ({now:.0f} s)"
        if self.done:
            return None
        if judging and s.reward_servers != judging:
            return Move(judging - s.reward_servers, why, "rewards")
        self.done = True
        return Move(generating - s.generators, why) if s.generators != generating else None


def study(
    w: Workload,
    gpu: GpuSpec,
    slots: tuple[int, int],
    phases: Phases,
    costs: MoveCosts,
    elastic: ElasticConfig,
    max_staleness: int | None = 4,
    seed: int = 0,
    compared: Sequence[int] = (),
    judge: Judge | None = None,
    judge_slots: Sequence[int] = (),
) -> dict[str, Any]:
    """Every fixed split the trainer's memory allows (or those of them in ``compared``:
    a long run's study can skip the splits far from the best), and the elastic placement
    started from an even split (it is not told which split is best): time to finish the
    run and trained tokens/s of each. Beside them, ``OneMove`` from the same start to the
    best fixed split. With a ``judge``, each split of generation also at each count of
    ``judge_slots`` (default: the judge's own), the elastic run starting at the judge's."""
    count, slot_gpus = slots
    fewest_training = math.ceil(min_trainer_gpus(w, gpu) / slot_gpus)
    placements = _placements(count, fewest_training, compared, judge, judge_slots)
    start_judging = judge.slots if judge else 0
    most = count - fewest_training - start_judging
    elastic = dataclasses.replace(
        elastic, min_generators=1, max_generators=most, move_cost_s=costs.resize_s
    )
    if judge:  # the most it could hold; each run narrows it to what generation can give
        elastic = dataclasses.replace(
            elastic, min_reward_servers=1, max_reward_servers=count - fewest_training - 1
        )

    def run(split: Split, controller: Controller | OneMove | None) -> ClusterRun:
        generating, judges = split
        at = dataclasses.replace(judge, slots=judges) if judge else None
        return ElasticSimulation(
            w, gpu, slots, generating, phases, costs, controller, max_staleness, seed, at
        ).run_to_end()

    fixed = {split: run(split, None) for split in placements}
    start = (min(most, max(1, (count - start_judging) // 2)), start_judging)
    adaptive = run(start, Controller(elastic))
    best = min(fixed, key=lambda split: fixed[split].time_s)
    one_move = run(start, OneMove(elastic, best))
    return {
        "gpus": count * slot_gpus,
        "slots": count,
        "slot_gpus": slot_gpus,
        **_figures(fixed, best, start, adaptive, one_move),
        "controller": dataclasses.asdict(elastic),
        **({"judge": dataclasses.asdict(judge)} if judge else {}),
    }


def _placements(
    count: int,
    fewest_training: int,
    compared: Sequence[int],
    judge: Judge | None,
    judge_slots: Sequence[int],
) -> list[Split]:
    """The fixed splits to run: each compared count of generating slots (all, if none) at
    every count of judge slots that leaves the trainer the slots its memory needs."""
    if judge_slots and judge is None:
        raise ValueError(f"judge_slots={list(judge_slots)} without a judge to put on them")
    judging = (judge_slots or (judge.slots,)) if judge else (0,)
    splits = [(g, j) for j in judging for g in range(1, count - fewest_training - j + 1)]
    possible = {g for g, _ in splits}
    if impossible := sorted(set(compared) - possible):
        raise ValueError(
            f"splits {impossible} are not possible here: {sorted(possible)} are "
            f"(judge slots {list(judging)})"
        )
    return [split for split in splits if not compared or split[0] in compared]


def per_step_bound(fixed: dict[Split, ClusterRun]) -> float:
    """Seconds to finish the run were each step trained at the fixed split that trained it
    fastest, moves free: the most a controller could gain by following the phases, up
    to how steps overlap (each step's time from the step before it ended; every run
    trains the same steps)."""
    durations = [
        [end - before for before, end in zip([0.0, *r.step_ends_s], r.step_ends_s)]
        for r in fixed.values()
    ]
    return sum(min(step) for step in zip(*durations))


def _key(split: Split) -> str:
    """A split as the JSON names it: "G" generating slots, or "G/J" with J judging."""
    generating, judging = split
    return f"{generating}/{judging}" if judging else str(generating)


def _figures(
    fixed: dict[Split, ClusterRun], best: Split, start: Split, adaptive: ClusterRun, one: ClusterRun
) -> dict[str, Any]:
    """The study's runs as its JSON reports them."""
    best_s, worst_s = fixed[best].time_s, max(r.time_s for r in fixed.values())
    bound_s = per_step_bound(fixed)
    judged = {"judge_busy": adaptive.judge_busy} if adaptive.judge_busy is not None else {}
    return {
        "fixed": {
            _key(split): {
                "time_s": round(r.time_s),
                "trained_tokens_per_s": round(r.trained_tokens_per_s),
                **({"judge_busy": round(r.judge_busy, 3)} if r.judge_busy is not None else {}),
            }
            for split, r in fixed.items()
        },
        "best_fixed_generator_slots": best[0],
        **({"best_fixed_judge_slots": best[1]} if best[1] else {}),
        "elastic": {
            "start_generator_slots": start[0],
            **({"start_judge_slots": start[1]} if start[1] else {}),
            "time_s": round(adaptive.time_s),
            "trained_tokens_per_s": round(adaptive.trained_tokens_per_s),
            "resize_s": adaptive.resize_s,
            "seconds_at": {str(k): round(v) for k, v in adaptive.seconds_at.items()},
            **judged,
            "moves": adaptive.moves,
        },
        "one_move_to_best": {
            "time_s": round(one.time_s),
            "gain_over_best_fixed": best_s / one.time_s - 1,
        },
        "per_step_bound": {"time_s": round(bound_s), "gain_over_best_fixed": best_s / bound_s - 1},
        "elastic_gain_over_best_fixed": best_s / adaptive.time_s - 1,
        "elastic_gain_over_worst_fixed": worst_s / adaptive.time_s - 1,
    }
