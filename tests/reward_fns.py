"""User reward functions for tests/test_task_rewards.py, named by import path
("tests.reward_fns:NAME") in ``TaskConfig.rewards``: good ones, and the mistakes that
``check_rewards`` must refuse or that scoring must report. A module of its own because
the reward pool's spawned workers import it by name."""

from __future__ import annotations

from asyncrl.tasks import Example


def answer_echo(example: Example, completion: str) -> float:
    """0.25 when the completion repeats the reference answer, plus 0.5 when the prompt
    starts with "echo": a value that depends on both arguments."""
    repeated = 0.25 if example.answer and example.answer in completion else 0.0
    return repeated + (0.5 if example.prompt.startswith("echo") else 0.0)


def length_penalty(example: Example, completion: str, per_char: float = 0.01) -> float:
    """Minus ``per_char`` for each character: negative values and a defaulted third
    parameter are both allowed."""
    return -per_char * len(completion)


def returns_nan(example: Example, completion: str) -> float:
    return float("nan")


def returns_text(example: Example, completion: str) -> str:
    return "high"


def one_argument(completion: str) -> float:
    return 1.0


def keyword_only(*, example: Example, completion: str) -> float:
    return 1.0


NOT_CALLABLE = 3.0
"""A module attribute that is a number, not a function."""
