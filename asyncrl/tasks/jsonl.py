"""JSONL data: a strict row loader and a file-backed ``Task``.

Each non-blank line is a JSON object of one of three kinds, told apart by its keys:
(prompt, answer) for scored problems, (prompt, completion[, answer]) for SFT, and
(prompt, chosen, rejected[, answer]) for reward models and DPO (the answer, when
present, is the reference the pair was graded against, as
``asyncrl.stages.preference_data`` writes it). Other keys are kept in
``Example.meta``. A bad row stops loading with a ``DataError`` naming the file and the
1-based line, so a broken dataset fails at the start of a run, not hours into it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import (
    DataError,
    Example,
    Split,
    TaskConfig,
    check_common,
    exact_match,
    held_out,
)

TEXT_KEYS = ("prompt", "answer", "completion", "chosen", "rejected")
# The row kinds, as the sets of TEXT_KEYS a row may carry.
ROW_KINDS = (
    frozenset({"prompt", "answer"}),
    frozenset({"prompt", "completion"}),
    frozenset({"prompt", "completion", "answer"}),
    frozenset({"prompt", "chosen", "rejected"}),
    frozenset({"prompt", "chosen", "rejected", "answer"}),
)
_KINDS_TEXT = (
    "(prompt, answer), (prompt, completion[, answer]) or (prompt, chosen, rejected[, answer])"
)


def load_jsonl(path: str | Path, split: Split = "train") -> list[Example]:
    """The rows of ``path`` as raw (untemplated) examples with uid f"{split}:{line}".
    Blank lines are skipped but counted; raises DataError on the first bad row."""
    examples = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason})") from None
            if line.strip():
                examples.append(_parse_row(line, where, f"{split}:{lineno}"))
    if not examples:
        raise DataError(f"{path}: no rows (the file is empty)")
    return examples


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _parse_row(line: str, where: str, uid: str) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {_json_type(row)}")
    if "prompt" not in row:
        raise DataError(f'{where}: missing key "prompt"')
    for key in TEXT_KEYS:
        if key in row and not isinstance(row[key], str):
            raise DataError(f'{where}: "{key}" must be a string, got {_json_type(row[key])}')
    if frozenset(row.keys() & set(TEXT_KEYS)) not in ROW_KINDS:
        keys = ", ".join(k for k in TEXT_KEYS if k in row)
        raise DataError(f"{where}: keys ({keys}) match no row kind; expected {_KINDS_TEXT}")
    return Example(
        uid=uid,
        prompt=row["prompt"],
        answer=row.get("answer"),
        completion=row.get("completion"),
        chosen=row.get("chosen"),
        rejected=row.get("rejected"),
        meta={k: v for k, v in row.items() if k not in TEXT_KEYS},
    )


class JsonlTask:
    """Examples from ``train_path`` / ``eval_path``, loaded on first use.

    The row's prompt fills {question} in ``prompt_template``; a row without a completion
    gets ``completion_template`` applied to its answer. Scoring is exact match: the answer
    extracted with ``answer_pattern`` equals the row's answer, both stripped.
    """

    def __init__(self, config: TaskConfig) -> None:
        check_common(config)
        if not config.train_path:
            raise ValueError('TaskConfig.train_path must be set when source is "jsonl"')
        self.config = config
        self._splits: dict[str, list[Example]] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # A reward worker rebuilds the task from its config; scoring never reads the files.
        return (type(self), (self.config,))

    @property
    def name(self) -> str:
        return f"jsonl/{Path(self.config.train_path or '').stem}"

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._splits:
            self._splits[split] = self._load(split)
        return self._splits[split]

    def score(self, example: Example, completion: str) -> float:
        return exact_match(example, completion, self.config.answer_pattern)

    def _load(self, split: Split) -> list[Example]:
        if split not in ("train", "eval"):
            # An RL prompt set of its own is a jsonl task with its own train_path.
            raise ValueError(f'split {split!r} is not "train" or "eval" (jsonl tasks)')
        path = self.config.train_path if split == "train" else self.config.eval_path
        if path is None:
            raise ValueError("the eval split needs TaskConfig.eval_path, which is not set")
        examples = [self._templated(e) for e in load_jsonl(path, split)]
        if split == "train":
            return examples
        return held_out(examples, self.examples("train"), path, self.config.train_path)

    def _templated(self, example: Example) -> Example:
        completion = example.completion
        if completion is None and example.answer is not None:
            completion = self.config.completion_template.format(answer=example.answer)
        prompt = self.config.prompt_template.format(question=example.prompt)
        return replace(example, prompt=prompt, completion=completion)
