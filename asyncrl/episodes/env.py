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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.base import Example, TaskConfig

# Tools run here so that a timeout can give up waiting; a tool thread that never returns
# is left behind (Python cannot kill a thread), which is why tools should bound their own
# work, and this pool is shared and large enough that one stuck tool blocks no episode.
_TOOL_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="tool")


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
        future = _TOOL_POOL.submit(fn, *args)
        try:
            return str(future.result(timeout=timeout_s))
        except FutureTimeout:
            self.tool_errors += 1
            return f"error: timed out after {timeout_s:g} s"
        except Exception as e:
            self.tool_errors += 1
            return f"error: {type(e).__name__}: {e}"


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
    if task.max_turns < 1 or task.max_episode_tokens < 1:
        raise ValueError(
            f"task.max_turns={task.max_turns} and task.max_episode_tokens="
            f"{task.max_episode_tokens} must both be at least 1"
        )
