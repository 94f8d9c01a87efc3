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
    staleness_histogram                  consumed samples by staleness, {"0": n, "1": n, ...}
    accuracy_at_min                      {"2": acc}: the first eval at or after each minute
                                         of the trainer's clock (null: none yet)
    generators                           the per-generator figures behind the above
"""

from __future__ import annotations

import json
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


def generator_figures(records: list[dict], run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per generator: totals over its logged windows, and p99s from its exit summary."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if not r["process"].startswith("generator_") or "generator/window_s" not in r:
            continue
        g = out.setdefault(
            r["process"].removeprefix("generator_"), {"s": 0.0, "idle": 0.0, "tokens": 0.0}
        )
        g["s"] += r["generator/window_s"]
        g["idle"] += r["generator/idle_s"]
        g["tokens"] += r["generator/tokens"]
    figures = {}
    for worker, g in sorted(out.items()):
        summary = _read_json(run_dir / f"generator_{worker}_summary.json")
        figures[worker] = {
            "tokens": g["tokens"],
            "seconds": g["s"],
            "idle_s": g["idle"],
            "tokens_per_s": _ratio(g["tokens"], g["s"]),
            "idle_fraction": _ratio(g["idle"], g["s"]),
            "step_ms_p99_update": summary.get("update_step_ms_p99"),
            "step_ms_p99_steady": summary.get("steady_step_ms_p99"),
            "update_steps": summary.get("update_steps"),
            "steps": summary.get("steps"),
            "weight_flip_s_mean": summary.get("weight_flip_s"),
        }
    return figures


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
    gens = generator_figures(records, run_dir)
    gen_s, gen_idle_s = (sum(g[k] for g in gens.values()) for k in ("seconds", "idle_s"))

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
        "train_step_tokens_per_s": _ratio(sum(r["train/tokens_per_s"] for r in steps), len(steps)),
        "generated_tokens_per_s": sum(g["tokens_per_s"] or 0.0 for g in gens.values())
        if gens
        else None,
        "generator_idle_fraction": _ratio(gen_idle_s, gen_s),
        "trainer_idle_fraction": _ratio(
            sum(r.get("train/wait_for_batch_s", 0.0) for r in steps), train_time
        ),
        "step_ms_p99_update": worst("step_ms_p99_update"),
        "step_ms_p99_steady": worst("step_ms_p99_steady"),
        "staleness_histogram": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "accuracy_at_min": accuracy_at(
            [(r["time"], r["eval/accuracy"]) for r in trainer if "eval/accuracy" in r], minutes
        ),
        "final_eval_accuracy": summary.get("final_eval_accuracy"),
        "generators": gens,
    }
    return _rounded(figures)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value
