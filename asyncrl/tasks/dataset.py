"""Dataset files in the common shapes as a ``Task`` (``TaskConfig.source="dataset"``).

Loads local JSONL, JSON or Parquet files with the ``datasets`` library (offline; nothing
is fetched or cached under the home directory) and maps their columns onto asyncrl's
names through ``TaskConfig.fields``. The shapes, told apart per row by the columns it
fills:

- question/answer (GSM8K): the answer is a worked solution ending in ``#### 42``; the
  reference is "42" and the worked solution is the SFT target.
- problem/solution (MATH): the solution is the SFT target; with no answer column the
  reference is the content of its last ``\\boxed{}``.
- chat ``messages``: the final assistant turn is the SFT target and the turns before it
  become ``Example.messages`` (a ``system`` column goes first); ``Example.prompt`` is the
  last user turn, so plain rendering still has a prompt.
- prompt/chosen/rejected: preference pairs, each side a string or a conversation ending
  in an assistant turn.

``build_task`` returns a ``DatasetTask`` for source="dataset"; SFT, evaluation, RL and the
reward workers use it like the JSONL task. A bad row stops loading with a ``DataError``
naming the file, the 0-based row and the key.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
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

NAMES = ("prompt", "answer", "completion", "messages", "chosen", "rejected", "system")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
REFERENCE_MODES = ("auto", "raw", "gsm8k", "boxed")
ROLES = ("system", "user", "assistant", "tool")
Turns = tuple[dict[str, str], ...]


def builder_for(path: str) -> str:
    """The ``datasets`` builder that reads ``path``, chosen by its extension."""
    builder = BUILDERS.get(Path(path).suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported file type; expected one of {', '.join(BUILDERS)}")
    return builder


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of ``path`` as dicts, read with ``datasets.load_dataset`` from the local
    file only. Raises DataError for a missing, empty or unreadable file."""
    builder = builder_for(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: no rows (the file is empty)")
    # Before the first import: `datasets` reads these once, and a run must never wait on
    # (or depend on) the hub. HF_DATASETS_OFFLINE is the one that counts where
    # huggingface_hub (imported by transformers) has already read HF_HUB_OFFLINE.
    # `datasets` is imported here because it takes about a second.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        # A throwaway cache: the arrow copy load_dataset writes is not worth keeping for
        # files this size, and keep_in_memory lets the rows outlive the directory.
        with tempfile.TemporaryDirectory(prefix="asyncrl-datasets-") as cache:
            table = datasets.load_dataset(
                builder, data_files=path, split="train", cache_dir=cache, keep_in_memory=True
            )
            rows = table.to_list()
    except (datasets.exceptions.DatasetsError, ValueError, OSError, StopIteration) as e:
        cause = e.__cause__ or e
        raise DataError(f"{path}: cannot be read as {builder}: {cause}") from e
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def resolve_columns(fields: dict[str, str], columns: Sequence[str], path: str) -> dict[str, str]:
    """asyncrl name → column of ``path`` for every name the file provides: the mapped
    column, else the column of the same name. A mapped column the file lacks is an error."""
    resolved = {}
    for name in NAMES:
        column = fields.get(name, name)
        if column in columns:
            resolved[name] = column
        elif name in fields:
            raise DataError(
                f'{path}: TaskConfig.fields maps "{name}" to column "{column}", which the '
                f"file does not have; its columns: {', '.join(columns)}"
            )
    if not {"prompt", "messages", "chosen"} & resolved.keys():
        raise DataError(
            f'{path}: no prompt column: map "prompt" (or "messages") in TaskConfig.fields '
            f"to one of the file's columns: {', '.join(columns)}"
        )
    return resolved


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, nested braces included; None
    when there is none or its braces do not close."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
    return None


def read_reference(text: str, mode: str, whole_text_is_answer: bool) -> str | None:
    """The reference answer in ``text`` under ``TaskConfig.reference`` ``mode``; None when
    the mode finds none. "auto" falls back to the whole text only where the text is an
    answer column (``whole_text_is_answer``), not an SFT reply."""
    if mode in ("auto", "gsm8k") and "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    if mode in ("auto", "boxed"):
        boxed = last_boxed(text)
        if boxed:
            return boxed
    if mode == "raw" or (mode == "auto" and whole_text_is_answer):
        return text.strip() or None
    return None


class _Row:
    """One raw row with its location, for reading mapped values with located errors."""

    def __init__(self, row: dict[str, Any], columns: dict[str, str], where: str) -> None:
        self.row, self.columns, self.where = row, columns, where

    def fail(self, name: str, problem: str) -> DataError:
        column = self.columns.get(name, name)
        shown = f'"{name}"' if column == name else f'"{name}" (column "{column}")'
        return DataError(f"{self.where}, key {shown}: {problem}")

    def value(self, name: str) -> Any:
        """The mapped value; None where the file has no such column or the cell is null."""
        return self.row[self.columns[name]] if name in self.columns else None

    def text(self, name: str) -> str | None:
        value = self.value(name)
        if value is not None and not isinstance(value, str):
            raise self.fail(name, f"must be a string, got {type(value).__name__}")
        return value

    def turns(self, name: str) -> Turns:
        """A conversation: a non-empty list of {"role", "content"} with string values.
        Other keys of a turn (tool calls, names) are dropped."""
        value = self.value(name)
        if not isinstance(value, list) or not value:
            raise self.fail(name, f"must be a non-empty list of messages, got {value!r:.80}")
        turns = []
        for i, turn in enumerate(value):
            if not isinstance(turn, dict):
                raise self.fail(name, f"message {i} must be an object, got {turn!r:.80}")
            role, content = turn.get("role"), turn.get("content")
            if role not in ROLES:
                raise self.fail(name, f"message {i} has role {role!r}, not one of {ROLES}")
            if not isinstance(content, str):
                raise self.fail(name, f"message {i} has no string content, got {content!r:.80}")
            turns.append({"role": role, "content": content})
        return tuple(turns)

    def reply(self, name: str) -> tuple[str | None, Turns | None]:
        """A completion given as a string, or as a conversation: then its final assistant
        content and the turns before it. (None, None) where the row has none."""
        value = self.value(name)
        if value is None or isinstance(value, str):
            return self.text(name), None
        turns = self.turns(name)
        if turns[-1]["role"] != "assistant":
            raise self.fail(name, f"must end with an assistant message, not {turns[-1]['role']}")
        return turns[-1]["content"], turns[:-1]


def parse_row(raw: _Row, cfg: TaskConfig, uid: str) -> Example:
    """The row as a templated example; see the module docstring for the shapes. Columns
    no name maps to are kept in ``Example.meta``."""
    conversation, completion = _conversation(raw)
    chosen, chosen_turns = raw.reply("chosen")
    rejected, rejected_turns = raw.reply("rejected")
    if (chosen is None) != (rejected is None):
        present = "chosen" if chosen is not None else "rejected"
        raise raw.fail(present, "a preference pair needs both chosen and rejected")
    if (chosen_turns or ()) != (rejected_turns or ()):
        raise raw.fail("rejected", "its turns before the reply differ from chosen's")
    conversation = conversation or chosen_turns or None
    prompt = raw.text("prompt")
    if prompt is None and conversation:
        prompt = next((t["content"] for t in reversed(conversation) if t["role"] == "user"), None)
    if prompt is None or not prompt.strip():
        raise raw.fail("prompt", "missing or blank (and no user message to take it from)")
    prompt = cfg.prompt_template.format(question=prompt)
    # Where the completion came from, for naming it in an error.
    source = "completion" if raw.value("completion") is not None else "messages"
    answer_text, reference = _reference(raw, cfg.reference, completion, source)
    if completion is None and reference is not None:
        # An answer that is a worked solution (its reference read off a #### or a \boxed{})
        # already is an SFT target, and the working is what SFT should teach; only a bare
        # answer needs completion_template to become one.
        worked = answer_text is not None and answer_text.strip() != reference
        completion = answer_text if worked else cfg.completion_template.format(answer=reference)
    used = set(raw.columns.values())
    return Example(
        uid=uid,
        prompt=prompt,
        answer=reference,
        completion=completion,
        chosen=chosen,
        rejected=rejected,
        messages=_with_system(raw, conversation, prompt),
        meta={k: v for k, v in raw.row.items() if k not in used},
    )


def _conversation(raw: _Row) -> tuple[Turns | None, str | None]:
    """The turns before the completion and the completion, from the messages and
    completion columns: a conversation ending in an assistant turn brings its own."""
    completion = raw.text("completion")
    if raw.value("messages") is None:
        return None, completion
    turns = raw.turns("messages")
    if turns[-1]["role"] != "assistant":
        return turns, completion
    if completion is not None:
        raise raw.fail("completion", "the messages already end with an assistant reply")
    return turns[:-1] or None, turns[-1]["content"]


def _reference(
    raw: _Row, mode: str, completion: str | None, source: str
) -> tuple[str | None, str | None]:
    """(answer text, reference): from the answer column, else read off the completion,
    which came from the ``source`` key."""
    answer = raw.text("answer")
    name, text = ("answer", answer) if answer is not None else (source, completion)
    if text is None:
        return None, None
    reference = read_reference(text, mode, whole_text_is_answer=name == "answer")
    if reference is None and (mode != "auto" or name == "answer"):
        raise raw.fail(name, f'no reference answer under reference="{mode}" in {text!r:.80}')
    return answer, reference


def _with_system(raw: _Row, conversation: Turns | None, prompt: str) -> Turns | None:
    """The conversation with the row's system column put first; a row without a
    conversation gets one of the system turn and its (templated) prompt as the user."""
    system = raw.text("system")
    if system is None:
        return conversation
    if conversation and any(t["role"] == "system" for t in conversation):
        raise raw.fail("system", "the messages already have a system message")
    turns = conversation or ({"role": "user", "content": prompt},)
    return ({"role": "system", "content": system}, *turns)


class DatasetTask:
    """Examples from ``train_path`` / ``eval_path`` in the common shapes, loaded on first
    use; see the module docstring.

    The prompt fills {question} in ``prompt_template`` (a conversation's turns are kept as
    they are). A row's SFT target is its completion column or final assistant turn, else
    its answer column when that is a worked solution, else ``completion_template`` applied
    to its bare reference answer. Scoring is exact match of the answer extracted with
    ``answer_pattern`` against the reference.
    """

    def __init__(self, config: TaskConfig) -> None:
        check_common(config)
        if not config.train_path:
            raise ValueError('TaskConfig.train_path must be set when source is "dataset"')
        unknown = sorted(config.fields.keys() - set(NAMES))
        if unknown:
            raise DataError(
                f"TaskConfig.fields: unknown name(s) {unknown}; the keys are asyncrl's names "
                f"({', '.join(NAMES)}) and the values the file's columns, e.g. "
                '{"prompt": "question"}'
            )
        if config.reference not in REFERENCE_MODES:
            raise ValueError(
                f"TaskConfig.reference {config.reference!r} is not one of {REFERENCE_MODES}"
            )
        for path in (config.train_path, config.eval_path):
            if path is not None:
                builder_for(path)
        self.config = config
        self._splits: dict[str, list[Example]] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # A reward worker rebuilds the task from its config; scoring never reads the files.
        return (type(self), (self.config,))

    @property
    def name(self) -> str:
        return f"dataset/{Path(self.config.train_path or '').stem}"

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._splits:
            self._splits[split] = self._load(split)
        return self._splits[split]

    def score(self, example: Example, completion: str) -> float:
        why = (
            " (no answer column, and none could be read off its completion; see "
            "TaskConfig.reference)"
        )
        return exact_match(example, completion, self.config.answer_pattern, why)

    def load_file(self, path: str, split: Split) -> list[Example]:
        """The rows of ``path`` as templated examples with uid f"{split}:{row}"."""
        rows = read_rows(path)
        columns = resolve_columns(self.config.fields, list(rows[0]), path)
        return [
            parse_row(_Row(row, columns, f"{path}: row {i} (0-based)"), self.config, f"{split}:{i}")
            for i, row in enumerate(rows)
        ]

    def _load(self, split: Split) -> list[Example]:
        if split not in ("train", "eval"):
            raise ValueError(f'split {split!r} is not "train" or "eval" (dataset tasks)')
        path = self.config.train_path if split == "train" else self.config.eval_path
        if path is None:
            raise ValueError("the eval split needs TaskConfig.eval_path, which is not set")
        examples = self.load_file(path, split)
        if split == "train":
            return examples
        # A conversation is part of the prompt: rows that differ only there are distinct.
        train = self.examples("train")
        return held_out(examples, train, path, self.config.train_path, _prompt_key)


def _prompt_key(example: Example) -> tuple[str, str]:
    return example.prompt, json.dumps(example.messages or [])
