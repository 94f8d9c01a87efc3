"""Rewards for finished samples, and the buffer's counters as metrics: shared by the buffer
process (``asyncrl.buffer.server``) and the colocated placement, which drives the same
buffer state machine in the trainer process.

``Scoring`` takes the samples the buffer has finished and not yet scored
(``RolloutBuffer.take_unscored``) and hands each reward back (``on_reward``) once every
part it needs has arrived: the task's verifier in a ``RewardPool`` of worker processes, a
reward model batched in a thread (``RewardModelScorer``) or by reward servers of their own
(``RewardDispatch``), or both, weighted
(``RewardConfig.source``). A timeout or an exception in a reward gives 0 and is counted.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.reward_dispatch import RewardDispatch
from asyncrl.buffer.reward_model import RewardModelScorer, completion_text
from asyncrl.buffer.rewards import RewardPool
from asyncrl.engine.stops import text_until_stop
from asyncrl.models import load_tokenizer
from asyncrl.tasks import build_task
from asyncrl.tasks.prompts import PromptRenderer

Scorer = Callable[[int, list[int], str | None], float]
"""``score(prompt_id, completion token ids, finish reason) -> reward``."""
OnReward = Callable[[tuple[int, int], float], None]
"""Where a reward goes: ``on_reward((group id, sample index), reward)``."""


class Scoring:
    """Finished samples to rewards, from the source ``cfg.reward.source`` names: the task's
    verifier on the decoded completion, through a ``RewardPool`` (worker processes, or
    inline with ``workers=0``); a reward model on prompt + completion token ids, through a
    ``RewardModelScorer`` (a thread); or both, weighted. A sample's reward goes to the
    buffer once every part it needs has arrived; ``pump`` never waits for either."""

    def __init__(self, cfg: RolloutConfig) -> None:
        reward = cfg.reward
        reward.check()
        self.reward = reward
        # Kept for every source: callers read its counters and close it.
        self.pool = RewardPool(cfg.task, reward)
        self.split = cfg.task.rl_split
        self.sampling = cfg.sampling  # its stop strings and tokens cut the verifier's text
        self._tokenizer_path = cfg.model.path
        self._tokenizer = None  # loaded when first needed: pictures' rewards come with them
        self.reward_model: RewardModelScorer | RewardDispatch | None = None
        if reward.source != "verifier":
            if reward.model_servers:
                self.reward_model = RewardDispatch(cfg)  # scored by the run's reward servers
            else:
                self.reward_model = RewardModelScorer(
                    reward.model_path, reward.model_batch_size, reward.model_threads
                )
            self.task = build_task(cfg.task)  # the prompts, to render as the generators do
            self.renderer = PromptRenderer.for_task(cfg.task, self.tokenizer)
        self.prompt_ids: dict[int, list[int]] = {}
        """Tokenized prompts by example index, filled on first use."""
        # Samples submitted and not yet handed to the buffer, by an id of ours (buffer keys
        # go to the pool and the scorer through it, so a repeated key cannot mix parts up):
        # id -> (buffer key, {part: reward}).
        self._waiting: dict[int, tuple[tuple[int, int], dict[str, float]]] = {}
        self._next_id = 0
        self._parts = {
            "verifier": {"verifier"},
            "model": {"model"},
            "mixed": {"verifier", "model"},
        }[reward.source]

    @property
    def tokenizer(self):
        """The policy's tokenizer, which turns completions into the verifier's text."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_path)
        return self._tokenizer

    def text(self, completion: list[int]) -> str:
        """What the verifier reads: the decoded completion, cut at a stop string or stop
        token as ``SamplingConfig.keep_stop_text`` says (``asyncrl.engine.stops``)."""
        s = self.sampling
        return text_until_stop(
            lambda ids: completion_text(self.tokenizer, ids),
            completion,
            s.stop,
            s.stop_token_ids,
            s.keep_stop_text,
        )

    def prompt(self, prompt_id: int) -> list[int]:
        """The prompt's token ids as ``TaskPrompts`` gives them to the generators."""
        if prompt_id not in self.prompt_ids:
            example = self.task.examples(self.split)[prompt_id]
            self.prompt_ids[prompt_id] = self.renderer.prompt_ids(example)
        return self.prompt_ids[prompt_id]

    def pump(self, buffer: RolloutBuffer, on_reward: OnReward | None = None) -> None:
        """Submit the samples the buffer finished since the last call; hand arrived rewards
        to ``on_reward`` (default ``buffer.assembler.on_reward``; the buffer process passes
        its journal's, which logs them)."""
        on_reward = on_reward or buffer.assembler.on_reward
        for key, prompt_id, completion, _ in buffer.assembler.take_unscored():
            item = self._next_id
            self._next_id += 1
            self._waiting[item] = (key, {})
            if "verifier" in self._parts:
                self.pool.submit(item, self.split, prompt_id, self.text(completion))
            if self.reward_model is not None:
                # The completion exactly as generated: with its EOS when it ended with one.
                self.reward_model.submit(item, self.prompt(prompt_id) + list(completion))
        for item, reward in self.pool.poll():
            self._arrive(on_reward, item, "verifier", reward)
        if self.reward_model is not None:
            for item, reward in self.reward_model.poll():
                self._arrive(on_reward, item, "model", reward)

    def pending(self) -> int:
        """Samples submitted whose reward has not yet gone to the buffer."""
        return len(self._waiting)

    def counters(self) -> dict[str, float]:
        """The pool's counters as ``reward_*``, the reward model's as ``reward_model_*``
        (with reward servers also their queue, latency and count)."""
        out = {f"reward_{k}": v for k, v in self.pool.counters().items()}
        if self.reward_model is not None:
            out.update({f"reward_model_{k}": v for k, v in self.reward_model.counters().items()})
        return out

    def close(self) -> None:
        self.pool.close()
        if self.reward_model is not None:
            self.reward_model.close()

    def _arrive(self, on_reward: OnReward, item: int, part: str, reward: float) -> None:
        key, parts = self._waiting[item]
        parts[part] = reward
        if not self._parts <= parts.keys():
            return  # the other part is still on its way
        del self._waiting[item]
        if self.reward.source == "mixed":
            combined = (
                self.reward.verifier_weight * parts["verifier"]
                + self.reward.model_weight * parts["model"]
            )
        else:
            combined = parts[part]
        on_reward(key, combined)


def buffer_counters(buffer: RolloutBuffer, scoring: Scoring | InlineScoring) -> dict[str, float]:
    """The state machine's counters and gauges as ``buffer/*`` metrics (the buffer process
    logs them; so does the colocated placement, which drives the same state machine)."""
    st, versions = buffer.state, buffer.leases.worker_versions
    out = {f"buffer/{k}": float(v) for k, v in st.counts.items()}
    # Wasted work that should stay 0: logged from the start, so a run shows 0, not nothing.
    out.setdefault("buffer/tokens_revoked_alive", 0.0)
    out["buffer/in_flight_samples"] = float(buffer.in_flight())
    out["buffer/in_flight_tokens"] = float(buffer.in_flight_tokens())
    # Consumed for a step the trainer has not announced yet: trained unless the run ends
    # first (a time limit while a batch was on its way), and served again after a restart.
    ahead = (shares for step, shares in st.served.items() if step >= st.version)
    out["buffer/samples_served_untrained"] = float(sum(len(s) for shares in ahead for s in shares))
    out.update({f"buffer/staleness_{k}": float(v) for k, v in sorted(st.staleness.items())})
    out["buffer/ready_groups"] = float(len(st.ready))
    out["buffer/steps_waited_for_stragglers"] = float(buffer.batches.steps_waited)
    out["buffer/version"] = float(st.version)
    out["buffer/newest_consumed_version"] = float(st.newest_consumed_version)
    if versions:
        out["buffer/generator_version_max"] = float(max(versions.values()))
        out["buffer/generator_version_min"] = float(min(versions.values()))
    episodes = st.counts["episode_turns"] and st.counts["samples_finished"]
    for name in ("turns", "tool_calls", "tool_errors") if episodes else ():
        out[f"buffer/episode_{name}_mean"] = st.counts[f"episode_{name}"] / episodes
    if episodes:
        out["buffer/episode_env_ms_mean"] = st.counts["episode_env_us"] / episodes / 1000
    scored = st.counts["samples_scored"]
    out["buffer/reward_mean"] = st.reward_sum / scored if scored else 0.0
    out.update({f"buffer/{k}": float(v) for k, v in scoring.counters().items()})
    return out


class InlineScoring:
    """Scores in the caller's thread with a plain function, with ``Scoring``'s methods: for
    tests, tools and benchmarks that need no worker pool. A function that raises gives 0,
    counted as ``reward_errors``."""

    def __init__(self, score: Scorer) -> None:
        self.score = score
        self.errors = 0

    def pump(self, buffer: RolloutBuffer, on_reward: OnReward | None = None) -> None:
        """Score every sample the buffer finished since the last call, now."""
        on_reward = on_reward or buffer.assembler.on_reward
        for key, prompt_id, completion, finish_reason in buffer.assembler.take_unscored():
            try:
                reward = float(self.score(prompt_id, completion, finish_reason))
            except Exception:  # a reward function that raises gives 0 and is counted
                reward = 0.0
                self.errors += 1
            on_reward(key, reward)

    def pending(self) -> int:
        return 0  # nothing is ever on its way

    def counters(self) -> dict[str, int]:
        return {"reward_errors": self.errors}

    def close(self) -> None:
        pass
