"""The RL prompt stream: the task's ``rl_split`` examples in a seeded order reshuffled
every epoch, each rendered as the generators are given it."""

from __future__ import annotations

from asyncrl.models import load_tokenizer
from asyncrl.tasks.base import Task, stream_index
from asyncrl.tasks.prompts import PromptRenderer


class TaskPrompts:
    """Prompt ``position`` of the stream (the task's ``rl_split`` examples, reshuffled every epoch),
    rendered (``PromptRenderer``); a pure function of (seed, position), so a restarted buffer resumes it."""

    def __init__(self, task: Task, tokenizer_path: str, seed: int) -> None:
        self.split = task.config.rl_split
        self.examples = task.examples(self.split)
        self.renderer = PromptRenderer.for_task(task.config, load_tokenizer(tokenizer_path))
        self.seed = seed

    def __call__(self, position: int) -> tuple[int, list[int]]:
        index = stream_index(self.seed, position, len(self.examples))
        return index, self.renderer.prompt_ids(self.examples[index])
