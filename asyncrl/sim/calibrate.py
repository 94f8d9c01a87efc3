"""``calibrate(run_dir) -> SimParams``: the simulator's costs (and, through
``asyncrl.sim.workload``, its workload) from what one measured run left in its directory
(``metrics.jsonl``, the summaries, the counters).

Trainer (every placement), from its per-step records:

    train/step_s = train_per_token · tokens + train_fixed      (least squares over steps; when
                   tokens hardly vary, coefficient of variation < 5 %, through the origin)
    overhead_i   = (time_i − time_{i−1}) − step_s_i − wait_for_batch_s_i
                 = prep + publish + post (+ eval on evaluation steps)
    prep_i       = overhead_i − publish_s  (post_s assumed 0: logging takes ms), fitted
                   against tokens like the step, on steps without evaluation; it is mostly
                   the proximal-logprob forward pass, so the generators of an η = 0 run
                   wait through it
    eval_s       = mean residual of evaluation steps − mean residual of the others

Generator (async placement), preferably from ``steady_step_by_batch`` in the generator
summary (``asyncrl.generator.stats``: steady step seconds per batch-size bucket, and
prefill tokens when recorded):

    step_s(b) = decode_fixed + decode_per_seq · b (+ prefill_per_token · prefill)   (weighted LS)
    + the loop's own time per step (busy loop seconds − Σ step seconds) / steps, into the fixed

and otherwise (runs older than that table) the **fallback**: per logging window, the mean
active batch (tokens / steps) against busy seconds per step (window − idle, less the update
steps' extra), weighted least squares; prefill is then folded into the per-sequence cost,
and a negative intercept is set to 0 (cost through the origin: per token). The windows'
relative RMS residual is the fallback's error (in ``notes``). A flip's extra seconds are
``(update_step_mean − steady_step_mean) · update_steps / weights_received``, charged to the
cached tokens a flip re-prefills (mean batch · (prompt + (completion − 1) / 2)).
``weight_sync_s`` = trainer publish + arrival-to-staged at the generator.

Colocated runs have no engine-step figures: generation is ``Σ generate_s / Σ generated
tokens`` per sequence-step (through the origin), and flips, lease latency and weight sync
take defaults.

Times are normalized to one thread without contention: × Amdahl speed-up of the run's
threads (parallel fractions from ``base``: assumptions unless fitted), ÷ the mean CPU
oversubscription of the run (busy threads / cores, when above 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.metrics import read_metrics
from asyncrl.sim.model import (
    SimConfig,
    SimParams,
    colocated_threads,
    config_from_run,
    generator_threads,
    mean_length,
    speedup,
)
from asyncrl.sim.workload import calibrate_workload

PREFILL_TO_DECODE = 0.15
"""Default cost of prefilling one token relative to one sequence's decode step, for runs
without flip figures (colocated). From demo_async's update steps (0.08 ms/token recomputed
against 0.53 ms per sequence-step): an assumption carried over, not a measurement of the
run being calibrated."""


def calibrate(
    run_dir: str | Path, cores: int | None = None, base: SimParams | None = None
) -> SimParams:
    """``SimParams`` from one run directory; ``base`` gives the parallel fractions and the
    defaults of whatever the run cannot tell (lease latency, a colocated run's flips)."""
    run_dir = Path(run_dir)
    cfg = config_from_run(run_dir, **({"cores": cores} if cores else {}))
    records = read_metrics(run_dir)
    counters = _read_json(run_dir / "buffer_counters.json")
    params = dataclasses.replace(base or SimParams(), source=str(run_dir), notes=[])
    calibrate_workload(params, cfg, run_dir, records, counters)
    gen_busy = _generator(params, cfg, run_dir, records)
    _trainer(params, cfg, records, gen_busy)
    return params


def fit_thread_scaling(
    run_dirs: list[str | Path], cores: int | None = None
) -> tuple[float | None, float | None, str]:
    """Amdahl parallel fractions (generator, trainer) from runs of one system at different
    thread counts: each run calibrated at its own threads (fraction 0: nothing rescaled),
    then ``speed-up(k) = cost at 1 thread / cost at k`` against the mean of the one-thread
    runs. None where the runs have no one-thread and multi-thread pair for that kind."""
    raw = {"gen": {}, "train": {}}
    for run in run_dirs:
        cfg = config_from_run(run, **({"cores": cores} if cores else {}))
        p = calibrate(
            run, cores=cores, base=SimParams(gen_parallel_fraction=0.0, train_parallel_fraction=0.0)
        )
        if cfg.placement == "colocated":
            k_gen = k_train = colocated_threads(cfg)
        else:
            k_gen, k_train = (
                min(generator_threads(cfg), cfg.cores),
                min(cfg.trainer_threads, cfg.cores),
            )
        raw["gen"].setdefault(k_gen, []).append(p.decode_fixed_s / 32 + p.decode_per_seq_s)
        raw["train"].setdefault(k_train, []).append(p.train_per_token_s + p.prep_per_token_s)
    fractions, notes = [], []
    for kind, by_threads in raw.items():
        ones = by_threads.get(1)
        others = [(k, c) for k, costs in by_threads.items() if k > 1 for c in costs]
        if not ones or not others:
            fractions.append(None)
            continue
        one = float(np.mean(ones))
        fits = [(1 - c / one) / (1 - 1 / k) for k, c in others]
        fractions.append(float(np.clip(np.mean(fits), 0.0, 1.0)))
        notes.append(
            f"{kind}: speed-up at {[k for k, _ in others]} threads "
            f"{[round(one / c, 3) for _, c in others]} -> parallel fraction {fractions[-1]:.3f}"
        )
    return fractions[0], fractions[1], "; ".join(notes)


# ---- trainer ---------------------------------------------------------------------------
def _trainer(params: SimParams, cfg: SimConfig, records: list[dict], gen_busy: float) -> None:
    steps = [r for r in records if r["process"] == "trainer" and "train/loss" in r]
    if len(steps) < 3:
        raise ValueError("calibration needs at least 3 trainer steps in metrics.jsonl")
    tokens = np.array([r["train/tokens"] for r in steps], dtype=float)
    step_s = np.array([r["train/step_s"] for r in steps])
    wait = np.array([r.get("train/wait_for_batch_s", 0.0) for r in steps])
    times = np.array([r["time"] for r in steps])
    evals = np.array(["eval/accuracy" in r for r in steps])
    per_token, fixed, note = fit_line(tokens, step_s, "train/step_s vs train/tokens")
    params.notes.append(note)
    overhead = np.diff(times) - step_s[1:] - wait[1:]
    plain, evaluated = ~evals[1:], evals[1:]
    params.publish_s = float(np.mean([r.get("train/weight_publish_s", 0.0) for r in steps]))
    # Prep (packing, the proximal-logprob forward, the state dict) against tokens like the
    # step itself; evaluation is what evaluation steps take beyond that.
    prep = np.maximum(overhead - params.publish_s - params.post_s, 0.0)
    per_token_prep, fixed_prep, note = fit_line(
        tokens[1:][plain], prep[plain], "prep (step overhead) vs tokens"
    )
    params.notes.append(note)
    params.prep_per_token_s, params.prep_fixed_s = per_token_prep, fixed_prep
    beyond = prep - (per_token_prep * tokens[1:] + fixed_prep)
    params.eval_s = (
        max(0.0, float(beyond[evaluated].mean() - beyond[plain].mean())) if evaluated.any() else 0.0
    )
    # To one thread, one rank, no contention.
    if cfg.placement == "colocated":
        threads, ranks, others = colocated_threads(cfg), 1, 0.0
    else:
        threads, ranks, others = cfg.trainer_threads, cfg.trainer_ranks, gen_busy
    threads = min(threads, cfg.cores)
    slowdown = max(1.0, (threads * ranks + others) / cfg.cores)
    scale = speedup(threads, params.train_parallel_fraction) / slowdown
    params.train_per_token_s = per_token * scale * ranks
    params.train_fixed_s = fixed * scale
    params.prep_per_token_s *= scale * ranks
    params.prep_fixed_s *= scale
    params.eval_s *= scale
    params.notes.append(
        f"trainer: overhead {overhead[plain].mean():.3f} s/step (publish {params.publish_s:.4f}), "
        f"eval {params.eval_s:.3f} s; normalized ×{scale:.3f} (threads {threads}, "
        f"slowdown {slowdown:.2f})"
    )


def fit_line(
    x: np.ndarray, y: np.ndarray, what: str, weights: np.ndarray | None = None
) -> tuple[float, float, str]:
    """``y ≈ slope · x + intercept`` by weighted least squares, with both ≥ 0; through
    the origin when x hardly varies (CV < 5 %) or the intercept comes out negative."""
    w = np.ones_like(x) if weights is None else weights
    mean_x = np.average(x, weights=w)
    cv = math.sqrt(np.average((x - mean_x) ** 2, weights=w)) / mean_x if mean_x else 0.0
    slope = intercept = None
    if cv >= 0.05:
        a = np.vstack([x, np.ones_like(x)]).T * np.sqrt(w)[:, None]
        slope, intercept = np.linalg.lstsq(a, y * np.sqrt(w), rcond=None)[0]
    how = f"OLS (x CV {cv:.1%})"
    if slope is None or intercept < 0:
        slope, intercept = float(np.sum(w * y) / np.sum(w * x)), 0.0
        how = f"through the origin (x CV {cv:.1%})"
    elif slope < 0:
        slope, intercept = 0.0, float(np.average(y, weights=w))
        how = "constant (negative slope)"
    resid = y - (slope * x + intercept)
    rel = math.sqrt(np.average(resid**2, weights=w)) / float(np.average(y, weights=w))
    note = (
        f"{what}: {how}, slope {slope:.4g}, intercept {intercept:.4g}, rel. RMS residual {rel:.1%}"
    )
    return float(slope), float(intercept), note


# ---- generator -------------------------------------------------------------------------
def _generator(params: SimParams, cfg: SimConfig, run_dir: Path, records: list[dict]) -> float:
    """Fill the generator costs; return the generators' mean busy threads (for contention)."""
    if cfg.placement == "colocated":
        _colocated_generation(params, cfg, records)
        return 0.0
    summaries = [_read_json(p) for p in sorted(run_dir.glob("generator_*_summary.json"))]
    windows = [
        r for r in records if r["process"].startswith("generator_") and r.get("generator/steps")
    ]
    if not windows:
        raise ValueError(f"{run_dir}: no generator windows in metrics.jsonl")
    busy = sum(w["generator/window_s"] - w["generator/idle_s"] for w in windows)
    logged = sum(w["generator/window_s"] for w in windows)
    threads = min(generator_threads(cfg), cfg.cores)
    gen_busy = threads * cfg.num_generators * busy / logged
    tables = [s["steady_step_by_batch"] for s in summaries if s.get("steady_step_by_batch")]
    if tables:
        _decode_from_buckets(params, tables, summaries)
    else:
        _decode_from_windows(params, windows)
    mean_batch = sum(w["generator/tokens"] for w in windows) / sum(
        w["generator/steps"] for w in windows
    )
    _flips(params, summaries, mean_batch)
    trainer = [r for r in records if r["process"] == "trainer" and "train/loss" in r]
    stage = np.mean([s.get("weight_stage_s", 0.0) for s in summaries]) if summaries else 0.0
    publish = np.mean([r.get("train/weight_publish_s", 0.0) for r in trainer]) if trainer else 0.0
    params.weight_sync_s = float(publish + stage)
    # To one thread, no contention (the trainer's threads busy while it is not waiting).
    train_time = trainer[-1]["time"] if trainer else 1.0
    trainer_busy = 1.0 - sum(r.get("train/wait_for_batch_s", 0.0) for r in trainer) / train_time
    others = cfg.trainer_threads * cfg.trainer_ranks * trainer_busy
    slowdown = max(1.0, (gen_busy + others) / cfg.cores)
    scale = speedup(threads, params.gen_parallel_fraction) / slowdown
    for name in (
        "decode_fixed_s",
        "decode_per_seq_s",
        "prefill_per_token_s",
        "recompute_per_token_s",
        "flip_fixed_s",
    ):
        setattr(params, name, getattr(params, name) * scale)
    params.notes.append(
        f"generator: mean batch {mean_batch:.1f}, normalized ×{scale:.3f} "
        f"(threads {threads}, slowdown {slowdown:.2f})"
    )
    return gen_busy


def _decode_from_windows(params: SimParams, windows: list[dict]) -> None:
    steps = np.array([w["generator/steps"] for w in windows], dtype=float)
    batch = np.array([w["generator/tokens"] for w in windows]) / steps
    extra = np.array(
        [
            w.get("generator/update_steps", 0.0)
            * (
                w.get("generator/update_step_ms_mean", 0.0)
                - w.get("generator/steady_step_ms_mean", 0.0)
            )
            / 1000.0
            for w in windows
        ]
    )
    busy = np.array([w["generator/window_s"] - w["generator/idle_s"] for w in windows]) - extra
    slope, intercept, note = fit_line(
        batch, busy / steps, "fallback: busy s/step vs mean batch", steps
    )
    params.decode_per_seq_s, params.decode_fixed_s, params.prefill_per_token_s = (
        slope,
        intercept,
        0.0,
    )
    params.notes.append(note + "; prefill folded into the per-sequence cost")


def _decode_from_buckets(params: SimParams, tables: list[dict], summaries: list[dict]) -> None:
    rows = [row for table in tables for row in table.values() if row["steps"]]
    steps = np.array([r["steps"] for r in rows], dtype=float)
    batch = np.array([r["sequences"] for r in rows]) / steps
    mean_s = np.array([r["seconds"] for r in rows]) / steps
    if all("prefill_tokens" in r for r in rows):
        prefill = np.array([r["prefill_tokens"] for r in rows]) / steps
        a = np.vstack([np.ones_like(batch), batch, prefill]).T * np.sqrt(steps)[:, None]
        coef = np.clip(np.linalg.lstsq(a, mean_s * np.sqrt(steps), rcond=None)[0], 0.0, None)
        params.decode_fixed_s, params.decode_per_seq_s, params.prefill_per_token_s = map(
            float, coef
        )
        fit = coef[0] + coef[1] * batch + coef[2] * prefill
        rel = math.sqrt(np.average((mean_s - fit) ** 2, weights=steps)) / np.average(
            mean_s, weights=steps
        )
        params.notes.append(
            f"decode by batch bucket with prefill: {coef}, rel. RMS residual {rel:.1%}"
        )
    else:
        slope, intercept, note = fit_line(batch, mean_s, "decode by batch bucket", steps)
        params.decode_fixed_s, params.decode_per_seq_s, params.prefill_per_token_s = (
            intercept,
            slope,
            0.0,
        )
        params.notes.append(note)
    # The worker loop's own time per step (chunks, leases, heartbeats) joins the fixed cost.
    busy = sum(s["loop_s"] - s["idle_s"] for s in summaries)
    stepped = sum(s["steps"] for s in summaries)
    step_s = sum(r["seconds"] for r in rows) + sum(
        s.get("update_steps", 0) * s.get("update_step_ms_mean", 0.0) / 1000 for s in summaries
    )
    params.decode_fixed_s += max(0.0, (busy - step_s) / stepped)


def _flips(params: SimParams, summaries: list[dict], mean_batch: float) -> None:
    extra = updates = 0.0
    for s in summaries:
        if s.get("update_steps") and "steady_step_ms_mean" in s:
            extra += (
                s["update_steps"] * (s["update_step_ms_mean"] - s["steady_step_ms_mean"]) / 1000
            )
            updates += s.get("weights_received", 0.0)
    if not updates:
        params.notes.append("flips: no update steps measured; recompute cost left at its default")
        return
    cached = mean_batch * (
        mean_length(params.prompt_lengths) + (mean_length(params.completion_lengths) - 1) / 2
    )
    per_flip = max(0.0, extra / updates)
    params.flip_fixed_s = 0.0
    params.recompute_per_token_s = per_flip / cached if cached else 0.0
    params.notes.append(
        f"flips: {per_flip * 1000:.1f} ms extra per update over ~{cached:.0f} cached tokens"
    )


def _colocated_generation(params: SimParams, cfg: SimConfig, records: list[dict]) -> None:
    rows = [r for r in records if r["process"] == "colocated" and "colocated/generate_s" in r]
    if not rows:
        raise ValueError("a colocated run needs the colocated process's records")
    seconds = sum(r["colocated/generate_s"] for r in rows)
    tokens = sum(r["colocated/generated_tokens"] for r in rows)
    scale = speedup(colocated_threads(cfg), params.gen_parallel_fraction)
    params.decode_fixed_s, params.prefill_per_token_s = 0.0, 0.0
    params.decode_per_seq_s = seconds / tokens * scale
    params.recompute_per_token_s = PREFILL_TO_DECODE * params.decode_per_seq_s
    params.notes.append(
        f"colocated generation: {tokens / seconds:.0f} tok/s at "
        f"{colocated_threads(cfg)} threads, per token (no per-step figures); "
        f"flip and weight sync at defaults"
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
