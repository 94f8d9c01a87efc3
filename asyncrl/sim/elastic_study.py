"""The elastic study: the controller (``asyncrl.elastic``) on a simulated cluster against
every fixed split of the same slots, and against one move to the best of them at the
controller's first look (``OneMove``: the bound of any controller that must see the run
before it moves). Each run is an ``asyncrl.sim.elastic.ElasticSimulation`` of the same
workload and phases; ``tools/simulate.py elastic`` is its command line."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from asyncrl.elastic import Controller, ElasticConfig, Move, Signals
from asyncrl.sim.elastic import ClusterRun, ElasticSimulation, MoveCosts, Phases
from asyncrl.sim.gpu import GpuSpec, Workload, min_trainer_gpus


class OneMove:
    """A stand-in for the controller that moves to ``split`` generating slots the first
    time it is shown signals and never again: what a controller that must look before it
    moves could at best do from its start, had it been told the best fixed split."""

    def __init__(self, cfg: ElasticConfig, split: int) -> None:
        self.cfg, self.split, self.moved = cfg, split, False

    def decide(self, now: float, s: Signals) -> Move | None:
        if self.moved or s.generators == self.split:
            return None
        self.moved = True
        return Move(
            self.split - s.generators, f"to the best fixed split at first sight ({now:.0f} s)"
        )


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
) -> dict[str, Any]:
    """Every fixed split the trainer's memory allows (or those of them in ``compared``:
    a long run's study can skip the splits far from the best), and the elastic placement
    started from an even split (it is not told which split is best): time to finish the
    run and trained tokens/s of each. Beside them, ``OneMove`` from the same start to the
    best fixed split."""
    count, slot_gpus = slots
    fewest_training = math.ceil(min_trainer_gpus(w, gpu) / slot_gpus)
    splits = range(1, count - fewest_training + 1)
    if impossible := sorted(set(compared) - set(splits)):
        raise ValueError(f"splits {impossible} are not possible here: {list(splits)} are")
    elastic = dataclasses.replace(
        elastic, min_generators=1, max_generators=splits[-1], move_cost_s=costs.resize_s
    )

    def run(generating: int, controller: Controller | OneMove | None) -> ClusterRun:
        return ElasticSimulation(
            w, gpu, slots, generating, phases, costs, controller, max_staleness, seed
        ).run_to_end()

    fixed = {g: run(g, None) for g in compared or splits}
    start = min(splits[-1], max(1, count // 2))
    adaptive = run(start, Controller(elastic))
    best = min(fixed, key=lambda g: fixed[g].time_s)
    one_move = run(start, OneMove(elastic, best))
    return {
        "gpus": count * slot_gpus,
        "slots": count,
        "slot_gpus": slot_gpus,
        **_figures(fixed, best, start, adaptive, one_move),
        "controller": dataclasses.asdict(elastic),
    }


def _figures(
    fixed: dict[int, ClusterRun], best: int, start: int, adaptive: ClusterRun, one: ClusterRun
) -> dict[str, Any]:
    """The study's runs as its JSON reports them."""
    best_s, worst_s = fixed[best].time_s, max(r.time_s for r in fixed.values())
    return {
        "fixed": {
            str(g): {
                "time_s": round(r.time_s),
                "trained_tokens_per_s": round(r.trained_tokens_per_s),
            }
            for g, r in fixed.items()
        },
        "best_fixed_generator_slots": best,
        "elastic": {
            "start_generator_slots": start,
            "time_s": round(adaptive.time_s),
            "trained_tokens_per_s": round(adaptive.trained_tokens_per_s),
            "resize_s": adaptive.resize_s,
            "seconds_at": {str(k): round(v) for k, v in adaptive.seconds_at.items()},
            "moves": adaptive.moves,
        },
        "one_move_to_best": {
            "time_s": round(one.time_s),
            "gain_over_best_fixed": best_s / one.time_s - 1,
        },
        "elastic_gain_over_best_fixed": best_s / adaptive.time_s - 1,
        "elastic_gain_over_worst_fixed": worst_s / adaptive.time_s - 1,
    }
