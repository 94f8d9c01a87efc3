"""Tasks: prompts with reference answers, and rewards for completions.

``build_task(TaskConfig(...))`` returns a ``Task`` backed by reasoning-gym (procedural,
verified), asyncrl's strict JSONL rows, or local dataset files in the common shapes
(``asyncrl.tasks.dataset``), scored by the source's own check or by weighted reward terms
(``asyncrl.tasks.rewards``). SFT, evaluation and the buffer's reward workers use it; see
``asyncrl.tasks.base`` for the interface, and ``asyncrl.tasks.prompts`` for how a prompt
becomes tokens.
"""

from __future__ import annotations

from asyncrl.tasks.base import (
    DataError,
    Example,
    Task,
    TaskConfig,
    extract_answer,
    stream_index,
)
from asyncrl.tasks.jsonl import load_jsonl


def build_task(cfg: TaskConfig) -> Task:
    """The task ``cfg`` describes, with its config checked; when ``cfg.rewards`` asks for
    more than the source's own check, wrapped so that its score is their weighted sum."""
    task = _source_task(cfg)
    if not cfg.rewards or cfg.rewards == {"task": 1.0}:
        return task  # the source's score as it is, not a sum of one term
    # Imported here, like the sources below: only a config with reward terms needs it.
    from asyncrl.tasks.rewards import WeightedRewards

    return WeightedRewards(task)


def _source_task(cfg: TaskConfig) -> Task:
    """The task of ``cfg.source``, scored by the source's own check."""
    # Imported here so that `import asyncrl.tasks` stays cheap: reasoning_gym takes ~2 s.
    if cfg.source == "reasoning_gym":
        from asyncrl.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(cfg)
    if cfg.source == "jsonl":
        from asyncrl.tasks.jsonl import JsonlTask

        return JsonlTask(cfg)
    if cfg.source == "dataset":
        from asyncrl.tasks.dataset import DatasetTask

        return DatasetTask(cfg)
    raise ValueError(
        f'TaskConfig.source {cfg.source!r} is not "reasoning_gym", "jsonl" or "dataset"'
    )


__all__ = [
    "DataError",
    "Example",
    "Task",
    "TaskConfig",
    "build_task",
    "extract_answer",
    "load_jsonl",
    "stream_index",
]
