"""Tests for asyncrl.envs.calculator: the environment's steps and replayability, the safe
evaluator, and the data files (disjoint, deterministic, and covering every character an
observation can hold, since the char tokenizer is built from their texts)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from asyncrl.envs.calculator import (
    ERROR_OBSERVATION,
    Calculator,
    evaluate,
    write_calculator_data,
)
from asyncrl.episodes.env import load_environment
from asyncrl.tasks import Example, load_jsonl
from asyncrl.tasks.base import TaskConfig
from asyncrl.tasks.jsonl import JsonlTask

SIZES = {"sft_rows": 300, "rl_rows": 500, "eval_rows": 50}


def example(a: int = 123, b: int = 45) -> Example:
    return Example(uid="eval:1", prompt=f"{a}*{b}\n", answer=str(a * b))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return write_calculator_data(tmp_path_factory.mktemp("calc"), seed=3, **SIZES)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- the environment ---------------------------------------------------------------------


def test_call_then_right_answer():
    env = Calculator(example())
    step = env.step("calc 123*45")
    assert (step.observation, step.done) == ("= 5535\n", False)
    step = env.step("answer 5535")
    assert (step.reward, step.done) == (1.0, True)
    assert (env.tool_calls, env.tool_errors) == (1, 0)


@pytest.mark.parametrize(
    "turn", ["answer 5536", "answer 5535x", "answer", "answer -5535", "answer ²"]
)
def test_wrong_answer_scores_zero(turn):
    step = Calculator(example()).step(turn)
    assert (step.reward, step.done) == (0.0, True)


def test_answer_compares_integers():
    assert Calculator(example()).step("answer 05535").reward == 1.0


@pytest.mark.parametrize("expression", ["123*", "12/3", "1-5", "", "2**3", "1*" + "9" * 40])
def test_malformed_call_is_an_error_observation(expression):
    env = Calculator(example())
    step = env.step(f"calc {expression}")
    assert (step.observation, step.done) == (ERROR_OBSERVATION, False)
    assert (env.tool_calls, env.tool_errors) == (1, 1)
    # The episode goes on: the model may call again.
    assert env.step("calc 123*45").observation == "= 5535\n"
    assert (env.tool_calls, env.tool_errors) == (2, 1)


@pytest.mark.parametrize("turn", ["5535", "the answer is 5535", "", "calculate 1*2"])
def test_garbage_ends_with_zero(turn):
    env = Calculator(example())
    step = env.step(turn)
    assert (step.reward, step.done) == (0.0, True)
    assert env.tool_calls == 0


def test_replayable():
    turns = ["calc 123*45", "calc 1+", "calc 12*3+4", "answer 5535"]
    first, second = Calculator(example()), Calculator(example())
    assert [first.step(t) for t in turns] == [second.step(t) for t in turns]


def test_needs_a_reference_answer():
    with pytest.raises(ValueError, match="reference answer"):
        Calculator(Example(uid="x", prompt="1*2\n"))


def test_loads_by_name():
    assert load_environment("asyncrl.envs.calculator:Calculator") is Calculator


def test_evaluate():
    assert evaluate("999*99") == 98901
    assert evaluate(" 12 * 3 + 4 ") == 40
    assert evaluate("7") == 7
    for bad in ["", "1+", "(1+2)", "1-2", "2^3", "__import__('os')", "99999*99999*99999"]:
        with pytest.raises(ValueError):
            evaluate(bad)


# --- the data files ----------------------------------------------------------------------


def test_files_load_as_jsonl_task(data):
    task = JsonlTask(
        TaskConfig(source="jsonl", train_path=str(data["sft"]), eval_path=str(data["eval"]))
    )
    train, held = task.examples("train"), task.examples("eval")
    assert (len(train), len(held)) == (SIZES["sft_rows"], SIZES["eval_rows"])
    assert train[0].completion.startswith("calc ")
    assert len(load_jsonl(data["rl"])) == SIZES["rl_rows"]


def test_demonstrations_are_what_the_environment_answers(data):
    for row in rows(data["sft"])[:50]:
        call, observation, answer, end = row["completion"].split("\n")
        env = Calculator(Example(uid="x", prompt=row["prompt"], answer=row["answer"]))
        assert call == "calc " + row["prompt"].strip() and end == ""
        assert env.step(call).observation == observation + "\n"
        assert env.step(answer).reward == 1.0


def test_files_disjoint(data):
    prompts = {name: {r["prompt"] for r in rows(path)} for name, path in data.items()}
    assert sum(len(p) for p in prompts.values()) == sum(SIZES.values())
    assert not (prompts["sft"] & prompts["rl"] or prompts["sft"] & prompts["eval"])
    assert not prompts["rl"] & prompts["eval"]


def test_files_deterministic_and_rewritten_only_when_changed(data, tmp_path):
    again = write_calculator_data(tmp_path, seed=3, **SIZES)
    for name in data:
        assert again[name].read_bytes() == data[name].read_bytes()
    mtimes = {name: p.stat().st_mtime_ns for name, p in again.items()}
    write_calculator_data(tmp_path, seed=3, **SIZES)
    assert {name: p.stat().st_mtime_ns for name, p in again.items()} == mtimes
    other = write_calculator_data(tmp_path / "other", seed=4, **SIZES)
    assert other["rl"].read_bytes() != data["rl"].read_bytes()
    # The held-out set does not depend on the other files' sizes.
    bigger = write_calculator_data(
        tmp_path / "bigger", seed=3, sft_rows=400, rl_rows=10, eval_rows=50
    )
    assert bigger["eval"].read_bytes() == data["eval"].read_bytes()


def test_observation_characters_occur_in_the_data(data):
    """Every character an observation can hold is in the texts the tokenizer is built from
    (the SFT rows' prompt + completion): the data's own calls, malformed ones, and any
    result (digits only)."""
    sft = rows(data["sft"])
    alphabet = set("".join(r["prompt"] + r["completion"] for r in sft))
    problems = [r["prompt"].strip() for name in data for r in rows(data[name])]
    observations = set()
    env = Calculator(example())
    for expression in problems + ["1*", "1/2", "x", "9" * 40, "12*3+4", ""]:
        observations.add(env.step(f"calc {expression}").observation)
    assert ERROR_OBSERVATION in observations
    assert set("".join(observations)) | set(string.digits) <= alphabet
