"""Environments for the episode tests, importable by name ("tests.episode_envs:Class")
from the generator, the buffer and evaluation; observations use only characters the
test model's char tokenizer knows (digits, "+", "=" and spaces)."""

from __future__ import annotations

import time

from asyncrl.episodes import Environment, Step
from asyncrl.episodes.openai_agent import AgentEnvironment


class Counter(Environment):
    """Answers each turn with its length; the third turn ends the episode, with reward 1
    when that turn is longer than 3 characters. Every answer is recorded in ``log``
    (turn text → observation text), for the tests to check the trajectories against."""

    log: dict[str, str] = {}
    answer = " = {} + "
    """The observation, around the turn's length."""

    def __init__(self, example) -> None:
        super().__init__(example)
        self.turns = 0

    def step(self, turn: str) -> Step:
        self.turns += 1
        if self.turns == 3:
            return Step(reward=float(len(turn) > 3), done=True)
        observation = self.answer.format(self.tool(len, turn))
        Counter.log[turn] = observation
        return Step(observation=observation)


class Slow(Counter):
    """``Counter`` whose tool sleeps, so that episodes overlap their environment time."""

    def step(self, turn: str) -> Step:
        self.tool(time.sleep, 0.05)
        return super().step(turn)


class LengthAgent(AgentEnvironment):
    """An agent written with the ``openai`` client: it asks the example's question, tells
    the model how long its reply was, asks again, and scores 1 when the second reply is
    longer than the first. Its conversations are kept in ``transcripts``."""

    transcripts: list[list[dict[str, str]]] = []

    def agent(self, client) -> float:
        messages = [{"role": "user", "content": self.example.prompt}]
        first = client.chat.completions.create(model=self.model, messages=messages)
        reply = first.choices[0].message.content
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"That was {len(reply)} characters."},
        ]
        second = client.chat.completions.create(model=self.model, messages=messages)
        messages.append({"role": "assistant", "content": second.choices[0].message.content})
        LengthAgent.transcripts.append(messages)
        return float(len(messages[-1]["content"]) > len(reply))


class Lines(Counter):
    """``Counter`` in the calculator task's characters ("= 12\\n"), its tool slowed a little
    so that a generator killed at any moment holds episodes between their turns."""

    answer = "= {}\n"

    def step(self, turn: str) -> Step:
        self.tool(time.sleep, 0.02)
        return super().step(turn)
