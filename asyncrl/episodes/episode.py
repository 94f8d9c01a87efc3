"""One episode as token ids: the prompt, then model turns (trained: each token with its
behavior logprob and version, loss mask 1) and the environment's observations (context
only: logprob 0, version −1, loss mask 0), in one sequence.

A turn's tokens are kept exactly as the engine sampled them; the environment sees their
text (cut at the stop string), and its observation is rendered onto token ids after them
(``PromptRenderer.observation_ids``). The next turn's prompt is the prompt plus every token
so far, so nothing the model produced is ever re-tokenized: the trainer scores the tokens
the policy sampled. ``Episode.replay`` rebuilds an episode from a recorded prefix (a lease
re-issued after its generator died): a fresh environment is given the recorded turns,
and the recorded observations stand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from asyncrl.engine.stops import text_until_stop
from asyncrl.episodes.env import Environment, Step
from asyncrl.tasks.base import TaskConfig
from asyncrl.tasks.prompts import PromptRenderer
from asyncrl.wire import EpisodeFigures

log = logging.getLogger(__name__)


@dataclass
class EpisodeRules:
    """What bounds and shapes every episode of a run (from the task and sampling configs)."""

    renderer: PromptRenderer
    max_turns: int
    """Model turns at most (``task.max_turns``)."""
    max_tokens: int
    """Tokens after the prompt at most (``task.max_episode_tokens``)."""
    turn_tokens: int
    """Tokens per model turn at most (``sampling.max_new_tokens``)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings ending a turn (``sampling.stop``): the environment's text is cut at them."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop token ids ending a turn besides EOS (``sampling.stop_token_ids``)."""
    keep_stop_text: bool = False
    """Whether the environment's text keeps the stop string (``sampling.keep_stop_text``)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the shared tokenizer runs: environments answer in several threads, and a
    fast tokenizer used from two at once can fail ("Already borrowed")."""

    @classmethod
    def for_task(
        cls,
        task: TaskConfig,
        tokenizer: PreTrainedTokenizerBase,
        turn_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        keep_stop_text: bool = False,
    ) -> EpisodeRules:
        """The rules of ``task``'s episodes, each turn sampled up to ``turn_tokens`` tokens
        and ended at these stops."""
        return cls(
            PromptRenderer.for_task(task, tokenizer),
            max_turns=task.max_turns,
            max_tokens=task.max_episode_tokens,
            turn_tokens=turn_tokens,
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            keep_stop_text=keep_stop_text,
        )

    def turn_text(self, ids: list[int]) -> str:
        """The text of a model turn as the environment sees it: cut at its stop."""

        def decode(part: list[int]) -> str:
            return self.renderer.tokenizer.decode(part, skip_special_tokens=True)

        with self.lock:
            return text_until_stop(decode, ids, self.stop, self.stop_token_ids, self.keep_stop_text)

    def observation_ids(self, messages: list[dict[str, str]], turn_end: int | None) -> list[int]:
        with self.lock:
            return self.renderer.observation_ids(messages, turn_end)


class Episode:
    """An environment and the token ids of its episode so far (after the prompt); the
    three per-token lists and ``loss_mask`` line up."""

    def __init__(self, env: Environment, prompt_ids: list[int], rules: EpisodeRules) -> None:
        self.env, self.prompt_ids, self.rules = env, prompt_ids, rules
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.loss_mask: list[int] = []
        self.turns = 0
        self.env_s = 0.0
        self.reward = 0.0
        self.finish_reason: str | None = None
        """Set when the episode ends: "stop" (the environment ended it) or "length"."""
        self.replay_mismatches = 0

    # ---- the model's side ------------------------------------------------------------
    def budget(self) -> int:
        """Tokens the next model turn may take (0: the episode is out of tokens)."""
        return max(0, min(self.rules.turn_tokens, self.rules.max_tokens - len(self.token_ids)))

    def context(self) -> list[int]:
        """The next turn's prompt: the episode's prompt and every token so far."""
        return self.prompt_ids + self.token_ids

    def add_turn(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"a turn of {len(ids)} tokens with {len(logprobs)} logprobs and {len(versions)} versions"
            )
        self._extend(ids, logprobs, versions, 1)
        self.turns += 1

    # ---- the environment's side -------------------------------------------------------
    def respond(self) -> tuple[int, int]:
        """Give the last model turn to the environment: either the episode ends (sets
        ``finish_reason`` and ``reward``) or the observation is appended. Returns the span
        ``(start, end)`` of ``token_ids`` appended (empty when it ended)."""
        turn = self._last_turn()
        step = self._step(turn)
        start = len(self.token_ids)
        if _ends(step):
            self.reward, self.finish_reason = float(step.reward), "stop"
            return start, start
        if self.turns >= self.rules.max_turns:  # no turn follows: the observation would be idle
            self.finish_reason = "length"  # cut: the environment gave no reward
            return start, start
        observed = self._observation_ids(step.observation, turn)[: self.rules.max_tokens - start]
        self._extend(observed, [0.0] * len(observed), [-1] * len(observed), 0)
        if self.budget() == 0:
            self.finish_reason = "length"
        return start, len(self.token_ids)

    def replay(
        self, ids: list[int], logprobs: list[float], versions: list[int], mask: list[int]
    ) -> bool:
        """Rebuild from a recorded prefix (whole turns, as an episode's chunks carry them):
        every recorded model turn goes to the fresh environment, and the recorded
        observations stand (one the environment now answers differently is counted in
        ``replay_mismatches``: a non-replayable environment). Returns whether the last
        turn still awaits its answer (its observation never reached the buffer)."""
        mask = mask or [1] * len(ids)
        runs = _runs(mask)
        for k, (lo, hi, trained) in enumerate(runs):
            self._extend(ids[lo:hi], logprobs[lo:hi], versions[lo:hi], trained)
            if not trained:
                continue
            self.turns += 1
            if k + 1 == len(runs):
                return True  # the observation is computed anew by ``respond``
            step = self._step(ids[lo:hi])
            nlo, nhi, _ = runs[k + 1]
            answered = [] if _ends(step) else self._observation_ids(step.observation, ids[lo:hi])
            if answered != ids[nlo:nhi]:
                self.replay_mismatches += 1
        return False

    def figures(self) -> EpisodeFigures:
        """What the buffer's metrics count per finished episode."""
        return EpisodeFigures(
            turns=self.turns,
            tool_calls=int(self.env.tool_calls),
            tool_errors=int(self.env.tool_errors),
            env_us=round(self.env_s * 1e6),
            replay_mismatches=self.replay_mismatches,
        )

    # ---- internals -------------------------------------------------------------------
    def _step(self, turn: list[int]) -> Step:
        start = time.perf_counter()
        try:
            step = self.env.step(self.rules.turn_text(turn))
        except Exception as e:  # an environment bug ends its episode, never the generator
            log.warning("environment %s failed: %s: %s", type(self.env).__name__, type(e), e)
            self.env.tool_errors += 1
            step = Step(done=True, reward=0.0)
        self.env_s += time.perf_counter() - start
        return step

    def _observation_ids(self, observation, turn: list[int]) -> list[int]:
        if isinstance(observation, str):
            observation = [{"role": self.env.role, "content": observation}]
        elif observation and isinstance(observation[0], int):
            return list(observation)
        return self.rules.observation_ids(list(observation), turn[-1] if turn else None)

    def _last_turn(self) -> list[int]:
        end = len(self.loss_mask)
        start = end
        while start > 0 and self.loss_mask[start - 1]:
            start -= 1
        return self.token_ids[start:end]

    def _extend(self, ids: list[int], logprobs: list[float], versions: list[int], m: int) -> None:
        self.token_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [m] * len(ids)


def _ends(step: Step) -> bool:
    """Whether ``step`` ends its episode: done, or nothing for the model to go on from."""
    return step.done or not step.observation


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values, as (start, end, value)."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs
