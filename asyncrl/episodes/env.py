"""The interface a multi-turn task implements: an ``Environment`` built from one task
example, that answers each model turn with a ``Step`` (an observation, a reward, done).

An environment must be *replayable*: built again from the same example and given the
same model turns, it returns the same observations. A generator that dies mid-episode
loses nothing because of it: the next holder rebuilds the environment from the example
and the recorded turns (``asyncrl.episodes.episode``) and continues from the last
complete turn. Randomness therefore comes from the example (its uid, its fields), never
from the clock or a global generator.

Tools run through ``Environment.tool``: under a timeout, and a tool that raises or
times out becomes an observation (``"error: ..."``) and a counted tool error, never a
crashed episode.
"""

from __future__ import annotations

import importlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.base import Example, TaskConfig


@dataclass
class Step:
    """What the environment returns for one model turn."""

    observation: str | list[int] | list[dict[str, str]] = ""
    """What the model sees next: text (rendered as a ``role`` turn with a chat template,
    or tokenized as it is with a plain prompt), chat messages ({"role", "content"},
    rendered with the chat template), or token ids appended exactly. Always appended to
    the episode's token ids: the model's turns are never re-tokenized. Ignored when
    ``done``."""
    reward: float = 0.0
    """The episode's reward; read when ``done``."""
    done: bool = False
    """Whether the episode ends with this turn. A turn that is not done must give a
    non-empty observation (the model would otherwise be asked to continue its own
    turn); an empty one ends the episode."""


class Environment:
    """A multi-turn task: subclass it, implement ``step`` (and ``__init__`` when the
    environment needs state), and name the class in ``task.environment``
    ("module:Class"). The first prompt is the task example's prompt, rendered as every
    prompt is (``asyncrl.tasks.prompts``).

    Replayable: ``__init__`` may only read the example, and ``step`` may only depend on
    the turns given so far (see the module docstring)."""

    role: str = "user"
    """The chat role observations are rendered as (prompt_format="chat"); "tool" where
    the template has one."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Counted by ``tool`` (and by the episode, for a ``step`` that raised)."""

    def __init__(self, example: Example) -> None:
        self.example = example
        self.tool_calls = 0
        self.tool_errors = 0

    def step(self, turn: str) -> Step:
        """The answer to the model's turn ``turn`` (its text, cut at the stop string)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds (called once the episode ends)."""

    def tool(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 5.0) -> str:
        """``str(fn(*args))``, or ``"error: ..."`` when it raises or runs past
        ``timeout_s``; counted in ``tool_calls`` and ``tool_errors``."""
        self.tool_calls += 1
        # A thread of its own, so that the timeout counts the tool's time only and a tool
        # that never returns blocks nothing else; it is left behind (Python cannot kill a
        # thread), which is why a tool should bound its own work.
        result: queue.Queue = queue.Queue(maxsize=1)

        def call() -> None:
            try:
                result.put((True, fn(*args)))
            except Exception as e:
                result.put((False, e))

        threading.Thread(target=call, name="tool", daemon=True).start()
        try:
            ok, value = result.get(timeout=timeout_s)
        except queue.Empty:
            self.tool_errors += 1
            return f"error: timed out after {timeout_s:g} s"
        if not ok:
            self.tool_errors += 1
            return f"error: {type(value).__name__}: {value}"
        return str(value)


def load_environment(path: str) -> type[Environment]:
    """The class named by "module:Class", checked to be an ``Environment``."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f'task.environment {path!r} is not "module:Class"')
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.environment {path!r} cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"task.environment {path!r} is not an asyncrl Environment subclass")
    return cls


def check_environment(task: TaskConfig) -> None:
    """Fail now (``ValueError``) on a multi-turn task config that cannot run: a class that
    does not import, reward terms beside the environment's reward, no turns or tokens."""
    if not task.environment:
        return
    load_environment(task.environment)
    if task.rewards and task.rewards != {"task": 1.0}:
        raise ValueError(
            f"task.rewards={task.rewards} and task.environment={task.environment!r}: an "
            f"episode's reward is its environment's; fold other terms into its Step.reward"
        )
    if min(task.max_turns, task.max_episode_tokens, task.env_threads) < 1:
        raise ValueError(
            f"task.max_turns={task.max_turns}, task.max_episode_tokens="
            f"{task.max_episode_tokens} and task.env_threads={task.env_threads} must all be "
            f"at least 1"
        )
