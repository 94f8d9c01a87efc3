"""Admission under the staleness bound, AReaL's Eq. 3 (docs/design.md, Versions and
staleness)."""

from __future__ import annotations


class StalenessGate:
    """Decides how many new prompts may be leased at the trainer's current version.

    With B prompts per batch and bound η (``max_staleness``), a new prompt may be leased
    only while ``floor(prompts_counted / B) ≤ version + η``, i.e. while

        prompts_counted < (version + η + 1) · B

    where ``prompts_counted`` counts prompts leased so far minus those whose group was
    dropped as stale or filtered out (their replacement is leased under the same rule).
    Consumed in lease order, a prompt leased at version v is then consumed by step
    v + η; whatever still ends up older (slow samples, reordering) is caught by
    ``is_stale`` at consumption. η = 0 is the synchronous baseline: one batch of prompts
    per version. ``max_staleness=None`` admits without bound.
    """

    def __init__(self, prompts_per_batch: int, max_staleness: int | None) -> None:
        if prompts_per_batch < 1:
            raise ValueError("prompts_per_batch must be at least 1")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 or None (unbounded)")
        self.prompts_per_batch = prompts_per_batch
        self.max_staleness = max_staleness

    def capacity(self, prompts_counted: int, version: int) -> int:
        """How many more prompts may be leased now."""
        if self.max_staleness is None:
            return 1 << 62
        return max(0, (version + self.max_staleness + 1) * self.prompts_per_batch - prompts_counted)

    def min_version(self, version: int) -> int:
        """The oldest weights a sample leased at ``version`` may start under: tokens from
        older ones would be too stale when trained (-1: no bound)."""
        return -1 if self.max_staleness is None else max(-1, version - self.max_staleness)

    def is_stale(self, consume_step: int, oldest_version: int) -> bool:
        """A trajectory whose oldest token is ``oldest_version`` is too old at this step."""
        return self.max_staleness is not None and consume_step - oldest_version > self.max_staleness
