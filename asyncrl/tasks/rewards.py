"""Reward terms named in ``TaskConfig.rewards``, and the task wrapper that sums them.

``build_task`` wraps a source's task in ``WeightedRewards`` when ``rewards`` asks for
more than the source's own check; its ``score`` is the weighted sum of the terms:

* "task": the wrapped task's own score (reasoning-gym's verifier, JSONL exact match);
* "math": 1 when math-verify finds the completion's answer equal to the reference answer
  (LaTeX, ``\\boxed{}``, fractions, GSM8K's ``####``), else 0;
* "format": 1 when ``format_pattern`` occurs in the completion, else 0;
* "module:function": a user function called as ``function(example, completion)``.

Every term runs inside ``score``, so the buffer's reward workers (which rebuild the task
from its config) run them all under the pool's timeout; a user module must be importable
there (installed, or under the directory the run starts in). ``check_rewards`` loads and
checks every term without building anything, so that ``RLExperiment.finalize`` turns a
bad name, weight, regex or signature into a ``ConfigError`` before any process starts.

The sum is not clipped: a term may give any finite number, and weights may be negative
(penalties). A term that gives NaN or infinity raises, so the reward pool counts an error
and scores the completion 0 rather than hiding the bug. Evaluation's accuracy (and the
preference-pair grading) counts a completion correct when its reward reaches 1, whatever
the weights: {"math": 1.0, "format": 0.1} counts a right answer without the tag as
correct, {"math": 0.5, "format": 0.5} only a right answer in the tag.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.tasks.base import Example, Split, Task, TaskConfig

RewardFn = Callable[[Example, str], float]
"""A reward term: (example, completion) -> reward."""

BUILTIN_TERMS = ("task", "math", "format")
GSM8K_MARK = "####"
# An XML-like tag (<answer>, </think>): math-verify reads no number that touches one.
_TAG = re.compile(r"</?[A-Za-z][\w-]*>")


class WeightedRewards:
    """A task whose score is the weighted sum of ``config.rewards``' terms; the examples,
    name and config are the wrapped task's. See the module docstring."""

    def __init__(self, task: Task) -> None:
        self._task = task
        self.config = task.config
        terms = load_terms(task.config)
        # "task" is the one term that needs the wrapped task, so it is bound here.
        self._terms = [
            (name, float(self.config.rewards[name]), fn or task.score) for name, fn in terms.items()
        ]

    def __reduce__(self) -> tuple[Any, ...]:
        # The wrapped task pickles as its config; the terms are loaded again from it.
        return (type(self), (self._task,))

    @property
    def name(self) -> str:
        return self._task.name

    def examples(self, split: Split) -> Sequence[Example]:
        return self._task.examples(split)

    def score(self, example: Example, completion: str) -> float:
        """The sum of weight × term over the terms; raises when a term gives something
        other than a finite number."""
        total = 0.0
        for name, weight, fn in self._terms:
            value = fn(example, completion)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"reward term {name!r} returned {value!r}, not a number") from None
            if not math.isfinite(value):
                raise ValueError(f"reward term {name!r} returned {value}, not a finite number")
            total += weight * value
        return total


def check_rewards(cfg: TaskConfig, key: str = "task.rewards") -> None:
    """Raise ValueError, naming ``key`` and the term, if a term of ``cfg.rewards`` cannot
    be used: an unknown name, a weight that is not a finite number, a ``format_pattern``
    that is not a regex, or a user function that does not import or cannot be called with
    (example, completion). Imports the user modules; builds no task."""
    load_terms(cfg, key)


def load_terms(cfg: TaskConfig, key: str = "task.rewards") -> dict[str, RewardFn | None]:
    """Each term of ``cfg.rewards`` as its function (None for "task", the wrapped task's
    own score), checked as ``check_rewards`` says."""
    if not isinstance(cfg.rewards, dict):
        raise ValueError(f"{key} must be a dict of term -> weight, got {cfg.rewards!r}")
    terms: dict[str, RewardFn | None] = {}
    for name, weight in cfg.rewards.items():
        # bool is an int, but `true` as a weight is a mistake, not 1.
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{key} term {name!r}: weight {weight!r} is not a number")
        if not math.isfinite(weight):
            raise ValueError(f"{key} term {name!r}: weight {weight} is not finite")
        terms[name] = _term(name, cfg, key)
    return terms


def _term(name: str, cfg: TaskConfig, key: str) -> RewardFn | None:
    if name == "task":
        return None
    if name == "math":
        return math_reward
    if name == "format":
        try:
            return format_reward(re.compile(cfg.format_pattern))
        except re.error as e:
            raise ValueError(
                f"{key} term 'format': format_pattern {cfg.format_pattern!r} is not a regex: {e}"
            ) from None
    if ":" in name:
        return load_reward_fn(name, key)
    raise ValueError(
        f"{key} term {name!r} is unknown: use one of {', '.join(BUILTIN_TERMS)} "
        'or a user function as "module:function"'
    )


def load_reward_fn(path: str, key: str = "task.rewards") -> RewardFn:
    """The function ``path`` ("module:function") names, checked to be callable with
    (example, completion); raises ValueError naming ``key``, the term and the problem."""
    module_name, _, attr = path.partition(":")
    where = f"{key} term {path!r}"
    if not module_name or not attr or ":" in attr:
        raise ValueError(f'{where} is not "module:function"')
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        # Anything the module raises while importing, not only a missing module: the user
        # wants to know why their reward did not load, before the run starts.
        raise ValueError(f"{where}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{where}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # some builtins have no signature to check; calling them will tell
    try:
        signature.bind(None, "")
    except TypeError as e:
        raise ValueError(
            f"{where}: {attr}{signature} cannot be called as {attr}(example, completion): {e}"
        ) from None
    return fn


def format_reward(pattern: re.Pattern[str]) -> RewardFn:
    """The "format" term: 1.0 when ``pattern`` occurs anywhere in the completion."""

    def score(example: Example, completion: str) -> float:
        return 1.0 if pattern.search(completion) else 0.0

    return score


def math_reward(example: Example, completion: str) -> float:
    """The "math" term: 1.0 when math-verify finds the completion's answer equal to
    ``example.answer``, else 0.0; a completion it cannot read (empty, unbalanced braces,
    no answer) scores 0.0. Raises ValueError when the reference answer itself is missing
    or unreadable: that is a data problem, not the model's."""
    from math_verify import verify

    if example.answer is None:
        raise ValueError(f"{example.uid} has no reference answer for the math reward")
    gold = parse_reference(example.answer)
    if not gold:
        raise ValueError(f"{example.uid}: math-verify cannot read reference {example.answer!r}")
    predicted = parse_completion(completion)
    if not predicted:
        return 0.0
    # timeout_seconds=None: math-verify's own timeout uses signal.alarm, which fails
    # outside the main thread; the reward pool's timeout bounds the call instead.
    return 1.0 if verify(list(gold), predicted, timeout_seconds=None) else 0.0


@functools.lru_cache(maxsize=4096)
def parse_reference(answer: str) -> tuple[Any, ...]:
    """The reference answer as math-verify reads it (empty when it cannot). A GSM8K answer
    is what follows its last ``####``. A bare answer is read as the content of a
    ``\\boxed{}``, so that the whole text is one expression (``2^{10}``, ``(1, 2)``, ``x = 3``)
    rather than the last number in it; cached because every sample of a prompt shares it."""
    if GSM8K_MARK in answer:
        answer = answer.rsplit(GSM8K_MARK, 1)[1]
    answer = answer.strip()
    if not answer:
        return ()
    if "\\boxed" not in answer:
        boxed = _parse(f"\\boxed{{{answer}}}")
        if boxed:
            return tuple(boxed)
    return tuple(_parse(answer))


def parse_completion(completion: str) -> list[Any]:
    """The completion's answer as math-verify reads it (empty when it cannot). Tags such
    as ``<answer>`` get spaces around them, and a last line "#### answer" (GSM8K's format)
    becomes ``\\boxed{answer}``, which math-verify reads before any other number."""
    completion = _TAG.sub(lambda tag: f" {tag.group(0)} ", completion)
    head, mark, tail = completion.rpartition(GSM8K_MARK)
    # Only a last line: "####" earlier in the text may be a markdown heading.
    if mark and "\n" not in tail.strip():
        completion = f"{head}\\boxed{{{tail.strip()}}}"
    return _parse(completion)


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    # parsing_timeout=None for the same reason as verify's timeout_seconds above.
    return parse(text, parsing_timeout=None, raise_on_error=False)
