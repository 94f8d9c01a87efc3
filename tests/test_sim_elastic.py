"""The elastic placement on the simulated cluster (``asyncrl.sim.elastic``): the
workload's phases (responses that grow, more groups dropped), moves carried out at their
cost with the books intact, and the launcher's controller finding a better split than
the one it starts from. Small workloads: each run takes a fraction of a second."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.elastic import Controller, ElasticConfig
from asyncrl.sim import SimConfig, SimParams
from asyncrl.sim.buffer import SimBuffer
from asyncrl.sim.elastic import ClusterRun, ElasticSimulation, MoveCosts, Phases
from asyncrl.sim.elastic_study import OneMove, per_step_bound, study
from asyncrl.sim.gpu import GpuSpec, Workload

ROOT = Path(__file__).resolve().parents[1]
SMALL = Workload(response_mean=256, response_max=2048, prompts_per_batch=64, samples_per_prompt=8)
PHASES = Phases(steps=40)
COSTS = MoveCosts(resize_s=20.0, engine_start_s=10.0)
CONTROL = ElasticConfig(max_generators=7, dwell_s=60.0, window_s=30.0, max_step=1)


def test_responses_grow_by_the_length_schedule():
    params = SimParams(completion_lengths={100: 1.0}, length_schedule=[(0, 1.0), (10, 3.0)])
    cfg = SimConfig(max_new_tokens=1000, prompts_per_batch=4, max_staleness=None)
    buffer = SimBuffer(cfg, params, random.Random(0))
    first = [s.length for s in buffer.lease(8)]
    buffer.set_version(5)
    middle = [s.length for s in buffer.lease(8)]
    buffer.set_version(10)
    last = [s.length for s in buffer.lease(8)]
    assert (set(first), set(middle), set(last)) == ({100}, {200}, {300})


def test_a_fixed_split_does_the_run_s_steps_without_a_move():
    run = ElasticSimulation(SMALL, GpuSpec(), (8, 8), 4, PHASES, COSTS, None).run_to_end()
    assert run.moves == [] and run.resize_s == 0 and set(run.seconds_at) == {4}
    assert run.seconds_at[4] == pytest.approx(run.time_s) and run.trained_tokens > 0


def test_a_starved_trainer_s_slots_move_to_generation_and_the_run_ends_sooner():
    """Started with one generating slot of eight, the controller adds slots (each move
    paid: the trainer restarts, the engines start), the books hold over every move, and
    the run ends sooner than at the split it started from."""
    fixed = ElasticSimulation(SMALL, GpuSpec(), (8, 8), 1, PHASES, COSTS, None).run_to_end()
    elastic = ElasticSimulation(
        SMALL, GpuSpec(), (8, 8), 1, PHASES, COSTS, Controller(CONTROL)
    ).run_to_end()
    ups = [m for m in elastic.moves if not m["reason"].startswith("undo")]
    assert ups and ups[0]["generator_slots"] == 2 and "trainer idle" in ups[0]["reason"]
    assert elastic.resize_s == COSTS.resize_s * len(elastic.moves)
    assert max(elastic.seconds_at) > 1 and sum(elastic.seconds_at.values()) == pytest.approx(
        elastic.time_s
    )
    assert elastic.time_s < 0.9 * fixed.time_s


def test_the_one_move_bound_moves_once_at_the_first_look():
    bound = OneMove(CONTROL, 5)
    run = ElasticSimulation(SMALL, GpuSpec(), (8, 8), 1, PHASES, COSTS, bound).run_to_end()
    [move] = run.moves
    assert move["generator_slots"] == 5 and move["time_s"] <= 2 * CONTROL.window_s
    assert set(run.seconds_at) == {1, 5} and run.resize_s == COSTS.resize_s


def test_the_study_compares_the_controller_with_every_fixed_split():
    result = study(SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL)
    assert (
        set(result["fixed"]) == {"1", "2", "3"} and result["elastic"]["start_generator_slots"] == 2
    )
    best = result["fixed"][str(result["best_fixed_generator_slots"])]["time_s"]
    assert result["elastic_gain_over_best_fixed"] == pytest.approx(
        best / result["elastic"]["time_s"] - 1, abs=0.01
    )
    one = result["one_move_to_best"]
    assert one["gain_over_best_fixed"] == pytest.approx(best / one["time_s"] - 1, abs=0.01)
    bound = result["per_step_bound"]  # no run can beat each step's best split
    assert bound["time_s"] <= min(r["time_s"] for r in result["fixed"].values())
    assert bound["gain_over_best_fixed"] == pytest.approx(best / bound["time_s"] - 1, abs=0.01)
    some = study(SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL, compared=(2, 3))
    assert set(some["fixed"]) == {"2", "3"} and some["fixed"]["2"] == result["fixed"]["2"]
    assert some["elastic"] == result["elastic"]  # the controller's run is the same
    with pytest.raises(ValueError, match=r"splits \[4\] are not possible here: \[1, 2, 3\]"):
        study(SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL, compared=(3, 4))


def test_the_per_step_bound_takes_each_step_at_its_fastest_split():
    def run(*ends: float) -> ClusterRun:
        return ClusterRun(False, ends[-1], 0, [], {}, 0.0, step_ends_s=list(ends))

    # steps of 10, 10, 10 s against 5, 20, 5 s: the bound takes 5 + 10 + 5
    assert per_step_bound({(1, 0): run(10, 20, 30), (2, 0): run(5, 25, 30)}) == 20


def elastic_cli(*extra: str) -> dict:
    """``tools/simulate.py elastic`` on a small cluster and workload, with ``extra``
    arguments: the JSON of its last line, once it has exited cleanly."""
    proc = subprocess.run(
        [
            *[sys.executable, "tools/simulate.py", "elastic", "--gpus", "32", "--slot-gpus", "8"],
            *["--steps", "20", "--batch", "32", "--samples", "4", "--response-mean", "128"],
            *["--response-max", "1024", "--dwell-s", "60", "--window-s", "30", *extra],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_elastic_ends_with_one_json_line():
    result = elastic_cli("--splits", "1-2")
    assert result["command"] == "elastic" and set(result["fixed"]) == {"1", "2"}
    assert result["phases"]["steps"] == 20 and "assumptions" in result["note"]
