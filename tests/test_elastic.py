"""The elastic placement's controller: one generator more (or several, toward a balanced
split) when the trainer waits for data, one fewer when training is the bottleneck and
batches pile up; never two moves within a dwell; a move that does not raise trained
tokens/s over their trend is undone and not tried again for a while; a window and a
dwell that hold trainer steps; reward servers moved on the scoring queue. The launcher's
loop around it is ``tests/test_elastic_loop.py``."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from asyncrl.elastic import Controller, ElasticConfig
from asyncrl.elastic_signals import (
    Signals,
    StepRecord,
    balanced,
    balanced_target,
    predicted,
    signals,
    windowed,
)

CFG = ElasticConfig(min_generators=1, max_generators=3, dwell_s=60.0, window_s=30.0)
WAITING = dict(trainer_idle=0.5, ready_batches=0.0)  # the trainer starves
RUNNING_AHEAD = dict(trainer_idle=0.0, ready_batches=4.0)  # batches pile up


def feed(c: Controller, start: float, end: float, s, every: float = 5.0) -> list:
    """Ask ``c`` every ``every`` seconds from ``start`` to ``end`` (inclusive), as the
    launcher's loop does, with signals ``s`` (or ``s(t)``); the moves it made, timed."""
    moves, t = [], start
    while t <= end:
        move = c.decide(t, s(t) if callable(s) else s)
        if move is not None:
            moves.append((t, move))
        t += every
    return moves


def test_a_starved_trainer_gets_one_generator_more_per_dwell_while_it_pays():
    c = Controller(CFG)
    # No move before the trained tokens/s have a trend over a window to judge it against.
    [(at, first)] = feed(c, 0, 30, Signals(1, trained_tokens_per_s=100.0, **WAITING))
    assert at == 30 and first.delta == 1 and "trainer idle 50%" in first.reason
    [(at, again)] = feed(c, 35, 90, Signals(2, trained_tokens_per_s=150.0, **WAITING))
    assert at == 90 and again.delta == 1  # a dwell later, +50%: kept, and one more
    assert feed(c, 95, 400, Signals(3, trained_tokens_per_s=200.0, **WAITING)) == []  # at max


def test_a_move_that_does_not_pay_is_undone_and_not_retried_for_a_while():
    c = Controller(CFG)
    [(_, first)] = feed(c, 0, 30, Signals(1, trained_tokens_per_s=100.0, **WAITING))
    [(at, undo)] = feed(c, 35, 90, Signals(2, trained_tokens_per_s=102.0, **WAITING))  # +2%
    assert at == 90 and undo.delta == -1 and undo.reason.startswith("undo +1")
    # Still starved, but +1 did not pay: not tried for retry_dwells dwells.
    [(at, retry)] = feed(c, 95, 300, Signals(1, trained_tokens_per_s=100.0, **WAITING))
    assert at == 90 + CFG.retry_dwells * CFG.dwell_s and retry.delta == 1


def test_a_move_is_judged_against_the_trend_before_it():
    """Trained tokens/s that fall as the workload drifts (more groups dropped, longer
    responses): a generator more that holds them level has paid, one that lets them fall
    faster than before has not."""
    falling = lambda t: Signals(1, trained_tokens_per_s=100.0 - 0.5 * t, **WAITING)  # noqa: E731
    c = Controller(CFG)
    [(at, first)] = feed(c, 0, 30, falling)  # at 85, falling 0.5 per second
    assert feed(c, 35, 90, Signals(2, trained_tokens_per_s=85.0, **WAITING))[0][1].delta == 1
    c = Controller(CFG)
    feed(c, 0, 30, falling)
    [(_, undo)] = feed(c, 35, 90, Signals(2, trained_tokens_per_s=53.0, **WAITING))
    assert undo.delta == -1 and "against 55 expected" in undo.reason  # 85 - 0.5 * 60


def test_training_as_the_bottleneck_gives_a_generator_back_down_to_the_minimum():
    c = Controller(CFG)
    [(_, down)] = feed(c, 0, 30, Signals(2, trained_tokens_per_s=100.0, **RUNNING_AHEAD))
    assert down.delta == -1 and "4.0 batches ready" in down.reason
    # Judged (+20%: kept), and one generator is the minimum.
    assert feed(c, 35, 200, Signals(1, trained_tokens_per_s=120.0, **RUNNING_AHEAD)) == []
    between = dict(trainer_idle=0.1, ready_batches=4.0)  # neither threshold crossed
    assert feed(c, 205, 600, Signals(2, trained_tokens_per_s=120.0, **between)) == []


def test_a_generator_given_back_is_kept_unless_training_slowed():
    """One fewer generator is to free resources: kept at the same trained tokens/s (a -1
    judged as a +1 would be undone and tried again forever), undone when they fell."""
    c = Controller(CFG)
    [(_, down)] = feed(c, 0, 30, Signals(3, trained_tokens_per_s=100.0, **RUNNING_AHEAD))
    [(at, kept)] = feed(c, 35, 90, Signals(2, trained_tokens_per_s=98.0, **RUNNING_AHEAD))
    assert at == 90 and kept.delta == -1  # judged (-2%: kept), and still ahead
    [(_, undo)] = feed(c, 95, 150, Signals(1, trained_tokens_per_s=80.0, **RUNNING_AHEAD))
    assert undo.delta == 1 and undo.reason.startswith("undo -1")


def test_signals_that_swing_across_both_thresholds_move_at_most_once_a_dwell():
    c = Controller(CFG)
    swing = lambda t: Signals(2, 0.5 if t // 10 % 2 else 0.0, 0.0 if t // 10 % 2 else 4.0, 100.0)  # noqa: E731
    moves = [at for at, _ in feed(c, 0, 3600, swing, every=2.0)]
    assert moves and all(b - a >= CFG.dwell_s for a, b in zip(moves, moves[1:]))


def test_on_shared_slots_a_move_goes_toward_the_balanced_split_up_to_max_step():
    """8 slots generate, 8 train, the trainer idles 60%: generation must grow 2.5 times
    against training, which 11.4 of the 16 slots would do."""
    s = Signals(8, trainer_idle=0.6, ready_batches=0.0, trained_tokens_per_s=1.0, trainer_slots=8)
    assert balanced(s) == pytest.approx(16 * 2.5 / 3.5)
    wide = Controller(replace(CFG, max_generators=15, max_step=8))
    assert feed(wide, 0, 30, s)[0][1].delta == 3
    narrow = Controller(replace(CFG, max_generators=15, max_step=2))
    assert feed(narrow, 0, 30, s)[0][1].delta == 2
    # Where the trainer keeps its size, generation alone grows by 1 / (1 - idle).
    assert balanced(s._replace(trainer_slots=0)) == pytest.approx(8 / 0.4)


def test_on_shared_slots_the_target_is_the_whole_split_either_side_that_predicts_more():
    """12 generate, 4 train, the trainer idles 45%: the balance is at 13.5 slots; at 14
    the two trainer slots left could take less than is generated now, so 13."""
    s = Signals(12, trainer_idle=0.45, ready_batches=0.0, trained_tokens_per_s=1.0, trainer_slots=4)
    assert balanced(s) == pytest.approx(13.52, abs=0.01)
    assert predicted(s, 13) == pytest.approx(13 / 12) and predicted(s, 14) < 1.0
    assert balanced_target(s) == 13
    c = Controller(replace(CFG, max_generators=15, max_step=8))
    assert feed(c, 0, 30, s)[0][1].delta == 1
    # Where the trainer keeps its size, the balance is rounded as it is.
    assert balanced_target(s._replace(trainer_slots=0)) == round(12 / 0.55)


def test_on_shared_slots_a_waiting_trainer_at_its_predicted_best_split_keeps_its_slots():
    """6 generate, 2 train, the trainer idles 31%: the balance is 6.5, but at 7 the one
    trainer slot left could take 0.72 of what it trains now, so 6 is the best whole split
    and the trainer's waits (its batches' slowest sequences) get no generator. At idle
    54% with 5 and 3, 6 predicts more: one more."""
    s = Signals(6, trainer_idle=0.31, ready_batches=0.0, trained_tokens_per_s=1.0, trainer_slots=2)
    assert balanced(s) == pytest.approx(6.5, abs=0.01) and balanced_target(s) == 6
    cfg = replace(CFG, max_generators=7, max_step=8)
    assert feed(Controller(cfg), 0, 60, s) == []
    # Generators with cores of their own take nothing from the trainer: one more.
    assert feed(Controller(cfg), 0, 60, s._replace(trainer_slots=0))[0][1].delta == 1
    later = s._replace(generators=5, trainer_slots=3, trainer_idle=0.54)
    assert balanced_target(later) == 6 and feed(Controller(cfg), 0, 60, later)[0][1].delta == 1


def test_a_move_that_restarts_the_trainer_is_made_only_if_it_could_repay_the_restart():
    """With a 120 s restart and a 900 s dwell, one slot more for 12 generating slots can
    add at most 1/12 of generation, 75 s of a dwell: not made. Three more for eight can
    add 3/8, 338 s: made."""
    cfg = replace(CFG, max_generators=15, max_step=8, dwell_s=900.0, window_s=30.0)
    near = Signals(
        12, trainer_idle=0.45, ready_batches=0.0, trained_tokens_per_s=1.0, trainer_slots=4
    )
    assert feed(Controller(replace(cfg, move_cost_s=120.0)), 0, 60, near) == []
    assert feed(Controller(cfg), 0, 60, near)[0][1].delta == 1  # free moves: made
    far = near._replace(generators=8, trainer_slots=8, trainer_idle=0.63)
    [(_, move)] = feed(Controller(replace(cfg, move_cost_s=120.0)), 0, 60, far)
    assert move.delta == 3  # 11: at 12 the trainer's four slots would take less
    # Two steps of 50 s left: 3/8 of 100 s cannot repay the restart.
    ending = far._replace(steps_left=2, step_s=50.0)
    assert feed(Controller(replace(cfg, move_cost_s=120.0)), 0, 60, ending) == []
    # Generators that do not share the trainer's slots restart nothing.
    alone = near._replace(trainer_slots=0)
    assert feed(Controller(replace(cfg, move_cost_s=120.0)), 0, 60, alone)[0][1].delta > 0
    with pytest.raises(ValueError, match="elastic.move_cost_s=-1 must be at least 0"):
        replace(cfg, move_cost_s=-1.0).check(2)


def test_trained_tokens_per_s_are_over_the_steps_own_time():
    steps = [StepRecord(seconds=2.0, waited=1.0, tokens=100.0)] * 3
    s = signals(2, steps, ready_batches=0.5)
    assert s.trained_tokens_per_s == 50.0 and s.trainer_idle == 0.5 and s.generators == 2
    assert signals(2, [], 0.0).trained_tokens_per_s == 0.0


def test_where_steps_outgrow_the_dwell_a_move_is_judged_on_dwell_steps_after_it():
    """Steps of 40 s against a dwell of 60 s: a dwell of 5 steps (200 s) passes before
    the next move or the judgement of the last, so a move is never judged on one step."""
    c = Controller(CFG)  # dwell_steps 5, window_steps 2
    slow = dict(trained_tokens_per_s=100.0, step_s=40.0, **WAITING)
    [(at, first)] = feed(c, 0, 200, Signals(1, **slow))
    assert at == 80 and first.delta == 1  # the trend needs a window of 2 steps (80 s)
    slow["trained_tokens_per_s"] = 102.0  # +2%: it did not pay, judged a dwell later
    [(at, undo)] = feed(c, 85, 400, Signals(2, **slow))
    assert at == 80 + 5 * 40.0 and undo.delta == -1
    c = Controller(replace(CFG, dwell_steps=1, window_steps=1))  # one step; 60 s dwell
    [(at, first)] = feed(c, 0, 60, Signals(1, **{**slow, "trained_tokens_per_s": 100.0}))
    [(at2, undo)] = feed(c, at + 5, 120, Signals(2, **slow))
    assert (at, at2) == (40, 40 + 60) and undo.delta == -1


def test_the_window_keeps_its_least_steps_however_old():
    steps = deque((float(t), None) for t in (0, 100, 200, 290))
    assert windowed(steps, now=300.0, window_s=30.0, least=2) == 300.0 - 200.0
    assert [t for t, _ in steps] == [200.0, 290.0]
    assert windowed(steps, now=300.0, window_s=30.0, least=1) == 30.0
    assert [t for t, _ in steps] == [290.0]
    assert signals(1, [StepRecord(40.0, 10.0, 4.0)] * 2, 0.0).step_s == 40.0


SCORING_BEHIND = dict(trainer_idle=0.5, ready_batches=0.0, reward_servers=1, reward_queue=2.0)


def test_a_trainer_waiting_on_scoring_gets_a_reward_server_not_a_generator():
    c = Controller(CFG)
    s = Signals(1, trained_tokens_per_s=100.0, reward_busy=1.0, **SCORING_BEHIND)
    [(at, first)] = feed(c, 0, 30, s)
    assert first.role == "rewards" and first.delta == 1
    assert "2.0 batches waiting for a reward server" in first.reason
    # At its most reward servers, nothing: a generator more would only lengthen the queue.
    at_max = s._replace(reward_servers=CFG.max_reward_servers, trained_tokens_per_s=150.0)
    assert feed(c, at + 5, at + 300, at_max) == []


def test_a_reward_server_taken_for_a_queue_is_not_given_back_for_some_dwells():
    """Busy shares of batching servers swing with the bursts they are sent: a server
    taken for a queue and kept is not given back at the next quiet look (that
    alternated on the simulator's judge), only ``retry_dwells`` dwells later."""
    c = Controller(CFG)
    s = Signals(1, trained_tokens_per_s=100.0, reward_busy=1.0, **SCORING_BEHIND)
    [(at, up)] = feed(c, 0, 30, s)
    assert (up.role, up.delta) == ("rewards", 1)
    quiet = Signals(1, trainer_idle=0.1, ready_batches=0.0, trained_tokens_per_s=120.0)
    quiet = quiet._replace(reward_servers=2, reward_queue=0.0, reward_busy=0.05)
    wait = CFG.retry_dwells * CFG.dwell_s
    assert feed(c, at + 5, at + wait - 5, quiet) == []  # kept (+20%), and not given back
    [(_, down)] = feed(c, at + wait, at + wait + 5, quiet)
    assert (down.role, down.delta) == ("rewards", -1)


def test_reward_servers_that_idle_give_one_back_and_an_undo_blocks_that_role_only():
    c = Controller(CFG)
    idle = Signals(2, trainer_idle=0.1, ready_batches=0.0, trained_tokens_per_s=100.0)
    idle = idle._replace(reward_servers=2, reward_queue=0.0, reward_busy=0.1)
    [(at, down)] = feed(c, 0, 30, idle)
    assert (down.delta, down.role) == (-1, "rewards")
    assert "reward servers busy 10%, 20% on one fewer < 30%" in down.reason
    # Busy 20% of their time: one fewer would be busy 40%, so both stay.
    assert feed(Controller(CFG), 0, 30, idle._replace(reward_busy=0.2)) == []
    # Training fell with it: undone, and reward servers are not given back for a while...
    fell = idle._replace(reward_servers=1, reward_busy=0.9, trained_tokens_per_s=80.0)
    [(_, undo)] = feed(c, at + 5, at + CFG.dwell_s, fell)
    assert undo.role == "rewards" and undo.delta == 1 and undo.reason.startswith("undo -1")
    # ...while a starving trainer still gets a generator at the next dwell.
    starving = idle._replace(trainer_idle=0.5, reward_busy=0.1, trained_tokens_per_s=100.0)
    [(_, up)] = feed(c, at + CFG.dwell_s + 5, at + 2 * CFG.dwell_s + 5, starving)
    assert up.role == "generators" and up.delta == 1
