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
    build_task,
    extract_answer,
    stream_index,
)
from asyncrl.tasks.jsonl import load_jsonl

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
