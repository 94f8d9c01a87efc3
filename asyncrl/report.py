"""The figures of one RL run directory (for studies, the README and ``tools/run_report.py``,
which prints them as one JSON line).

Reads what the processes leave in RUN_DIR: ``metrics.jsonl`` (trainer steps with
``train/wait_for_batch_s`` and ``eval/accuracy``, generator windows ``generator/*``),
``summary.json`` (the trainer's), ``generator_<id>_summary.json`` and
``buffer_counters.json``. Works on a run still in progress (missing figures are null).

    steps, wall_time_s, train_time_s     from the trainer's summary (or its last line)
    trained_tokens_per_s                 Σ train/tokens / train time; null unless the trainer logs train/tokens
    train_step_tokens_per_s              mean of the trainer's per-step figure (compute only, no waiting)
    generated_tokens_per_s               Σ over generators of their tokens / their logged seconds
    generator_idle_fraction              Σ idle seconds / Σ logged seconds over every generator window
    trainer_idle_fraction                Σ train/wait_for_batch_s / train time
    step_ms_p99_update, _steady          decode-step p99 while weights were updating vs steady
                                         (the worst generator's whole-life figure)
    update_step_ratio_p50, _p99          each decode step during an update over the mean steady
                                         step of its batch size (worst generator; null: none)
    step_ms_p99_steady_matched           steady decode-step p99 in the update steps' mix of batch
                                         size and prefill (to set step_ms_p99_update against)
    staleness_histogram                  consumed samples by staleness, {"0": n, "1": n, ...}
    accuracy_at_min                      {"2": acc}: the first eval at or after each minute
                                         of the trainer's clock (null: none yet)
    length_p50, _p90, _p99               median over trainer steps of each step's completion-
                                         length percentile (``length/p50`` …)
    length_max, length_mean              the longest completion of the run; mean length
    truncated_frac                       samples that hit max_new_tokens / samples trained
    mismatch_abs_logprob_diff_           train–inference mismatch on the tokens sampled with
    median_of_means, mismatch_kl_median  the proximal version (``mismatch/*``): the median
                                         step's mean |behavior − proximal| logprob, and KL
    mismatch_abs_logprob_diff_max,       the largest step max of it; the tokens measured
    mismatch_tokens
    slot_occupancy                       mean share of the engines' slots in use, weighted by
                                         generator wall time (idle time counts as none in use)
    tail_s_total, tail_s_mean            per weights version, seconds from the finish by which
                                         90% of its leases were done to the last finish: summed
                                         over every generator's closed versions, and per one
    tail_fraction                        tail seconds / those versions' generation seconds
                                         (a batch's, under max_staleness 0; per generator)
    server_restarts                      remote engines' launched servers started again after
                                         they died or stopped answering
    trained_mean_length, finished_        mean completion length of the samples trained on and
    mean_length, trained_vs_finished_     of all that finished, and their ratio (1: no length
    length                                bias from staleness handling or filters)
    passed_filters_mean_length,          the same for the groups that passed the filters
    trained_vs_passed_length             (dynamic sampling): the bias of staleness alone
    dropped                              {"stale"|"filtered"|"failed": {samples, tokens}}
    steps_waited_for_stragglers          steps the trainer held for a long sample
    tokens_revoked_alive                 tokens generated for leases revoked from a live holder
    episodes                             multi-turn tasks: turns, tool_calls, tool_errors and
                                         env_ms per finished episode (null: single-turn)
    generators                           the per-generator figures behind the above
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from asyncrl.metrics import read_metrics


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _ratio(num: float, den: float | None) -> float | None:
    return num / den if den else None


def accuracy_at(evals: list[tuple[float, float]], minutes: list[float]) -> dict[str, float | None]:
    """The first ``(time_s, accuracy)`` at or after each minute mark, by time."""
    evals = sorted(evals)
    return {f"{m:g}": next((acc for t, acc in evals if t >= m * 60), None) for m in minutes}


def seconds_to(evals: list[tuple[float, float]], target: float) -> float | None:
    """Trainer-clock seconds of the first ``(time_s, accuracy)`` at or above ``target``."""
    return next((t for t, acc in sorted(evals) if acc >= target - 1e-9), None)


_WINDOW_SUMS = {
    "seconds": "generator/window_s",
    "idle_s": "generator/idle_s",
    "tokens": "generator/tokens",
    "tail_s": "generator/tail_s",
    "tail_batches": "generator/tail_batches",
    "batch_gen_s": "generator/batch_gen_s",
}
"""Per-generator totals over its logged windows: figure name -> window scalar."""


def window_sums(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per generator, its windows' ``_WINDOW_SUMS``, and its slot-seconds in use
    (occupancy × window seconds) over the seconds of windows that report occupancy."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if not r["process"].startswith("generator_") or "generator/window_s" not in r:
            continue
        worker = r["process"].removeprefix("generator_")
        g = out.setdefault(worker, dict.fromkeys([*_WINDOW_SUMS, "slot_s", "busy_slot_s"], 0.0))
        for name, key in _WINDOW_SUMS.items():
            g[name] += r.get(key, 0.0)
        if "generator/slot_occupancy" in r:
            g["slot_s"] += r["generator/window_s"]
            g["busy_slot_s"] += r["generator/slot_occupancy"] * r["generator/window_s"]
    return out


def generator_figures(records: list[dict], run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per generator: totals over its logged windows, and p99s from its exit summary."""
    figures = {}
    for worker, g in sorted(window_sums(records).items()):
        summary = _read_json(run_dir / f"generator_{worker}_summary.json")
        figures[worker] = {
            "tokens": g["tokens"],
            "seconds": g["seconds"],
            "idle_s": g["idle_s"],
            "tokens_per_s": _ratio(g["tokens"], g["seconds"]),
            "idle_fraction": _ratio(g["idle_s"], g["seconds"]),
            "slot_s": g["slot_s"],
            "slot_occupancy": _ratio(g["busy_slot_s"], g["slot_s"]),
            "tail_batches": g["tail_batches"],
            "tail_s": g["tail_s"],
            "batch_gen_s": g["batch_gen_s"],
            "tail_fraction": _ratio(g["tail_s"], g["batch_gen_s"]),
            "step_ms_p99_update": summary.get("update_step_ms_p99"),
            "step_ms_p99_steady": summary.get("steady_step_ms_p99"),
            "update_steps": summary.get("update_steps"),
            "update_step_ratio_p50": summary.get("update_step_ratio_p50"),
            "update_step_ratio_p99": summary.get("update_step_ratio_p99"),
            "step_ms_p99_steady_matched": summary.get("steady_step_ms_p99_matched"),
            "steps": summary.get("steps"),
            "weight_flip_s_mean": summary.get("weight_flip_s"),
            # A remote engine's servers launched again after they died (0 for others).
            "server_restarts": (summary.get("engine") or {}).get("engine/server_restarts", 0),
        }
    return figures


def generator_totals(gens: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run's figures over every generator: tokens/s, idle fraction, slot occupancy
    and batch tails."""
    total = {k: sum(g[k] for g in gens.values()) for k in _WINDOW_SUMS} if gens else {}
    slot_s = sum(g["slot_s"] for g in gens.values())
    busy_slot_s = sum(g["slot_occupancy"] * g["slot_s"] for g in gens.values() if g["slot_s"])
    tail_s, batches = total.get("tail_s", 0.0), total.get("tail_batches", 0.0)
    return {
        "generated_tokens_per_s": sum(g["tokens_per_s"] or 0.0 for g in gens.values())
        if gens
        else None,
        "generator_idle_fraction": _ratio(total.get("idle_s", 0.0), total.get("seconds")),
        "slot_occupancy": _ratio(busy_slot_s, slot_s),
        "tail_s_total": tail_s if batches else None,
        "tail_s_mean": _ratio(tail_s, batches),
        "tail_fraction": _ratio(tail_s, total.get("batch_gen_s")) if batches else None,
        "server_restarts": sum(g["server_restarts"] for g in gens.values()),
    }


def length_figures(steps: list[dict]) -> dict[str, float | None]:
    """Completion lengths over the trainer's steps (``length/*`` per step): the median
    step's p50, p90 and p99, the longest, the mean and the truncated share by sample."""

    def median_of(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    measured = [r for r in steps if "length/samples" in r]
    samples = sum(r["length/samples"] for r in measured)
    return {
        "length_p50": median_of("length/p50"),
        "length_p90": median_of("length/p90"),
        "length_p99": median_of("length/p99"),
        "length_max": max((r["length/max"] for r in measured), default=None),
        "length_mean": _ratio(
            sum(r["length/mean"] * r["length/samples"] for r in measured), samples
        ),
        "truncated_frac": _ratio(
            sum(r["length/truncated_frac"] * r["length/samples"] for r in measured), samples
        ),
    }


def mismatch_figures(steps: list[dict]) -> dict[str, float | None]:
    """The train–inference mismatch over the trainer's steps (``mismatch/*`` per step):
    the median step's mean |behavior − proximal| and KL, the largest per-step max, and the
    tokens measured. Steps without such tokens (no ``…_mean``) are left out."""
    measured = [r for r in steps if "mismatch/abs_logprob_diff_mean" in r]
    tokens = [r["mismatch/tokens"] for r in steps if "mismatch/tokens" in r]

    def median_of(key: str) -> float | None:
        return statistics.median(r[key] for r in measured) if measured else None

    return {
        "mismatch_abs_logprob_diff_median_of_means": median_of("mismatch/abs_logprob_diff_mean"),
        "mismatch_abs_logprob_diff_max": max(
            (r["mismatch/abs_logprob_diff_max"] for r in measured), default=None
        ),
        "mismatch_kl_median": median_of("mismatch/kl"),
        "mismatch_tokens": sum(tokens) if tokens else None,
    }


def buffer_figures(counters: dict[str, float]) -> dict[str, Any]:
    """From the buffer's counters: the mean completion length of what was trained on and
    of everything that finished (the length bias of staleness handling), what was dropped
    and its tokens, and tokens generated for leases revoked from a live holder."""

    def get(name: str) -> float:
        return counters.get(f"buffer/{name}", 0.0)

    trained = _ratio(get("completion_tokens_consumed"), get("samples_consumed"))
    finished = _ratio(get("completion_tokens_finished"), get("samples_finished"))
    ready = _ratio(get("completion_tokens_ready"), get("samples_ready"))
    dropped = {
        kind: {
            "samples": int(get(f"samples_{kind}")),
            "tokens": int(get(f"completion_tokens_{kind}")),
        }
        for kind in ("stale", "filtered", "failed")
    }
    return {
        "trained_mean_length": trained,
        "finished_mean_length": finished,
        "trained_vs_finished_length": _ratio(trained or 0.0, finished) if trained else None,
        "passed_filters_mean_length": ready,
        "trained_vs_passed_length": _ratio(trained or 0.0, ready) if trained else None,
        "dropped": dropped,
        "steps_waited_for_stragglers": int(get("steps_waited_for_stragglers")),
        "tokens_revoked_alive": int(get("tokens_revoked_alive")),
        "episodes": {  # multi-turn tasks: per finished episode
            name: _ratio(get(f"episode_{key}") / scale, get("samples_finished"))
            for name, key, scale in (
                ("turns", "turns", 1),
                ("tool_calls", "tool_calls", 1),
                ("tool_errors", "tool_errors", 1),
                ("env_ms", "env_us", 1000),
            )
        }
        if get("episode_turns")
        else None,
    }


def report(run_dir: str | Path, minutes: list[float]) -> dict[str, Any]:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    summary = _read_json(run_dir / "summary.json")
    counters = _read_json(run_dir / "buffer_counters.json")
    if not counters:  # buffer still running: its latest logged line
        counters = next((r for r in reversed(records) if r["process"] == "buffer"), {})
    trainer = [r for r in records if r["process"] == "trainer"]
    steps = [r for r in trainer if "train/loss" in r]
    train_time = summary.get("train_time_s") or (trainer[-1]["time"] if trainer else None)
    trained = [r["train/tokens"] for r in steps if "train/tokens" in r]
    per_step = [r["train/tokens_per_s"] for r in steps if "train/tokens_per_s" in r]  # text only
    gens = generator_figures(records, run_dir)

    def worst(key: str) -> float | None:
        values = [g[key] for g in gens.values() if g[key] is not None]
        return max(values) if values else None

    staleness = {
        k.removeprefix("buffer/staleness_"): int(v)
        for k, v in counters.items()
        if k.startswith("buffer/staleness_")
    }
    figures = {
        "steps": summary.get("steps", max((r["step"] for r in steps), default=0)),
        "wall_time_s": summary.get("wall_time_s"),
        "train_time_s": train_time,
        "trained_tokens_per_s": _ratio(sum(trained), train_time) if trained else None,
        "train_step_tokens_per_s": _ratio(sum(per_step), len(per_step)) if per_step else None,
        **generator_totals(gens),
        "trainer_idle_fraction": _ratio(
            sum(r.get("train/wait_for_batch_s", 0.0) for r in steps), train_time
        ),
        "step_ms_p99_update": worst("step_ms_p99_update"),
        "step_ms_p99_steady": worst("step_ms_p99_steady"),
        "update_step_ratio_p50": worst("update_step_ratio_p50"),
        "update_step_ratio_p99": worst("update_step_ratio_p99"),
        "step_ms_p99_steady_matched": worst("step_ms_p99_steady_matched"),
        "staleness_histogram": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "accuracy_at_min": accuracy_at(
            [(r["time"], r["eval/accuracy"]) for r in trainer if "eval/accuracy" in r], minutes
        ),
        "final_eval_accuracy": summary.get("final_eval_accuracy"),
        **length_figures(steps),
        **mismatch_figures(steps),
        **buffer_figures(counters),
        "elastic": elastic_figures(records),
        "generators": gens,
    }
    return _rounded(figures)


# Each role the controller moves: its count's metric is ``elastic/<role>``, a move's is
# the value here.
ROLES = {
    "generators": "elastic/move",
    "reward_servers": "elastic/reward_move",
    "lending": "elastic/lending_move",
}


def elastic_figures(records: list[dict]) -> dict[str, Any] | None:
    """An elastic run's allocations (``placement=elastic``): seconds spent at each
    generator count, with reward servers at each of theirs, and with ``lend_waits`` lending
    (1) or not (0), from the controller's checks, and its moves of each (None for other
    runs)."""
    checks = [r for r in records if r["process"] == "controller"]
    if not checks:
        return None
    out: dict[str, Any] = {}
    for role in ROLES:
        if f"elastic/{role}" not in checks[0]:
            continue
        seconds: dict[str, float] = {}
        for this, following in zip(checks, checks[1:]):
            count = str(int(this[f"elastic/{role}"]))
            # A relaunch on the run directory starts the controller's clock again.
            seconds[count] = seconds.get(count, 0.0) + max(0.0, following["time"] - this["time"])
        out[f"seconds_at_{role}"] = seconds
    out["moves"] = [
        {"at_s": r["time"], "delta": int(r[key]), role: r[f"elastic/{role}"]}
        for r in checks
        for role, key in ROLES.items()
        if key in r
    ]
    return out


def _rounded(value: Any) -> Any:
    """Floats to 4 decimals; below 1e-3, to 3 significant digits (a mismatch of 1e-6
    would read 0)."""
    if isinstance(value, float):
        return round(value, 4) if abs(value) >= 1e-3 else float(f"{value:.3g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value
