"""Tasks: prompts with reference answers, and rewards for completions.

``build_task(TaskConfig(...))`` returns a ``Task`` backed by reasoning-gym (procedural,
verified) or JSONL files. SFT, evaluation and the buffer's reward workers use it; see
``asyncrl.tasks.base`` for the interface.
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
    """The task ``cfg`` describes, with its config checked."""
    # Imported here so that `import asyncrl.tasks` stays cheap: reasoning_gym takes ~2 s.
    if cfg.source == "reasoning_gym":
        from asyncrl.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(cfg)
    if cfg.source == "jsonl":
        from asyncrl.tasks.jsonl import JsonlTask

        return JsonlTask(cfg)
    raise ValueError(f'TaskConfig.source {cfg.source!r} is not "reasoning_gym" or "jsonl"')


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
