"""Sizes that fit, decided before any process of an RL run starts.

The engines hold a KV cache of ``max_seq_len`` tokens per slot. Left at 0 it used to be
the model's ``max_position_embeddings`` (131,072 for Llama-3.2: about 550 GB of fp32 cache
at 64 slots); here it becomes what the task needs, its longest rendered prompt plus
``sampling.max_new_tokens``. A prompt that cannot fit (with a limit set by hand, or the
model's own) is an error naming the example, its length, the limit and the key to change,
raised by the launcher's ``prepare`` before anything starts. The launchers call
``fit_context`` through ``RLExperiment.preflight``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.engine.config import EngineConfig
from asyncrl.models import load_tokenizer, model_config
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.tasks.prompts import PromptRenderer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSizes:
    """The rendered prompt lengths of a split, in tokens."""

    count: int
    longest: int
    longest_uid: str
    """Which example is the longest, for the error message."""


def prompt_sizes(task_cfg: TaskConfig, tokenizer_path: str, split: str) -> PromptSizes:
    """Render every prompt of ``split`` as the generators will and measure it."""
    task = build_task(task_cfg)
    renderer = PromptRenderer.for_task(task_cfg, load_tokenizer(tokenizer_path))
    examples = task.examples(split)
    longest, uid = 0, ""
    for example in examples:
        n = len(renderer.prompt_ids(example))
        if n > longest:
            longest, uid = n, example.uid
    return PromptSizes(len(examples), longest, uid)


def _limit_key(engine: EngineConfig) -> str:
    return f"engine.{engine.backend}.max_seq_len"


def fit_context(
    task: TaskConfig, model_path: str, engine_cfg: EngineConfig, max_new_tokens: int
) -> PromptSizes | None:
    """Set the selected engine's ``max_seq_len`` to what ``task``'s RL split needs (its
    longest prompt + ``max_new_tokens``, ``sampling.max_new_tokens``) when it is 0, and
    raise ``ConfigError`` when a prompt cannot fit. None (nothing checked) when the policy
    at ``model_path`` does not exist yet: the stage that makes it runs first."""
    if not (Path(model_path) / "config.json").is_file():
        return None
    sizes = prompt_sizes(task, model_path, task.rl_split)
    engine = getattr(engine_cfg, engine_cfg.backend)
    max_new, budget = max_new_tokens, "sampling.max_new_tokens"
    if task.environment:  # an episode's later turns see every earlier token
        max_new, budget = task.max_episode_tokens, "task.max_episode_tokens"
    need = sizes.longest + max_new
    positions = model_config(model_path).max_position_embeddings
    where = (
        f"the longest prompt ({sizes.longest_uid} of {sizes.count} in split "
        f"{task.rl_split!r}) is {sizes.longest} tokens"
    )
    if sizes.longest >= positions:
        raise ConfigError(
            f"{where}; the model at {model_path} supports {positions} positions "
            f"(max_position_embeddings): shorten or filter the prompts"
        )
    if engine.max_seq_len == 0:
        engine.max_seq_len = min(need, positions)
        if need > positions and task.environment:  # a later turn would not fit
            raise ConfigError(
                f"{where}; with {budget}={max_new} an episode needs {need} positions and the "
                f"model at {model_path} has {positions}: lower {budget}"
            )
        if need > positions:
            log.warning(
                "%s; with %s=%d completions are cut at the model's %d positions",
                where,
                budget,
                max_new,
                positions,
            )
    elif sizes.longest >= engine.max_seq_len or (task.environment and need > engine.max_seq_len):
        raise ConfigError(
            f"{where}, which does not fit {_limit_key(engine_cfg)}={engine.max_seq_len}: raise it "
            f"to at least {need} (prompt + {budget}), or set it to 0 to size it from the task"
        )
    elif need > engine.max_seq_len:
        log.warning(
            "%s: with %s=%d its completions are cut at %d tokens, below %s=%d",
            where,
            _limit_key(engine_cfg),
            engine.max_seq_len,
            engine.max_seq_len - sizes.longest,
            budget,
            max_new,
        )
    return sizes
