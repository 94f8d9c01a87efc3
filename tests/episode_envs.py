"""Environments for the episode tests, importable by name ("tests.episode_envs:Class")
from the generator, the buffer and evaluation; observations use only characters the
test model's char tokenizer knows (digits, "+", "=" and spaces)."""

from __future__ import annotations

import time

from asyncrl.episodes import Environment, Step


class Counter(Environment):
    """Answers each turn with its length; the third turn ends the episode, with reward 1
    when that turn is longer than 3 characters. Every answer is recorded in ``log``
    (turn text → observation text), for the tests to check the trajectories against."""

    log: dict[str, str] = {}

    def __init__(self, example) -> None:
        super().__init__(example)
        self.turns = 0

    def step(self, turn: str) -> Step:
        self.turns += 1
        if self.turns == 3:
            return Step(reward=float(len(turn) > 3), done=True)
        observation = f" = {self.tool(len, turn)} + "
        Counter.log[turn] = observation
        return Step(observation=observation)


class Slow(Counter):
    """``Counter`` whose tool sleeps, so that episodes overlap their environment time."""

    def step(self, turn: str) -> Step:
        self.tool(time.sleep, 0.05)
        return super().step(turn)
