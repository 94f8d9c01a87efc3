"""What the simulator takes: a system configuration (``SimConfig``: what a run's
``config.json`` sets) and the costs and workload that calibration measures
(``SimParams``), plus the two small formulas they share (thread speed-up, filter schedule).

Costs are **per process at one thread, without contention**: a measured time is divided
by the contention it ran under and multiplied by the thread speed-up it had, so that the
same parameters predict another thread layout. Thread speed-up is Amdahl's law with a
parallel fraction per kind of work; CPU contention is proportional sharing of the
machine's cores among the threads of the processes that are busy at that moment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class SimConfig:
    """The system being simulated; ``config_from_run`` reads one from a run directory."""

    placement: Literal["async", "colocated"] = "async"
    """``async``: generator processes and a trainer; ``colocated``: one process alternating."""
    num_generators: int = 1
    """Generator processes (async placement)."""
    engine_slots: int = 64
    """Continuous-batching slots per generator (``engine.embedded.max_slots``)."""
    engine_replicas: int = 1
    """Identical engines per generator, simulated as one with all their slots whose step
    costs one replica's share (the sweeps' fluid approximation of many GPU engines)."""
    engine_threads: int = 1
    """Torch threads per generator (``engine.embedded.threads``; 0 means every core)."""
    max_prefill_tokens: int = 2048
    """Prompt tokens an engine admits in one step."""
    flip_policy: Literal["recompute", "keep"] = "keep"
    """At a weight flip, re-prefill running sequences (``recompute``) or not (``keep``)."""
    trainer_ranks: int = 1
    """FSDP ranks; each trains ``1/ranks`` of a step's tokens (the gradient all-reduce is
    not modeled: perfect data parallelism)."""
    trainer_threads: int = 1
    """Torch threads per trainer rank."""
    prompts_per_batch: int = 64
    """B: groups per trainer step."""
    samples_per_prompt: int = 4
    """n: samples per group."""
    max_staleness: int | None = 2
    """η; None: unbounded. The colocated placement forces 0, as ``RLExperiment`` does."""
    stale_policy: Literal["wait", "drop"] = "wait"
    """``BufferConfig.stale_policy``: hold a step for a group that would turn stale, or not."""
    dynamic_sampling: bool = True
    """Drop groups with all-equal rewards (with the calibrated probability) and lease more."""
    max_new_tokens: int = 8
    """Completion lengths are clipped here."""
    eval_every: int = 10
    """The trainer evaluates every this many steps (0: never)."""
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    """CPU cores the processes share."""
    duration_s: float = 600.0
    """Simulated trainer wall time."""
    max_steps: int = 0
    """Stop after this many trainer steps (0: only ``duration_s``)."""
    seed: int = 0


@dataclass
class SimParams:
    """Costs (seconds, at one thread, no contention) and workload of one system."""

    # ---- a generator's engine step: fixed + per sequence + per prompt token prefilled
    decode_fixed_s: float = 0.0
    decode_per_seq_s: float = 5e-4
    prefill_per_token_s: float = 0.0
    """0 when calibration folded prefill into ``decode_per_seq_s`` (no per-step prefill data)."""
    recompute_per_token_s: float = 8e-5
    """A weight flip under ``recompute`` re-prefills every cached token of the running batch."""
    flip_fixed_s: float = 0.0
    """Extra seconds of any flip step (staging interference), beyond the recompute."""
    message_s: float = 0.001
    """One-way latency of a message between processes (lease grant, chunk, batch, announce)."""
    weight_sync_s: float = 0.05
    """From the trainer's publish to the new weights staged at a generator."""
    # ---- the trainer's step: prep (packing, proximal logprobs) → train → publish → post
    train_per_token_s: float = 1.8e-4
    train_fixed_s: float = 0.0
    prep_per_token_s: float = 6.5e-5
    prep_fixed_s: float = 0.0
    publish_s: float = 0.002
    """Trainer-side seconds of one publish (blocking)."""
    post_s: float = 0.0
    """After announcing the version: logging, checkpoints (generators already go on)."""
    eval_s: float = 0.3
    """One evaluation, every ``SimConfig.eval_every`` steps, after the announce."""
    # ---- workload
    completion_lengths: dict[int, float] = field(default_factory=lambda: {4: 1.0, 5: 1.0})
    """Histogram of completion lengths (tokens)."""
    prompt_lengths: dict[int, float] = field(default_factory=lambda: {18: 1.0})
    filter_schedule: list[tuple[int, float]] = field(default_factory=lambda: [(0, 0.5)])
    """(policy version, probability a finished group is filtered), piecewise linear,
    held constant outside; dynamic sampling only."""
    length_schedule: list[tuple[int, float]] = field(default_factory=list)
    """(policy version, factor on ``completion_lengths``), piecewise linear like
    ``filter_schedule``: responses that grow as RL goes on. Empty: the histogram as it is."""
    # ---- threads (assumptions unless a calibration pair measured them)
    gen_parallel_fraction: float = 0.5
    """Amdahl parallel fraction of generator engine work."""
    train_parallel_fraction: float = 0.5
    """Amdahl parallel fraction of trainer work (prep, train, eval)."""
    source: str = ""
    """The run directory these were calibrated from."""
    notes: list[str] = field(default_factory=list)
    """How calibration got each figure: fallbacks and their errors."""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["completion_lengths"] = {str(k): v for k, v in self.completion_lengths.items()}
        d["prompt_lengths"] = {str(k): v for k, v in self.prompt_lengths.items()}
        return d


def speedup(threads: int, parallel_fraction: float) -> float:
    """Amdahl: how much faster ``threads`` threads run than one."""
    k = max(1, threads)
    return 1.0 / ((1.0 - parallel_fraction) + parallel_fraction / k)


def filter_probability(schedule: list[tuple[int, float]], version: float) -> float:
    """The schedule's value at ``version`` (linear between points, flat outside; 0 when
    empty)."""
    if not schedule:
        return 0.0
    versions = [v for v, _ in schedule]
    i = bisect_right(versions, version)
    if i == 0:
        return schedule[0][1]
    if i == len(schedule):
        return schedule[-1][1]
    (v0, p0), (v1, p1) = schedule[i - 1], schedule[i]
    return p0 + (p1 - p0) * (version - v0) / (v1 - v0)


def length_factor(schedule: list[tuple[int, float]], version: float) -> float:
    """``SimParams.length_schedule`` at ``version``: 1 when empty."""
    return filter_probability(schedule, version) if schedule else 1.0


def mean_length(histogram: dict[int, float]) -> float:
    total = sum(histogram.values())
    return sum(k * w for k, w in histogram.items()) / total if total else 0.0


def generator_threads(cfg: SimConfig) -> int:
    return cfg.engine_threads or cfg.cores


def colocated_threads(cfg: SimConfig) -> int:
    """As ``asyncrl.stages.rl_config.RLExperiment.colocated_threads``: the async placement's cores."""
    trainer = cfg.trainer_threads * cfg.trainer_ranks
    return max(1, min(cfg.cores, trainer + generator_threads(cfg) * cfg.num_generators))


def config_from_run(run_dir: str | Path, **overrides: Any) -> SimConfig:
    """The ``SimConfig`` of a run's ``config.json`` (an ``RLExperiment``); the run's
    ``train_time_s`` (``summary.json``) as the duration when there is one."""
    run_dir = Path(run_dir)
    c = json.loads((run_dir / "config.json").read_text())
    b, e, t = c["buffer"], c["engine"], c["trainer"]
    e = e.get("embedded", e)  # the embedded engine's fields (flat in older run directories)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    cfg = SimConfig(
        placement=c.get("placement", "async"),
        num_generators=c.get("num_generators", 1),
        engine_slots=e["max_slots"],
        engine_threads=e.get("threads", 0),
        max_prefill_tokens=e.get("max_prefill_tokens", 2048),
        flip_policy=e.get("flip_policy", "keep"),
        trainer_ranks=t.get("num_ranks", 1),
        trainer_threads=t.get("threads_per_rank", 1),
        prompts_per_batch=b["prompts_per_batch"],
        samples_per_prompt=b["samples_per_prompt"],
        max_staleness=b["max_staleness"],
        stale_policy=b.get("stale_policy", "drop"),  # runs from before the field dropped
        dynamic_sampling=b.get("dynamic_sampling", False),
        max_new_tokens=c["sampling"]["max_new_tokens"],
        eval_every=c.get("eval", {}).get("every_steps", 0),
        duration_s=float(summary.get("train_time_s") or c.get("time_limit_s") or 600.0),
    )
    return override(cfg, **overrides)


def override(cfg: SimConfig, **overrides: Any) -> SimConfig:
    """A copy of ``cfg`` with fields replaced; strings are parsed to the field's type."""
    types = {f.name: f.type for f in dataclasses.fields(SimConfig)}
    values = {}
    for key, value in overrides.items():
        if key not in types:
            raise KeyError(f"unknown simulator setting {key!r}; known: {sorted(types)}")
        values[key] = _parse(value, getattr(cfg, key)) if isinstance(value, str) else value
    out = dataclasses.replace(cfg, **values)
    if out.placement == "colocated":
        out.max_staleness = 0
    return out


def _parse(text: str, current: Any) -> Any:
    if text.lower() in ("none", "null", "inf", "unbounded"):
        return None
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes", "on")
    if isinstance(current, int) or current is None:
        return int(text)
    if isinstance(current, float):
        return float(text)
    return text
