"""The books of a chaos run (``tools/chaos.py``), read from its run directory.

``MetricsTail`` follows ``metrics.jsonl`` while the run goes on, stamping each record
with when it was seen; after the launcher has exited, the other functions turn the
launcher's log, the trainer ledgers (``ledger/rank*.jsonl``), ``buffer_counters.json``
and those records into the figures ``chaos.py`` checks: restarts per role, the final
lineage, the buffer's accounting identity, held-out accuracy against time, and how long
the trainer took to pass the step it was at when each kill landed.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

GRACE_S = 60.0
"""After the time limit, for the final step and evaluation to land."""


class MetricsTail:
    """``metrics.jsonl`` read as it grows; each record stamped with when it was first seen."""

    def __init__(self, run_dir: Path) -> None:
        self.path, self.offset, self.records = run_dir / "metrics.jsonl", 0, []

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                self.records.append({**json.loads(line), "seen": time.time()})
            except json.JSONDecodeError:
                continue  # a line torn by a SIGKILL

    def trainer(self, key: str = "") -> list[dict]:
        """The trainer's records (those holding ``key``, when given)."""
        return [r for r in self.records if r["process"] == "trainer" and (not key or key in r)]

    def step(self) -> int:
        return max((r["step"] for r in self.trainer("train/loss")), default=0)


def role_of(name: str) -> str:
    return name.rsplit("_", 1)[0] if name[-1].isdigit() else name


def launcher_restarts(log: str) -> Counter:
    """Restarts the launcher logged, by role of the process that died."""
    died = re.findall(r"\[launch\] (\S+) exited with code -?\d+; restart", log)
    return Counter(role_of(name) for name in died)


def lineage(run_dir: Path, steps: int) -> dict[str, Any]:
    """The final lineage: the last ledger line of each (rank, step) below ``steps``."""
    final: dict[tuple[int, int], list] = {}
    for path in sorted((run_dir / "ledger").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn by a SIGKILL: that step was redone
            final[(rank, entry["step"])] = entry["samples"]
    kept = {k: v for k, v in final.items() if k[1] < steps}
    keys = Counter(tuple(s) for samples in kept.values() for s in samples)
    present = {step for _, step in kept}
    return {
        "lineage_samples": sum(keys.values()),
        "lineage_distinct": len(keys),
        "duplicated": sum(1 for c in keys.values() if c > 1),
        "missing_steps": [s for s in range(steps) if s not in present],
        "ledger_steps_beyond_final": len(final) - len(kept),
    }


def accuracy(tail: MetricsTail, summary: dict, target: float, limit_s: float) -> dict[str, Any]:
    """Held-out accuracy; times on the first trainer's clock, as seen here (a restarted
    trainer keeps that clock and its time limit). The target counts as reached only by
    ``limit_s + GRACE_S``: the final evaluation comes after the limit."""
    evals, first = tail.trainer("eval/accuracy"), tail.trainer()
    anchor = first[0]["seen"] - first[0]["time"] if first else 0.0
    reached = next((r for r in evals if r["eval/accuracy"] >= target - 1e-9), None)
    seconds = round(reached["seen"] - anchor, 1) if reached else None
    final = summary.get("final_eval_accuracy")
    return {
        "accuracy_initial": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_final": final
        if final is not None
        else (evals[-1]["eval/accuracy"] if evals else None),
        "accuracy_peak": max((r["eval/accuracy"] for r in evals), default=None),
        "trainer_wall_s": round(first[-1]["seen"] - anchor, 1) if first else None,
        "seconds_to_target": seconds,
        "target_reached": seconds is not None and seconds <= limit_s + GRACE_S,
    }


def recovery(kills: list[dict], tail: MetricsTail, t0: float) -> None:
    """Per kill, seconds until the trainer first logged a step past the one it was at."""
    steps = [(r["seen"] - t0, r["step"]) for r in tail.trainer("train/loss")]
    for k in (k for k in kills if "pid" in k):
        after = [t for t, step in steps if t > k["time_s"] and step > k["step"]]
        k["recovered_after_s"] = round(after[0] - k["time_s"], 1) if after else None


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def books(counters: dict, lineage_figures: dict) -> dict[str, Any]:
    """The buffer's counters, its accounting identity, and the lineage against them."""
    c = {
        k: int(counters.get(f"buffer/{k}", 0))
        for k in (
            "samples_created",
            "samples_consumed",
            "samples_stale",
            "samples_filtered",
            "samples_failed",
            "in_flight_samples",
            "batches_served_again",
            "steps_not_replayable",
            "leases_reissued",
            "leases_continued",
            "tokens_revoked_alive",
            "episodes_continued",
            "episode_replay_mismatches",
            "samples_served_untrained",
        )
    }
    ended = sum(c[f"samples_{k}"] for k in ("consumed", "stale", "filtered", "failed"))
    # Samples served for a step the run ended before training are not lost: the buffer
    # still holds them for that step.
    consumed = c["samples_consumed"] - c["samples_served_untrained"]
    trained = lineage_figures["lineage_distinct"]
    return {
        **c,
        "accounting_holds": bool(counters)
        and c["samples_created"] == ended + c["in_flight_samples"],
        **lineage_figures,
        "lost": max(0, consumed - trained),
        "trained_not_consumed": max(0, trained - consumed),
    }
