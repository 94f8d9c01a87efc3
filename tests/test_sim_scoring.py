"""Reward scoring as a role on the simulated cluster (``asyncrl.sim.scoring``): a judge
that costs compute scores every sample before it is trained, and the launcher's
controller moves slots between it and generation. Small workloads: a run takes a second."""

from __future__ import annotations

import pytest

from asyncrl.elastic import Controller, ElasticConfig
from asyncrl.sim.elastic import ElasticSimulation, MoveCosts, Phases
from asyncrl.sim.elastic_study import OneMove, study
from asyncrl.sim.gpu import GpuSpec, Workload
from asyncrl.sim.scoring import Judge, ScoringServer

from .test_sim_elastic import elastic_cli

# Engines of 32 sequences: a batch of 512 samples can queue for a judge slot's 8 engines.
SMALL = Workload(
    response_mean=256, response_max=2048, prompts_per_batch=64, samples_per_prompt=8, max_slots=32
)
PHASES = Phases(steps=40)
COSTS = MoveCosts(resize_s=20.0, engine_start_s=10.0)
CONTROL = ElasticConfig(max_generators=6, dwell_s=60.0, window_s=30.0)


def run(generating: int, judge: Judge | None, controller: Controller | None = None):
    sim = ElasticSimulation(
        SMALL, GpuSpec(), (8, 8), generating, PHASES, COSTS, controller, judge=judge
    )
    return sim, sim.run_to_end()


def test_every_trained_sample_is_judged_first_and_a_dearer_judge_slows_the_run():
    _, free = run(4, None)
    sim, cheap = run(4, Judge(verdict_tokens=32, slots=1))
    _, dear = run(4, Judge(verdict_tokens=1024, slots=1))
    assert isinstance(sim.server, ScoringServer) and free.judge_busy is None
    c = sim.buffer.counts
    ended = c["samples_consumed"] + c["samples_filtered"] + c["samples_stale"]
    groups_judging = sum(g.finished for g in sim.buffer.groups.values())
    assert sim.server.judge.samples == ended + groups_judging  # none reach a group unjudged
    assert free.time_s < cheap.time_s < dear.time_s
    assert 0 < cheap.judge_busy < dear.judge_busy <= 1


def generator_moves(moves: list[dict]) -> int:
    return sum(1 for m in moves if m["role"] == "generators")


def test_a_judge_with_no_slot_or_no_verdict_is_refused():
    for judge in (Judge(verdict_tokens=64, slots=0), Judge(verdict_tokens=0, slots=1)):
        with pytest.raises(ValueError, match="at least one slot and writes a token"):
            run(4, judge)


def test_a_judge_that_holds_the_trainer_up_takes_a_slot_from_generation():
    """Long verdicts on one judge slot: samples queue for it while the trainer waits, so
    the controller moves a generating slot to the judge (the trainer does not restart
    for it); the books hold over every move."""
    sim, r = run(4, Judge(verdict_tokens=1024, slots=1), Controller(CONTROL))
    first = r.moves[0]
    assert first["role"] == "rewards" and "waiting for a reward server" in first["reason"]
    assert (first["judge_slots"], first["generator_slots"]) == (2, 3)
    assert r.resize_s <= COSTS.resize_s * generator_moves(r.moves)
    # A generator given back in the last step waits in ``pending`` for the trainer's next
    # step boundary, which a finished run does not reach.
    assert sim.judge_slots + sim.gen_slots + sim.train_slots - sim.pending == 8
    assert sim.train_slots >= sim.fewest_training and sim.gen_slots >= 1


def test_an_idle_judge_gives_its_slot_back_to_generation():
    sim, r = run(3, Judge(verdict_tokens=32, slots=2), Controller(CONTROL))
    first = r.moves[0]
    assert first["role"] == "rewards" and first["reason"].startswith("reward servers busy")
    assert (first["judge_slots"], first["generator_slots"]) == (1, 4)
    assert r.resize_s <= COSTS.resize_s * generator_moves(r.moves)
    assert sim.judge_slots == 1  # never below the controller's floor


def test_the_study_compares_the_controller_with_every_split_of_generation_and_judge():
    judge = Judge(verdict_tokens=1024, slots=1)
    result = study(
        SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL, judge=judge, judge_slots=(1, 2)
    )
    assert set(result["fixed"]) == {"1/1", "2/1", "1/2"}
    assert result["elastic"]["start_judge_slots"] == 1 and result["judge"]["verdict_tokens"] == 1024
    best = f"{result['best_fixed_generator_slots']}/{result['best_fixed_judge_slots']}"
    assert result["fixed"][best]["time_s"] == min(r["time_s"] for r in result["fixed"].values())
    some = study(SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL, 4, 0, (2,), judge, (1, 2))
    assert set(some["fixed"]) == {"2/1"}  # 2/2 would leave the trainer no slot
    with pytest.raises(ValueError, match=r"splits \[3\] are not possible here: \[1, 2\]"):
        study(SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL, 4, 0, (3,), judge, (1, 2))
    with pytest.raises(ValueError, match="without a judge"):
        study(SMALL, GpuSpec(), (4, 8), PHASES, COSTS, CONTROL, judge_slots=(2,))


def test_the_one_move_bound_moves_the_judge_then_the_generators_once():
    bound = OneMove(CONTROL, (1, 2))
    sim, r = run(4, Judge(verdict_tokens=1024, slots=1), bound)
    assert [(m["role"], m["generator_slots"], m["judge_slots"]) for m in r.moves] == [
        ("rewards", 3, 2),
        ("generators", 1, 2),
    ]


def test_cli_elastic_with_a_judge_ends_with_one_json_line():
    result = elastic_cli("--verdict-tokens", "64", "--judge-slots", "1-2")
    assert set(result["fixed"]) == {"1/1", "2/1", "1/2"} and "judge_busy" in result["elastic"]
