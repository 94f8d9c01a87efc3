"""Held-out evaluation of a multi-turn task: greedy episodes on the evaluation engine
(``asyncrl.evaluation``), every example's episode at once through continuous batching,
each turn answered by its environment in between engine steps. The figures are the
single-turn evaluation's (accuracy: reward 1; mean reward) plus what an agent run is
judged by: turns, tool calls and tool errors per episode, and environment time.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.episodes.env import load_environment
from asyncrl.episodes.episode import Episode, EpisodeRules
from asyncrl.interfaces import Engine
from asyncrl.tasks import Example, Task


def episode_accuracy(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    turn_tokens: int,
    *,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    keep_stop_text: bool = False,
) -> dict[str, float]:
    """Greedy episodes of ``examples`` under the weights ``engine`` holds now: the share
    that earned full reward, the mean reward, and per-episode means of turns, model
    tokens, tool calls, tool errors and environment milliseconds."""
    cfg = task.config
    rules = EpisodeRules.for_task(cfg, tokenizer, turn_tokens, stop, stop_token_ids, keep_stop_text)
    env_cls = load_environment(cfg.environment)
    episodes = {
        f"eval-{i}": Episode(env_cls(ex), rules.renderer.prompt_ids(ex), rules)
        for i, ex in enumerate(examples)
    }
    params = dict(temperature=0.0, stop=list(rules.stop), stop_token_ids=list(rules.stop_token_ids))
    turns: dict[str, list[int]] = {}

    def submit(request_id: str) -> None:
        episode = episodes[request_id]
        turns[request_id] = []
        budget = SamplingParams(max_new_tokens=episode.budget(), **params)
        engine.submit(Request(request_id, episode.context(), budget))

    for request_id in episodes:
        submit(request_id)
    while turns:
        out = engine.step()
        for t in out.tokens:
            turns[t.request_id].append(t.token_id)
        for f in out.finished:
            episode, ids = episodes[f.request_id], turns.pop(f.request_id)
            episode.add_turn(ids, [0.0] * len(ids), [0] * len(ids))
            episode.respond()
            if episode.finish_reason is None:
                submit(f.request_id)
            else:
                episode.env.close()
    return _figures(list(episodes.values()))


def _figures(episodes: list[Episode]) -> dict[str, float]:
    n = max(len(episodes), 1)
    figures = [e.figures() for e in episodes]

    def mean(values) -> float:
        return sum(values) / n

    return {
        "eval/accuracy": mean(e.reward >= 1.0 - 1e-6 for e in episodes),
        "eval/reward": mean(e.reward for e in episodes),
        "eval/completion_tokens": mean(sum(e.loss_mask) for e in episodes),
        "eval/truncated_frac": mean(e.finish_reason == "length" for e in episodes),
        "eval/turns": mean(f.turns for f in figures),
        "eval/tool_calls": mean(f.tool_calls for f in figures),
        "eval/tool_errors": mean(f.tool_errors for f in figures),
        "eval/env_ms": mean(f.env_us for f in figures) / 1000,
    }
