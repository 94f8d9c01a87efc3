"""Rewards for finished samples, and the buffer's counters as metrics: shared by the buffer
process (``asyncrl.buffer.server``) and the colocated placement, which drives the same
buffer state machine in the trainer process.

``Scoring`` takes the samples the buffer has finished and not yet scored
(``RolloutBuffer.take_unscored``) and hands each reward back (``on_reward``) once every
part it needs has arrived: the task's verifier in a ``RewardPool`` of worker processes, a
reward model batched in a thread (``RewardModelScorer``), or both, weighted
(``RewardConfig.source``). A timeout or an exception in a reward gives 0 and is counted.
"""

from __future__ import annotations

from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.reward_model import RewardModelScorer, completion_text
from asyncrl.buffer.rewards import RewardPool
from asyncrl.models import load_tokenizer
from asyncrl.rollout import RolloutConfig
from asyncrl.tasks import build_task


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
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.reward_model: RewardModelScorer | None = None
        if reward.source != "verifier":
            self.reward_model = RewardModelScorer(
                reward.model_path, reward.model_batch_size, reward.model_threads
            )
            self.task = build_task(cfg.task)  # the prompts, to tokenize as the generators do
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

    def text(self, completion: list[int]) -> str:
        return completion_text(self.tokenizer, completion)

    def prompt(self, prompt_id: int) -> list[int]:
        """The prompt's token ids as ``TaskPrompts`` gives them to the generators."""
        if prompt_id not in self.prompt_ids:
            prompt = self.task.examples(self.split)[prompt_id].prompt
            self.prompt_ids[prompt_id] = self.tokenizer(prompt, add_special_tokens=False)[
                "input_ids"
            ]
        return self.prompt_ids[prompt_id]

    def pump(self, buffer: RolloutBuffer, on_reward=None) -> None:
        """Submit the buffer's unscored samples; hand arrived rewards to ``on_reward``
        (default ``buffer.on_reward``; the buffer process passes its journal's)."""
        on_reward = on_reward or buffer.on_reward
        for key, prompt_id, completion in buffer.unscored:
            item = self._next_id
            self._next_id += 1
            self._waiting[item] = (key, {})
            if "verifier" in self._parts:
                self.pool.submit(item, self.split, prompt_id, self.text(completion))
            if self.reward_model is not None:
                # The completion exactly as generated: with its EOS when it ended with one.
                self.reward_model.submit(item, self.prompt(prompt_id) + list(completion))
        buffer.unscored.clear()
        for item, reward in self.pool.poll():
            self._arrive(on_reward, item, "verifier", reward)
        if self.reward_model is not None:
            for item, reward in self.reward_model.poll():
                self._arrive(on_reward, item, "model", reward)

    def pending(self) -> int:
        """Samples submitted whose reward has not yet gone to the buffer."""
        return len(self._waiting)

    def close(self) -> None:
        self.pool.close()
        if self.reward_model is not None:
            self.reward_model.close()

    def _arrive(self, on_reward, item: int, part: str, reward: float) -> None:
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


def buffer_counters(buffer: RolloutBuffer, scoring: Scoring | None) -> dict[str, float]:
    """The state machine's counters and gauges as ``buffer/*`` metrics (the buffer process
    logs them; so does the colocated placement, which drives the same state machine)."""
    out = {f"buffer/{k}": float(v) for k, v in buffer.counts.items()}
    out["buffer/in_flight_samples"] = float(buffer.in_flight())
    out["buffer/in_flight_tokens"] = float(buffer.in_flight_tokens())
    out.update({f"buffer/staleness_{k}": float(v) for k, v in sorted(buffer.staleness.items())})
    out["buffer/ready_groups"] = float(len(buffer.ready))
    out["buffer/version"] = float(buffer.version)
    out["buffer/newest_consumed_version"] = float(buffer.newest_consumed_version)
    if buffer.worker_versions:
        out["buffer/generator_version_max"] = float(max(buffer.worker_versions.values()))
        out["buffer/generator_version_min"] = float(min(buffer.worker_versions.values()))
    scored = buffer.counts["samples_scored"]
    out["buffer/reward_mean"] = buffer.reward_sum / scored if scored else 0.0
    if scoring is not None:
        out.update({f"buffer/reward_{k}": float(v) for k, v in scoring.pool.counters().items()})
        if scoring.reward_model is not None:
            counts = scoring.reward_model.counters()
            out.update({f"buffer/reward_model_{k}": float(v) for k, v in counts.items()})
    return out
