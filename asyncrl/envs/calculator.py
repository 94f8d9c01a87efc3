"""The tiny agent task: multiply a three-digit number by a two-digit one with a calculator
tool, the multi-turn environment the 1M-parameter char model learns on
(``experiments/tiny_agent_sft.py``, ``experiments/tiny_agent.py``).

That model cannot multiply in its head, but it can copy: the task is solved by copying
the problem into a tool call and the tool's result into the answer. One episode, in plain
text, one line per model turn (the generator stops a turn at ``STOP``, "\\n")::

    123*45\\n          the prompt (the task example's)
    calc 123*45\\n     model turn: call the tool
    = 5535\\n          observation: the tool's result
    answer 5535\\n     model turn: answer; done, reward 1 if it is the reference

A turn that is neither ``calc EXPR`` nor ``answer N`` ends the episode with reward 0. A
malformed expression gets the observation ``= err\\n`` and the model may call again.
An episode is at most 7 prompt tokens and 33 after it with one call, so it fits the char
model's small context with room for a retry.

``write_calculator_data`` writes the three JSONL files the experiments read: SFT
demonstrations (the whole episode text as the completion), RL prompts and held-out eval
prompts, none of them sharing a problem.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from asyncrl.episodes.env import Environment, Step
from asyncrl.tasks.base import Example

STOP = "\n"
"""Where a model turn ends: the experiments' ``sampling.stop``."""
CALL = "calc"
ANSWER = "answer"
# Made only of characters the data files contain ("=", " " and the "e", "r" of "answer"):
# the char tokenizer is built from the data's texts, and an observation character outside
# it would reach the model as <unk>. The tool's own "error: ..." text is not shown.
ERROR_OBSERVATION = "= err\n"

# Problems are a * b with a three-digit a and a two-digit b: 900 * 90 of them.
A_RANGE, B_RANGE = range(100, 1000), range(10, 100)
NUM_PROBLEMS = len(A_RANGE) * len(B_RANGE)

# Bounds on what the tool computes, so that no call runs long or writes a long result:
# a turn is a line of at most ~16 tokens anyway, and the context is small.
MAX_EXPRESSION_CHARS = 32
MAX_RESULT_DIGITS = 10
# Sums of products of non-negative integers: enough for the task, and results are digits
# only, so every observation is made of characters the data has (a "-" would not be).
_EXPRESSION = re.compile(r"\d+(?:[*+]\d+)*")


def evaluate(expression: str) -> int:
    """The value of ``expression``, a sum of products of non-negative integers ("12*3+4";
    spaces ignored). Parsed, never ``eval``ed; raises ValueError on anything else, or when
    the expression or its result is too long."""
    text = expression.replace(" ", "")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError("expression too long")
    if not _EXPRESSION.fullmatch(text):
        raise ValueError(f"not a sum of products: {expression!r}")
    total = 0
    for term in text.split("+"):
        product = 1
        for number in term.split("*"):
            product *= int(number)
            if product >= 10**MAX_RESULT_DIGITS:
                raise ValueError("result too large")
        total += product
    if total >= 10**MAX_RESULT_DIGITS:
        raise ValueError("result too large")
    return total


def prompt_text(a: int, b: int) -> str:
    """The problem's prompt: ``"123*45\\n"``."""
    return f"{a}*{b}{STOP}"


class Calculator(Environment):
    """The calculator episode for one problem; see the module docstring for the format.

    Stateless beyond the counters: each observation depends only on the turn it answers,
    which makes it replayable."""

    def __init__(self, example: Example) -> None:
        super().__init__(example)
        if example.answer is None:
            raise ValueError(f"{example.uid} has no reference answer (Calculator needs one)")
        self.reference = int(example.answer.strip())

    def step(self, turn: str) -> Step:
        word, _, rest = turn.strip().partition(" ")
        if word == CALL:
            return Step(observation=observation(self.tool(evaluate, rest, timeout_s=1.0)))
        if word == ANSWER:
            value = rest.strip()
            # ASCII digits only: str.isdigit also takes "²", which int() refuses.
            right = value.isascii() and value.isdigit() and int(value) == self.reference
            return Step(reward=1.0 if right else 0.0, done=True)
        return Step(reward=0.0, done=True)


def observation(result: str) -> str:
    """The observation line for the tool's output (``Environment.tool``'s text)."""
    if result.startswith("error:"):
        return ERROR_OBSERVATION
    return f"= {result}{STOP}"


def demonstration(a: int, b: int) -> str:
    """The ideal episode after the prompt of ``a*b``, laid out as the generator lays it
    out: the call line, its observation, the answer line (the tests pin it to what the
    environment answers)."""
    call = f"{CALL} {a}*{b}"
    result = observation(str(evaluate(f"{a}*{b}")))
    return f"{call}{STOP}{result}{ANSWER} {a * b}{STOP}"


def _problems(seed: int, count: int) -> list[tuple[int, int]]:
    if count > NUM_PROBLEMS:
        raise ValueError(f"{count} rows asked for, and there are {NUM_PROBLEMS} problems")
    # A prefix of one permutation of all problems: the first n are the same for any count.
    picks = np.random.default_rng(seed).permutation(NUM_PROBLEMS)[:count]
    return [(A_RANGE[i // len(B_RANGE)], B_RANGE[i % len(B_RANGE)]) for i in picks]


def _rows(problems: list[tuple[int, int]], with_completion: bool) -> str:
    lines = []
    for a, b in problems:
        row = {"prompt": prompt_text(a, b), "answer": str(a * b)}
        if with_completion:
            row["completion"] = demonstration(a, b)
        lines.append(json.dumps(row) + "\n")
    return "".join(lines)


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, unless the file already holds it: several
    processes import the experiments at once, and each either leaves the file alone or
    renames a complete copy of its own over it."""
    data = text.encode()
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_calculator_data(
    out_dir: str | Path,
    seed: int = 0,
    sft_rows: int = 4000,
    rl_rows: int = 20000,
    eval_rows: int = 200,
) -> dict[str, Path]:
    """Write ``sft.jsonl`` (prompt, completion, answer: demonstrations), ``rl.jsonl`` and
    ``eval.jsonl`` (prompt, answer) under ``out_dir``, with distinct problems drawn for
    ``seed``; returns their paths by name ("sft", "rl", "eval"). Deterministic, and files
    that already hold what would be written are left alone."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems = _problems(seed, eval_rows + sft_rows + rl_rows)
    # Eval problems are drawn first, so the held-out set stays the same when the other
    # files' sizes change.
    parts = {
        "eval": _rows(problems[:eval_rows], with_completion=False),
        "sft": _rows(problems[eval_rows : eval_rows + sft_rows], with_completion=True),
        "rl": _rows(problems[eval_rows + sft_rows :], with_completion=False),
    }
    paths = {}
    for name, text in parts.items():
        paths[name] = out / f"{name}.jsonl"
        _write_if_changed(paths[name], text)
    return paths
