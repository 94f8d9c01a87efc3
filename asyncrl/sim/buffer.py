"""The buffer's bookkeeping without tokens: ``RolloutBuffer``'s admission, groups, dynamic
sampling, staleness drops and accounting, on samples that are only lengths and versions.

Admission is the real ``StalenessGate`` (lease while ``prompts_counted < (version+η+1)·B``;
a filtered or stale group gives its count back and its prompt is re-leased first), the
stale check at consumption is the gate's ``is_stale`` on a group's oldest token, and the
staleness histogram counts each consumed sample at ``step − its oldest token's version``,
all as in ``asyncrl.buffer.core``. Left out: lease timeouts and re-issue, failures, and
scoring latency (a finished group is judged the moment its last sample arrives).
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import accumulate

from asyncrl.buffer.staleness import StalenessGate
from asyncrl.sim.model import SimConfig, SimParams, filter_probability, length_factor


class LengthSampler:
    """Draws integers from a histogram ``{value: weight}``, deterministically for an rng."""

    def __init__(self, histogram: dict[int, float], clip: int | None = None) -> None:
        items = sorted(histogram.items())
        self.values = [min(v, clip) if clip else v for v, _ in items]
        self.cumulative = list(accumulate(w for _, w in items))

    def __call__(self, rng: random.Random) -> int:
        return self.values[bisect_right(self.cumulative, rng.random() * self.cumulative[-1])]


@dataclass(eq=False)
class SimSample:
    group: SimGroup
    length: int
    """Completion tokens it will generate."""
    first_version: int = -1
    """Version of its first (hence oldest) token; -1 until generated."""
    min_version: int = -1
    """``Lease.min_version``: a generator with older weights holds it until newer are in."""


@dataclass(eq=False)
class SimGroup:
    group_id: int
    prompt_len: int
    samples: list[SimSample] = field(default_factory=list)
    finished: int = 0
    oldest_version: int = -1
    """Version of the group's oldest token, once all its samples finished."""

    def tokens(self) -> int:
        """Trained tokens: prompt plus completion of every sample."""
        return sum(self.prompt_len + s.length for s in self.samples)


class SimBuffer:
    def __init__(self, cfg: SimConfig, params: SimParams, rng: random.Random) -> None:
        self.cfg, self.params, self.rng = cfg, params, rng
        self.gate = StalenessGate(cfg.prompts_per_batch, cfg.max_staleness)
        self.lengths = LengthSampler(params.completion_lengths, clip=cfg.max_new_tokens)
        self.prompt_lengths = LengthSampler(params.prompt_lengths)
        self.version = 0
        self.prompts_counted = 0
        self.retry: deque[int] = deque()  # prompt lengths of dropped groups, re-leased first
        self.groups: dict[int, SimGroup] = {}
        self.next_group_id = 0
        self.to_lease: deque[SimSample] = deque()
        self.ready: deque[SimGroup] = deque()
        self._checked_step, self._checked = -1, 0  # ready[:_checked] are fresh at that step
        self.counts: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.leased_at_version: Counter[int] = Counter()  # prompts admitted, by version

    def lease(self, capacity: int) -> list[SimSample]:
        out = []
        while len(out) < capacity:
            if not self.to_lease and not self._admit():
                break
            out.append(self.to_lease.popleft())
        for sample in out:
            sample.min_version = self.gate.min_version(self.version)
        self.counts["leases_issued"] += len(out)
        return out

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def finish(self, sample: SimSample) -> None:
        """A sample's last token arrived; judge its group when it is the last one."""
        group = sample.group
        group.finished += 1
        self.counts["tokens_received"] += sample.length
        if group.finished < len(group.samples):
            return
        group.oldest_version = min(s.first_version for s in group.samples)
        p = filter_probability(self.params.filter_schedule, self.version)
        if self.cfg.dynamic_sampling and self.rng.random() < p:
            self._end(group, "filtered")
        else:
            self.ready.append(group)

    def take(self, step: int) -> list[SimGroup] | None:
        """Step ``step``'s B groups, after dropping (and re-queueing) stale ones; None while
        fewer than B are ready."""
        if step != self._checked_step:  # a group's staleness only changes with the step
            self._checked_step, self._checked = step, 0
        if self._checked < len(self.ready):
            fresh = deque(list(self.ready)[: self._checked])
            for group in list(self.ready)[self._checked :]:
                if self.gate.is_stale(step, group.oldest_version):
                    self._end(group, "stale")
                    self.retry.append(group.prompt_len)
                else:
                    fresh.append(group)
            self.ready, self._checked = fresh, len(fresh)
        if len(self.ready) < self.cfg.prompts_per_batch or self._straggler(step):
            return None
        # Oldest tokens first, as ``BatchServer`` takes them.
        ordered = sorted(self.ready, key=lambda g: (g.oldest_version, g.group_id))
        taken = ordered[: self.cfg.prompts_per_batch]
        self.ready = deque(ordered[self.cfg.prompts_per_batch :])
        self._checked = len(self.ready)
        for group in taken:
            del self.groups[group.group_id]
            for s in group.samples:
                self.staleness[step - s.first_version] += 1
        self.counts["samples_consumed"] += sum(len(g.samples) for g in taken)
        self.counts["groups_consumed"] += len(taken)
        return taken

    def _straggler(self, step: int) -> bool:
        """A group still generating that would be too stale for the next step holds this
        one (``stale_policy="wait"``), as in ``BatchServer``."""
        eta = self.gate.max_staleness
        if self.cfg.stale_policy != "wait" or eta is None:
            return False
        for group in self.groups.values():
            started = [s.first_version for s in group.samples if s.first_version >= 0]
            if group.finished < len(group.samples) and started and step - min(started) == eta:
                return True
        return False

    def in_flight(self) -> int:
        return sum(len(g.samples) for g in self.groups.values())

    def check_accounting(self) -> None:
        c = self.counts
        ended = c["samples_consumed"] + c["samples_filtered"] + c["samples_stale"]
        if c["samples_created"] != ended + self.in_flight():
            raise AssertionError(f"accounting broken: {dict(c)}, in flight {self.in_flight()}")

    def _admit(self) -> bool:
        if self.gate.capacity(self.prompts_counted, self.version) <= 0:
            return False
        prompt_len = self.retry.popleft() if self.retry else self.prompt_lengths(self.rng)
        group = SimGroup(self.next_group_id, prompt_len)
        factor = length_factor(self.params.length_schedule, self.version)
        group.samples = [
            SimSample(group, self._length(factor)) for _ in range(self.cfg.samples_per_prompt)
        ]
        self.groups[group.group_id] = group
        self.next_group_id += 1
        self.prompts_counted += 1
        self.leased_at_version[self.version] += 1
        self.counts["samples_created"] += len(group.samples)
        self.to_lease.extend(group.samples)
        return True

    def _length(self, factor: float) -> int:
        length = self.lengths(self.rng)
        if factor == 1.0:
            return length
        return max(1, min(self.cfg.max_new_tokens, round(length * factor)))

    def _end(self, group: SimGroup, outcome: str) -> None:
        self.counts[f"samples_{outcome}"] += len(group.samples)
        self.counts[f"groups_{outcome}"] += 1
        self.prompts_counted -= 1
        del self.groups[group.group_id]
