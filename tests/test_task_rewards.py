"""Tests for asyncrl.tasks.rewards: the math reward on hand-written cases, the format
reward, user functions named by import path, weighted sums figured by hand, the checks
that refuse bad terms (in ``build_task`` and in ``RLExperiment.finalize``), and the terms
running inside the reward pool's spawned workers."""

from __future__ import annotations

import json
import math
import pickle
import time
from pathlib import Path

import pytest

from asyncrl.buffer.rewards import RewardConfig, RewardPool
from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.tasks import Example, TaskConfig, build_task
from asyncrl.tasks.reasoning_gym import ReasoningGymTask
from asyncrl.tasks.rewards import WeightedRewards, check_rewards, math_reward

REPO = Path(__file__).resolve().parents[1]
FNS = "tests.reward_fns"


def _example(answer: str | None, prompt: str = "q") -> Example:
    return Example(uid="t:0", prompt=prompt, answer=answer)


# (reference answer, completion, reward)
MATH_CASES = [
    # Equivalent forms.
    ("42", "\\boxed{42}", 1.0),
    ("42", "The answer is 42.", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("0.5", "$\\frac{1}{2}$", 1.0),
    ("1/2", "\\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "so it is 1/2", 1.0),
    ("\\dfrac12", "0.5", 1.0),
    ("x = 3", "$x = 3$", 1.0),
    ("3", "Solving, $x = 3$", 1.0),
    ("1,234", "1234", 1.0),
    ("3.0", "3", 1.0),
    ("2^{10}", "\\boxed{1024}", 1.0),
    ("(1, 2)", "\\boxed{(1,2)}", 1.0),
    ("\\sqrt{2}", "$\\sqrt{2}$", 1.0),
    ("The answer is $\\boxed{5}$", "\\boxed{5}", 1.0),
    # Tags around the answer, as a format reward asks for.
    ("0.5", "<think>5 or 6?</think><answer>1/2</answer>", 1.0),
    ("42", "<answer>42</answer>", 1.0),
    # GSM8K: the reference after its last ####, and a completion's last line "#### x".
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "48 + 24 = 72 clips.\n#### 72", 1.0),
    ("72", "She sold 3, then 5 more.\n#### 72", 1.0),
    ("\\sqrt{2}", "Squaring gives 2.\n#### \\sqrt{2}", 1.0),
    ("1024", "x = 5 so y = 10.\n#### 2^{10}", 1.0),
    ("18", "#### $18", 1.0),
    ("7", "10 - 3 = 7\n#### 7\n", 1.0),
    # A "####" heading that is not the last line is left alone.
    ("42", "#### Step 1\nThe answer is \\boxed{42}.", 1.0),
    # Wrong answers.
    ("42", "41", 0.0),
    ("\\frac{1}{2}", "\\frac{1}{3}", 0.0),
    ("x = 3", "x = 4", 0.0),
    ("(1, 2)", "\\boxed{[1, 2]}", 0.0),
    ("1024", "#### 2^{11}", 0.0),
    ("72", "48 + 24 = 72 clips, and 5 apples", 0.0),  # the last number is the answer
    ("42", "\\boxed{42} or \\boxed{41}", 0.0),  # hedging is not an answer
    # Malformed completions score 0 and do not raise.
    ("42", "\\boxed{", 0.0),
    ("42", "", 0.0),
    ("42", "####", 0.0),
    ("42", "#### ", 0.0),
    ("42", "garbage", 0.0),
    ("42", "\\frac{1}{", 0.0),
    ("42", "}}}{{", 0.0),
    ("42", "$$$", 0.0),
]


@pytest.mark.parametrize(("reference", "completion", "reward"), MATH_CASES)
def test_math_reward_table(reference, completion, reward):
    assert math_reward(_example(reference), completion) == reward


@pytest.mark.parametrize("reference", [None, "", "####", "Some work.\n####  "])
def test_math_reward_refuses_a_missing_reference(reference):
    with pytest.raises(ValueError, match="t:0"):
        math_reward(_example(reference), "42")


# --- tasks built with reward terms --------------------------------------------------------


def _jsonl_cfg(tmp_path: Path, **kwargs) -> TaskConfig:
    rows = [
        {"prompt": "echo half", "answer": "\\frac{1}{2}"},
        {"prompt": "seventy-two", "answer": "72"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TaskConfig(source="jsonl", train_path=str(path), answer_pattern=None, **kwargs)


def test_no_rewards_or_task_alone_is_the_source_task_unwrapped():
    # make demo relies on this: the default config scores exactly as before.
    for rewards in ({}, {"task": 1.0}, {"task": 1}):
        task = build_task(TaskConfig(train_size=50, eval_size=5, rewards=rewards))
        assert type(task) is ReasoningGymTask


def test_weighted_sum_figured_by_hand(tmp_path):
    rewards = {"task": 0.5, "math": 0.25, "format": 0.125, f"{FNS}:answer_echo": 2.0}
    task = build_task(_jsonl_cfg(tmp_path, rewards=rewards, format_pattern=r"<answer>.*</answer>"))
    assert isinstance(task, WeightedRewards)
    half, seventy_two = task.examples("train")
    assert task.name == "jsonl/train" and half.answer == "\\frac{1}{2}"
    # task: exact match of the whole text; math: 1/2 = 0.5; format: tag; echo: 0.5 (prompt).
    assert task.score(half, "<answer>0.5</answer>") == 0.25 + 0.125 + 2.0 * 0.5
    assert task.score(half, "\\frac{1}{2}") == 0.5 + 0.25 + 2.0 * (0.25 + 0.5)
    assert task.score(seventy_two, "<answer>71</answer>") == 0.125
    assert task.score(seventy_two, "72") == 0.5 + 0.25 + 2.0 * 0.25
    assert task.score(seventy_two, "") == 0.0


def test_task_term_is_the_verifier_and_weights_may_be_negative():
    cfg = TaskConfig(train_size=50, eval_size=5, answer_pattern=r"<answer>(-?\d+)</answer>")
    cfg.rewards = {"task": 1.0, "format": 0.5, f"{FNS}:length_penalty": 1.0}
    task = build_task(cfg)
    ex = task.examples("train")[3]
    right = f"<answer>{ex.answer}</answer>"
    assert task.score(ex, right) == pytest.approx(1.5 - 0.01 * len(right))
    wrong = f"<answer>{int(ex.answer) + 1}</answer>"
    assert task.score(ex, wrong) == pytest.approx(0.5 - 0.01 * len(wrong))
    assert task.score(ex, ex.answer) == pytest.approx(-0.01 * len(ex.answer))


def test_format_reward_searches_anywhere(tmp_path):
    task = build_task(_jsonl_cfg(tmp_path, rewards={"format": 1.0}))
    ex = task.examples("train")[0]
    assert task.score(ex, "think... <answer>\n1/2\n</answer> done") == 1.0
    assert task.score(ex, "<answer>1/2") == 0.0
    task = build_task(_jsonl_cfg(tmp_path, rewards={"format": 1.0}, format_pattern=r"^\d+$"))
    assert task.score(ex, "12") == 1.0 and task.score(ex, "12 apples") == 0.0


def test_weighted_task_pickles_as_its_config(tmp_path):
    task = build_task(_jsonl_cfg(tmp_path, rewards={"math": 1.0, f"{FNS}:answer_echo": 1.0}))
    again = pickle.loads(pickle.dumps(task))
    ex = task.examples("train")[1]
    assert isinstance(again, WeightedRewards) and again.config == task.config
    assert again.score(ex, "#### 72") == task.score(ex, "#### 72") == 1.25


@pytest.mark.parametrize(
    ("fn", "error"),
    [("returns_nan", "not a finite number"), ("returns_text", "'high', not a number")],
)
def test_a_user_function_that_gives_no_number_raises(tmp_path, fn, error):
    task = build_task(_jsonl_cfg(tmp_path, rewards={"math": 1.0, f"{FNS}:{fn}": 0.1}))
    with pytest.raises((ValueError, TypeError), match=f"{FNS}:{fn}.*{error}"):
        task.score(task.examples("train")[0], "1/2")


# --- bad configs ----------------------------------------------------------------------------

BAD_REWARDS = [
    ({"maths": 1.0}, "'maths' is unknown"),
    ({"math": "high"}, "weight 'high' is not a number"),
    ({"math": True}, "weight True is not a number"),
    ({"math": float("nan")}, "weight nan is not finite"),
    ({"format": 1.0}, "format_pattern '<answer\\(' is not a regex"),
    ({"tests.reward_fns": 1.0}, "'tests.reward_fns' is unknown"),
    ({":answer_echo": 1.0}, 'is not "module:function"'),
    ({f"{FNS}:": 1.0}, 'is not "module:function"'),
    ({"tests.no_such_module:fn": 1.0}, "cannot import 'tests.no_such_module'"),
    ({f"{FNS}:missing": 1.0}, "has no attribute 'missing'"),
    ({f"{FNS}:NOT_CALLABLE": 1.0}, "'NOT_CALLABLE' is a float, not a function"),
    ({f"{FNS}:one_argument": 1.0}, r"one_argument\(completion.*cannot be called as"),
    ({f"{FNS}:keyword_only": 1.0}, "keyword_only.*cannot be called as"),
]


@pytest.mark.parametrize(("rewards", "error"), BAD_REWARDS)
def test_bad_reward_terms_are_refused_by_name(rewards, error):
    cfg = TaskConfig(train_size=50, eval_size=5, rewards=rewards, format_pattern="<answer(")
    with pytest.raises(ValueError, match=f"task.rewards term .*{error}"):
        check_rewards(cfg)
    with pytest.raises(ValueError, match=error):
        build_task(cfg)


def test_a_module_that_fails_to_import_is_refused_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_module.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TaskConfig(rewards={"broken_reward_module:fn": 1.0})
    with pytest.raises(ValueError, match="cannot import .*RuntimeError: no GPU here"):
        check_rewards(cfg)


def test_good_terms_pass_the_check():
    cfg = TaskConfig(rewards={"task": 1, "math": 0.5, "format": -0.1, f"{FNS}:length_penalty": 0})
    check_rewards(cfg)


def test_rl_finalize_refuses_bad_rewards_before_anything_starts(tmp_path):
    cfg = load_experiment(REPO / "experiments/tiny_grpo.py")
    cfg.run_dir = str(tmp_path / "run")
    apply_overrides(cfg, [f"task.rewards.{FNS}:missing=0.5", "task.rewards.math=1.0"])
    assert cfg.task.rewards == {f"{FNS}:missing": 0.5, "math": 1.0}
    with pytest.raises(ConfigError, match=f"task.rewards term '{FNS}:missing'.*no attribute"):
        cfg.finalize()
    cfg = load_experiment(REPO / "experiments/tiny_grpo.py")
    cfg.run_dir = str(tmp_path / "run")
    apply_overrides(cfg, [f"task.rewards.{FNS}:answer_echo=0.5", "task.rewards.math=1.0"])
    cfg.finalize()


# --- in the reward pool ---------------------------------------------------------------------


def test_terms_run_in_the_reward_pool_workers(tmp_path):
    cfg = _jsonl_cfg(tmp_path, rewards={"math": 1.0, f"{FNS}:answer_echo": 2.0})
    inline = build_task(cfg)
    cases = {
        "right": (0, "so it is 0.5", 1.0 + 2.0 * 0.5),
        "gsm8k": (1, "48 + 24\n#### 72", 1.0 + 2.0 * 0.25),
        "wrong": (1, "\\boxed{71}", 0.0),
        "malformed": (1, "\\boxed{", 0.0),
    }
    pool = RewardPool(cfg, RewardConfig(workers=1, timeout_s=60.0))
    try:
        for key, (index, completion, _) in cases.items():
            pool.submit(key, "train", index, completion)
        results = _drain(pool)
    finally:
        pool.close()
    for key, (index, completion, reward) in cases.items():
        assert results[key] == reward == inline.score(inline.examples("train")[index], completion)
    assert pool.counters()["scored"] == len(cases) and pool.counters()["errors"] == 0


def test_a_non_finite_user_reward_is_an_error_in_the_pool(tmp_path):
    cfg = _jsonl_cfg(tmp_path, rewards={"math": 1.0, f"{FNS}:returns_nan": 1.0})
    pool = RewardPool(cfg, RewardConfig(workers=0))
    pool.submit("nan", "train", 0, "0.5")
    assert pool.poll() == [("nan", 0.0)] and pool.counters()["errors"] == 1


def _drain(pool: RewardPool, timeout_s: float = 120.0) -> dict[str, float]:
    """Poll until nothing is pending (spawned workers import torch and math-verify)."""
    deadline = time.monotonic() + timeout_s
    results: dict[str, float] = {}
    while pool.pending():
        assert time.monotonic() < deadline, f"{pool.pending()} items still pending"
        results.update(pool.poll())
        time.sleep(0.05)
    assert all(math.isfinite(r) for r in results.values())
    return results
