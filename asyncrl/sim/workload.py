"""The workload half of calibration: what the task and the policy make the system do,
rather than what the hardware costs. Completion and prompt lengths come from the finished
samples in ``buffer_state.msgpack`` (tilted to the counters' mean completion, since the saved
state holds mostly groups that passed the filter), or else two-point histograms with the
counters' means; the dynamic-sampling filter probability is taken per bin of policy
versions from the buffer's logged counters, because it follows the policy's progress
(the same task filters ~0.50 of groups before version 100 and ~0.65 by version 300 in
every demo run), not the wall clock.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np

from asyncrl.sim.model import SimConfig, SimParams, mean_length

FILTER_BIN_VERSIONS = 25


def calibrate_workload(
    params: SimParams, cfg: SimConfig, run_dir: Path, records: list[dict], counters: dict
) -> None:
    scored = counters.get("buffer/samples_scored", 0.0)
    mean_completion = counters.get("buffer/tokens_received", 0.0) / scored if scored else None
    lengths, prompts = _finished_samples(run_dir)
    if sum(lengths.values()) >= 100:
        # The saved state holds mostly groups that passed the filter: keep its shape, but
        # give it the mean of every sample scored.
        params.completion_lengths = tilt_to_mean(
            dict(lengths), mean_completion or mean_length(lengths)
        )
        params.prompt_lengths = dict(prompts)
        params.notes.append(
            f"lengths: {sum(lengths.values())} finished samples in buffer_state "
            f"(mean {mean_length(lengths):.3f}), tilted to the counters' mean "
            f"{mean_length(params.completion_lengths):.3f}"
        )
    elif mean_completion:
        params.completion_lengths = two_point(mean_completion)
        trainer = [r for r in records if r["process"] == "trainer" and "train/tokens" in r]
        per_sample = np.mean([r["train/tokens"] for r in trainer]) / (
            cfg.prompts_per_batch * cfg.samples_per_prompt
        )
        params.prompt_lengths = two_point(max(1.0, per_sample - mean_completion))
        params.notes.append(
            f"lengths: two-point histograms with the counters' mean completion "
            f"{mean_completion:.3f} and prompt {per_sample - mean_completion:.2f}"
        )
    params.filter_schedule = filter_schedule(records) if cfg.dynamic_sampling else [(0, 0.0)]


def tilt_to_mean(histogram: dict[int, float], mean: float) -> dict[int, float]:
    """``histogram`` exponentially tilted (weights × e^(θ·k)) to have ``mean``, when its
    support allows; the closest end otherwise."""
    values = sorted(histogram)
    target = min(max(mean, values[0]), values[-1])

    def tilted(theta: float) -> dict[int, float]:
        top = max(theta * k for k in values)
        w = {k: histogram[k] * math.exp(theta * k - top) for k in values}
        total = sum(w.values())
        return {k: v / total for k, v in w.items()}

    lo, hi = -50.0, 50.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_length(tilted(mid)) < target else (lo, mid)
    return tilted((lo + hi) / 2)


def two_point(mean: float) -> dict[int, float]:
    """The histogram on ⌊mean⌋ and ⌈mean⌉ whose mean is ``mean``."""
    lo = max(1, math.floor(mean))
    frac = mean - lo
    return {lo: 1.0} if frac <= 0 else {lo: 1.0 - frac, lo + 1: frac}


def _finished_samples(run_dir: Path) -> tuple[Counter, Counter]:
    """Completion and prompt lengths of the finished samples in the saved buffer state."""
    path = run_dir / "buffer_state.msgpack"
    if not path.exists():
        return Counter(), Counter()
    import msgspec

    from asyncrl.buffer.state import BufferState, SavedState

    saved = msgspec.msgpack.decode(path.read_bytes(), type=SavedState)
    state = msgspec.msgpack.decode(saved.state, type=BufferState)
    lengths, prompts = Counter(), Counter()
    for group in state.groups.values():
        prompts[len(group.prompt_ids)] += 1
        for slot in group.slots:
            if slot.finish_reason and slot.finish_reason != "error":
                lengths[len(slot.token_ids)] += 1
    return lengths, prompts


def filter_schedule(
    records: list[dict], bin_versions: int = FILTER_BIN_VERSIONS
) -> list[tuple[int, float]]:
    """(version, filtered share of judged groups) per bin of the buffer's cumulative counters."""
    rows = [
        r
        for r in records
        if r["process"] in ("buffer", "colocated") and "buffer/groups_filtered" in r
    ]
    if not rows:
        return [(0, 0.0)]
    points, start = [], (0.0, 0.0, 0.0)
    for r in rows:
        version = r.get("buffer/version", 0.0)
        filtered = r["buffer/groups_filtered"]
        kept = r.get("buffer/groups_consumed", 0.0) + r.get("buffer/groups_stale", 0.0)
        if version - start[0] >= bin_versions or r is rows[-1]:
            judged = (filtered - start[1]) + (kept - start[2])
            if judged > 0:
                points.append((int((start[0] + version) / 2), (filtered - start[1]) / judged))
            start = (version, filtered, kept)
    return points or [(0, 0.0)]
