"""Tasks: where prompts come from and how a completion is scored.

A task yields ``Example``s (a templated prompt plus a reference answer, SFT target or
preference pair) for a split, and turns a completion text into a reward in [0, 1]. SFT
reads ``completion``, the evaluator scores greedy completions, and the buffer's reward
workers call ``score``; a task is rebuilt from its ``TaskConfig`` in each worker, so it
holds no live state that matters beyond that config. This module owns the config, the
interface, prompt/completion templates, answer extraction and ``build_task``.
"""

from __future__ import annotations

import functools
import logging
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

log = logging.getLogger(__name__)

Split = Literal["train", "eval", "unseen"]


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and line."""


def _default_dataset_kwargs() -> dict[str, Any]:
    # Two-term +/- sums of numbers up to 100: learnable by a tiny model in minutes.
    return {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    }


@dataclass
class TaskConfig:
    source: Literal["reasoning_gym", "jsonl", "dataset"] = "reasoning_gym"
    """Where examples come from: "reasoning_gym" (procedural, verified), "jsonl" (asyncrl's
    own strict row format, ``asyncrl.tasks.jsonl``) or "dataset" (local JSONL, JSON or
    Parquet files in the common shapes, loaded with the ``datasets`` library and mapped by
    ``fields``; ``asyncrl.tasks.dataset``)."""
    dataset: str = "basic_arithmetic"
    """reasoning-gym dataset name (source="reasoning_gym")."""
    dataset_kwargs: dict[str, Any] = field(default_factory=_default_dataset_kwargs)
    """Passed to reasoning_gym.create_dataset; the default suits basic_arithmetic only,
    so set it (e.g. to {}) when changing `dataset`."""
    train_size: int = 20000
    """Number of train examples (source="reasoning_gym")."""
    eval_size: int = 200
    """Number of held-out eval examples (source="reasoning_gym")."""
    seed: int = 0
    """Seed of the train split. reasoning-gym seeds item i with Random(seed + i)."""
    eval_seed: int = 1_000_000_000
    """Seed of the eval split; must be far from `seed` (see `seed`), checked at build."""
    train_path: str | None = None
    """File of train rows (source="jsonl" or "dataset")."""
    eval_path: str | None = None
    """File of eval rows (source="jsonl" or "dataset"); without it the eval split is an
    error."""
    fields: dict[str, str] = field(default_factory=dict)
    """source="dataset": asyncrl's name → the file's column, for the names prompt, answer,
    completion, messages, chosen, rejected and system; a name left out is read from the
    column of the same name when there is one. GSM8K's files: {"prompt": "question"};
    MATH's: {"prompt": "problem", "completion": "solution"}."""
    reference: Literal["auto", "raw", "gsm8k", "boxed"] = "auto"
    """How the reference answer is read from the answer (or completion) text of a
    source="dataset" row: "gsm8k" takes what follows the last ``####``, "boxed" the
    content of the last ``\\boxed{}``, "raw" the whole stripped text, and "auto" the first of
    these that applies."""
    prompt_template: str = "{question}"
    """str.format template for the prompt; {question} is the raw question / row prompt."""
    completion_template: str = " {answer}"
    """str.format template turning the reference {answer} into an SFT target completion;
    reasoning-gym datasets with worked solutions (``arithmetic_series``) also offer
    {solution}."""
    answer_pattern: str | None = r"-?\d+"
    """Regex extracting the answer from a completion: last match, group 1 if the regex has a
    group. None: the stripped completion is the answer. The default suits integer answers."""
    prompt_format: Literal["plain", "chat"] = "plain"
    """How a prompt becomes tokens. "plain": the templated prompt text, with the special
    tokens the tokenizer's post-processor adds (a Llama tokenizer's BOS; none for Qwen or
    the tiny char tokenizer). "chat": the tokenizer's chat template over the system prompt
    and the user turn (or a row's ``messages``), with the generation prompt; SFT and
    preference completions are the assistant turn the template writes, through its
    end-of-turn token. The same rendering serves SFT, RL, evaluation and preference data
    (``asyncrl.tasks.prompts``). Engines stop at the model's EOS ids: with a base model
    whose EOS is not the template's end of turn, add that token's id to
    ``sampling.stop_token_ids``."""
    system_prompt: str | None = None
    """System message put first when prompt_format="chat" (a row's own system message
    wins); None: none, or the template's default where it has one."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward terms and their weights; the reward is the weighted sum. Terms: "task" (the
    source's own check: reasoning-gym's verifier or exact match), "math" (math-verify
    against the reference answer: LaTeX, \\boxed{}, fractions, GSM8K's ``####``),
    "format" (1 when ``format_pattern`` matches the completion), or a user function
    "module:function" called as ``function(example, completion) -> float``. Empty:
    {"task": 1.0}. Every term runs in the reward pool, under its timeout. The sum is not
    clipped (a negative weight is a penalty); a term that returns no finite number is an
    error, scored 0. Evaluation counts a completion correct when its reward reaches 1
    (``asyncrl.tasks.rewards``)."""
    format_pattern: str = r"<answer>[\s\S]*?</answer>"
    """Regex the "format" reward term searches the completion for."""
    rl_split: Literal["train", "unseen"] = "train"
    """Split that RL stages draw prompts from. "unseen" (reasoning_gym): problems in neither
    train nor eval, for RL after SFT on train: a small policy partly memorizes its SFT
    problems, and RL on those transfers little to held-out problems."""
    unseen_seed: int = 2_000_000_000
    """Seed of the unseen split's candidates; must be far from `seed` and `eval_seed`."""
    unseen_candidates: int = 20000
    """Problems drawn for the unseen split before dropping those in train or eval."""
    environment: str = ""
    """A multi-turn task: the ``asyncrl.episodes.Environment`` subclass ("module:Class")
    that answers each model turn. Each sample is then an episode: model turns (trained)
    and the environment's observations (in the context, out of the loss), one token
    sequence; its reward is the environment's. Empty: one prompt, one completion."""
    max_turns: int = 4
    """Model turns per episode at most (``environment``); an episode cut here finishes
    with reason "length"."""
    max_episode_tokens: int = 256
    """Tokens after the prompt per episode at most, model turns and observations together
    (``environment``): each turn's budget is the smaller of ``sampling.max_new_tokens``
    and what is left of this; engines are sized for the longest prompt plus this."""
    env_threads: int = 8
    """Environment steps a generator runs at once (``environment``); more wait. Raise it
    for environments that block long (an ``AgentEnvironment`` waits for its agent)."""
    full_marks_only: bool = False
    """Reward 1 for full marks and 0 for anything else. Verifiers' partial credit
    (reasoning-gym gives some to answers that merely contain the reference) is easy for
    RL to game, while evaluation counts only full marks."""


@dataclass(frozen=True)
class Example:
    """One prompt with whatever the consumers need; fields a row lacks are None."""

    uid: str
    """Stable id within the task, f"{split}:{index}" (jsonl: 1-based line number)."""
    prompt: str
    """The prompt, already templated."""
    answer: str | None = None
    """Reference answer, for scoring."""
    completion: str | None = None
    """SFT target completion."""
    chosen: str | None = None
    """Preferred completion of a preference pair."""
    rejected: str | None = None
    """Dispreferred completion of a preference pair."""
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False)
    """The conversation before the completion, as chat turns ({"role", "content"}), for
    rows that come as conversations; rendered by the chat template. None: ``prompt`` is
    the user turn."""
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Whatever the scorer needs (reasoning-gym: the dataset entry and its index)."""


class Task(Protocol):
    """A source of examples and a reward function; built by ``build_task``."""

    config: TaskConfig

    @property
    def name(self) -> str:
        """A short name for logs and metrics, e.g. "reasoning_gym/basic_arithmetic"."""
        ...

    def examples(self, split: Split) -> Sequence[Example]:
        """The split's examples: indexable, sized, the same for the same config anywhere."""
        ...

    def score(self, example: Example, completion: str) -> float:
        """The reward of ``completion`` as an answer to ``example``, in [0, 1]."""
        ...


def extract_answer(text: str, pattern: str | None) -> str | None:
    """The answer in ``text``: the last match of ``pattern`` (its group 1 if it has groups,
    else the whole match), stripped; ``pattern=None`` takes the whole stripped text.
    None when nothing matches or the answer is empty."""
    if pattern is None:
        answer = text.strip()
    else:
        matches = list(re.finditer(pattern, text))
        if not matches:
            return None
        last = matches[-1]
        answer = last.group(1) if last.re.groups else last.group(0)
        # An optional group that did not take part in the match has no answer.
        answer = answer.strip() if answer is not None else ""
    return answer or None


def check_template(template: str, name: str, fields: Sequence[str]) -> None:
    """Fail now, with the template and field named, if ``template`` cannot be formatted
    with exactly ``fields``; better at build time than on the first example."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{name} {template!r} is not a valid str.format template: {e}") from e
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        root = re.split(r"[.\[]", field_name, maxsplit=1)[0]
        if root not in fields:
            allowed = ", ".join("{" + f + "}" for f in fields)
            raise ValueError(
                f"{name} {template!r} references unknown field {root!r}; available: {allowed}"
            )
    try:
        template.format(**{f: "x" for f in fields})
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"{name} {template!r} cannot be formatted: {e}") from e


def check_common(cfg: TaskConfig, completion_fields: Sequence[str] = ("answer",)) -> None:
    """Checks every source shares: templates and the answer pattern. A source whose rows
    carry more than a reference answer (a worked solution) names those fields."""
    check_template(cfg.prompt_template, "prompt_template", ["question"])
    check_template(cfg.completion_template, "completion_template", completion_fields)
    if cfg.answer_pattern is not None:
        try:
            re.compile(cfg.answer_pattern)
        except re.error as e:
            raise ValueError(f"answer_pattern {cfg.answer_pattern!r} is not a regex: {e}") from e


def exact_match(example: Example, completion: str, pattern: str | None, why: str = "") -> float:
    """1.0 when the answer ``pattern`` extracts from ``completion`` equals the example's
    reference answer (both stripped), else 0.0; a row without a reference is an error
    (``why`` says where the reference would have come from)."""
    if example.answer is None:
        raise ValueError(f"{example.uid} has no reference answer to score against{why}")
    answer = extract_answer(completion, pattern)
    return 1.0 if answer is not None and answer == example.answer.strip() else 0.0


def score_or_error(task: Task, example: Example, completion: str) -> tuple[float, str | None]:
    """(reward, None), or (0.0, the error as text) when the task's scorer raises: a reward
    function failing on one completion scores it 0 and is counted, never ends a run."""
    try:
        return float(task.score(example, completion)), None
    except Exception as e:
        return 0.0, f"{type(e).__name__}: {e}"


def held_out(
    examples: list[Example],
    train: Sequence[Example],
    path: str,
    train_path: str | None,
    key: Callable[[Example], Any] = lambda e: e.prompt,
) -> list[Example]:
    """The eval ``examples`` whose ``key`` (the prompt) occurs in no ``train`` example:
    held-out must be held out. Dropping some is logged; dropping all is a DataError."""
    train_keys = {key(e) for e in train}
    kept = [e for e in examples if key(e) not in train_keys]
    if not kept:
        raise DataError(f"{path}: every eval prompt also occurs in {train_path}")
    if len(kept) < len(examples):
        log.warning(
            "%s: dropped %d eval rows whose prompt occurs in train", path, len(examples) - len(kept)
        )
    return kept


def clamp_reward(value: float) -> float:
    """``value`` clipped to [0, 1]; NaN counts as no reward."""
    value = float(value)
    if value != value:
        return 0.0
    return min(1.0, max(0.0, value))


@functools.lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.random.default_rng([seed, epoch]).permutation(n))


def stream_index(seed: int, position: int, n: int) -> int:
    """Index of the example at ``position`` of an endless stream over ``n`` examples that
    is reshuffled every epoch: a pure function of (seed, position), so a stage that saves
    only its position resumes the same stream."""
    return _epoch_permutation(seed, position // n, n)[position % n]
