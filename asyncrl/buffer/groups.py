"""The group assembler: the buffer's part that turns prompts into groups of n samples and
finished samples into complete, scored groups.

It admits prompts from the task's prompt stream while the staleness gate allows
(skipping, with ``skip_uniform``, prompts whose recent groups had no reward spread),
queues each finished sample for scoring (``take_unscored``; rewards come back through
``on_reward``, from the buffer process's ``Scoring`` or any scorer with its ``pump``),
applies the dynamic-sampling filter to each complete group, and keeps the queue of
complete groups, oldest first, that the ``BatchServer`` takes batches from. Groups that
end without being consumed (failed, filtered, stale) are counted and free their place
under the gate for a replacement.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.staleness import StalenessGate
from asyncrl.buffer.state import BufferState, Group, Slot

log = logging.getLogger(__name__)

PromptSource = Callable[[int], tuple[int, list[int]]]
"""``prompts(position) -> (prompt_id, prompt token ids)``, deterministic in the position."""

MAX_SKIPS_IN_A_ROW = 10_000
"""``skip_uniform`` gives up skipping after this many prompts in a row (a stream of
nothing but uniform prompts would otherwise never admit one)."""


class ToScore(NamedTuple):
    """A finished sample waiting for its reward."""

    key: tuple[int, int]
    """(group id, sample index): what ``on_reward`` takes back."""
    prompt_id: int
    completion: list[int]
    """The generated token ids, exactly as generated."""
    finish_reason: str | None


class FilterWatch:
    """Warns, at most once a minute, when dynamic sampling drops most complete groups: a
    run where it does waits for many groups per step, which otherwise shows only as an
    idle trainer."""

    WINDOW = 100
    """Complete groups the share is measured over."""
    SHARE = 0.8
    """Dropped share of the window that warrants a warning."""
    EVERY_S = 60.0

    def __init__(self, prompts_per_batch: int) -> None:
        self.prompts_per_batch = prompts_per_batch
        self.recent: deque[bool] = deque(maxlen=self.WINDOW)
        self.dropped = 0
        """Dropped groups in ``recent``, kept as it slides (observed once per group)."""
        self.last_warning = -math.inf

    def observe(self, uniform: bool, counts: dict[str, int]) -> None:
        if len(self.recent) == self.WINDOW:
            self.dropped -= self.recent[0]  # leaves the window with this append
        self.recent.append(uniform)
        self.dropped += uniform
        dropped = self.dropped
        if len(self.recent) < self.WINDOW or dropped < self.SHARE * self.WINDOW:
            return
        now = time.monotonic()
        if now - self.last_warning < self.EVERY_S:
            return
        self.last_warning = now
        per_step = self.prompts_per_batch * self.WINDOW / max(1, self.WINDOW - dropped)
        log.warning(
            "dynamic sampling dropped %d of the last %d complete groups (all rewards equal; "
            "%d dropped in all): a step of %d groups needs about %.0f generated ones at this "
            "rate, and a step waiting past buffer.max_filtered_batches trains on uniform "
            "groups. The policy may have solved (or be unable to solve) this data: harder "
            "or easier prompts, buffer.skip_uniform, or buffer.dynamic_sampling=false",
            dropped,
            self.WINDOW,
            counts["groups_filtered"],
            self.prompts_per_batch,
            per_step,
        )


class GroupAssembler:
    def __init__(
        self,
        cfg: BufferConfig,
        run_id: str,
        prompts: PromptSource,
        gate: StalenessGate,
        state: BufferState,
    ) -> None:
        self.cfg, self.run_id, self.prompts, self.gate, self.state = (
            cfg,
            run_id,
            prompts,
            gate,
            state,
        )
        self._unscored: list[ToScore] = []
        self.filter_watch = FilterWatch(cfg.prompts_per_batch)

    def admit(self) -> bool:
        """Admit one prompt as a new group, its samples queued for leases, if the gate
        allows one more now."""
        st = self.state
        if self.gate.capacity(st.prompts_counted, st.version) <= 0:
            return False
        prompt_id, prompt_ids = st.retry_prompts.pop(0) if st.retry_prompts else self._next()
        slots = [Slot(i) for i in range(self.cfg.samples_per_prompt)]
        group = Group(st.next_group_id, prompt_id, list(prompt_ids), slots)
        st.groups[group.group_id] = group
        st.next_group_id += 1
        st.prompts_counted += 1
        st.counts["samples_created"] += len(slots)
        st.to_lease.extend((group.group_id, i) for i in range(len(slots)))
        return True

    def finished(self, group: Group, slot: Slot) -> None:
        """``slot`` has all its tokens: queue it for scoring; an ``error`` finish (the
        generator could not run the prompt) fails the whole group."""
        if slot.finish_reason == "error":
            self._end(group, "samples_failed")
            self.state.counts["groups_failed"] += 1
            return
        # Completion lengths of everything finished, to compare with what is trained on.
        self.state.counts["samples_finished"] += 1
        self.state.counts["completion_tokens_finished"] += len(slot.token_ids)
        key = (group.group_id, slot.index)
        if slot.env_reward is not None:  # an episode: its environment gave the reward
            self.on_reward(key, slot.env_reward)
            return
        self._unscored.append(
            ToScore(key, group.prompt_id, list(slot.token_ids), slot.finish_reason)
        )

    def take_unscored(self) -> list[ToScore]:
        """The finished samples queued for scoring since the last call (each once)."""
        taken, self._unscored = self._unscored, []
        return taken

    def rescore(self) -> None:
        """Queue every finished, unscored sample for scoring again: after a restart the
        rewards that were on their way to the dead process never arrive."""
        self._unscored = [
            ToScore((g.group_id, s.index), g.prompt_id, list(s.token_ids), s.finish_reason)
            for g in self.state.groups.values()
            for s in g.slots
            if s.finish_reason is not None and s.lease_id is None and s.reward is None
        ]

    def on_reward(self, key: tuple[int, int], reward: float) -> None:
        """The reward of a finished sample; completes its group once all are scored."""
        st = self.state
        group = st.groups.get(key[0])
        if group is None:
            return  # the group ended meanwhile (failed)
        if group.slots[key[1]].reward is not None:
            st.counts["rewards_duplicate"] += 1  # scored twice: the first one stands
            return
        if not math.isfinite(reward):  # a NaN reward would poison every advantage of the group
            reward = 0.0
            st.counts["reward_nonfinite"] += 1
        group.slots[key[1]].reward = reward
        st.counts["samples_scored"] += 1
        st.reward_sum += reward
        if any(s.reward is None for s in group.slots):
            return
        rewards = {s.reward for s in group.slots}
        if self.cfg.skip_uniform > 0:
            self._track_uniform(group.prompt_id, rewards)
        uniform = self.cfg.dynamic_sampling and len(rewards) == 1
        self.filter_watch.observe(uniform, st.counts)
        if uniform and self._filter_bound_reached():
            st.counts["groups_kept_uniform"] += 1
        elif uniform:
            self._end(group, "samples_filtered")
            st.counts["groups_filtered"] += 1
            st.filtered_since_batch += 1
            return
        st.ready.append(group.group_id)
        # What passed the filters, to tell a length bias of staleness handling (ready
        # against trained) from the filters' own (dynamic sampling drops the groups a
        # policy gets all wrong, the long ones more often).
        st.counts["samples_ready"] += len(group.slots)
        st.counts["completion_tokens_ready"] += sum(len(s.token_ids) for s in group.slots)

    def _filter_bound_reached(self) -> bool:
        """Whether dynamic sampling has dropped ``max_filtered_batches`` batches' worth of
        groups while the next step waits for a batch (see ``BufferConfig``)."""
        cap = self.cfg.max_filtered_batches * self.cfg.prompts_per_batch
        waiting = len(self.state.ready) < self.cfg.prompts_per_batch
        return cap > 0 and waiting and self.state.filtered_since_batch >= cap

    def drop_stale(self, group: Group) -> None:
        """End a complete group too stale to train on; its prompt goes first in line to
        be leased again."""
        self._end(group, "samples_stale")
        self.state.retry_prompts.append((group.prompt_id, group.prompt_ids))
        self.state.counts["groups_stale"] += 1

    def _end(self, group: Group, outcome: str) -> None:
        st = self.state
        st.counts[outcome] += len(group.slots)
        st.counts[outcome.replace("samples_", "completion_tokens_")] += sum(
            len(s.token_ids) for s in group.slots
        )
        st.prompts_counted -= 1  # its replacement is admitted under the same bound
        del st.groups[group.group_id]

    def _track_uniform(self, prompt_id: int, rewards: set[float]) -> None:
        floor = self.cfg.skip_uniform_min_reward
        streak = self.state.uniform_streak
        if len(rewards) == 1 and (floor is None or min(rewards) >= floor):
            streak[prompt_id] = streak.get(prompt_id, 0) + 1
        else:
            streak.pop(prompt_id, None)

    def _next(self) -> tuple[int, list[int]]:
        """The stream's next prompt that ``skip_uniform`` does not skip. The draw depends on
        the run and the stream position only, so a restored buffer skips the same ones."""
        st = self.state
        for _ in range(MAX_SKIPS_IN_A_ROW):
            position = st.prompt_position
            prompt_id, prompt_ids = self.prompts(position)
            st.prompt_position += 1
            streak = st.uniform_streak.get(prompt_id, 0)
            skip_p = 1.0 - (1.0 - self.cfg.skip_uniform) ** streak
            if not streak or random.Random(f"{self.run_id}:{position}").random() >= skip_p:
                return prompt_id, prompt_ids
            st.counts["prompts_skipped"] += 1
        return prompt_id, prompt_ids  # every prompt looks uniform: take one anyway
