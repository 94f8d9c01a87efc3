"""The discrete-event simulator of the system (``asyncrl.sim``) from the command line.

    python tools/simulate.py check --calibrate RUN [RUN ...]
        Calibrate on the first run, predict every listed run from its config.json, and
        print measured against predicted trained tokens/s per run (with the workload —
        lengths, filter schedule — of the calibration run, and of the predicted run);
        then the errors of calibrating on each run in turn.
    python tools/simulate.py predict --calibrate RUN [RUN ...] [key=value ...] [--fit-threads]
        The figures of RUN's config with overrides (SimConfig fields, e.g.
        max_staleness=4 num_generators=2 engine_threads=2 placement=colocated).
    python tools/simulate.py sweep --gpus 1024 --model-params 7e9 [...]
    python tools/simulate.py elastic --gpus 64 --slot-gpus 8 [...]
        On the GPU cost model (assumed figures): splits × η; the elastic placement's
        controller against every fixed split of a changing workload
        (``tools/simulate_cluster.py``).

Each ends with one JSON line. ``--cores`` is the machine the runs were measured on
(default: this one's).

Why one file: one command line over the simulator: its predictions, sweeps and calibration
share the arguments and the JSON line each ends with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulate_cluster import add_cluster_commands, fmt_or_dash, run_cluster_command  # noqa: E402

from asyncrl.report import report  # noqa: E402
from asyncrl.sim import SimConfig, SimParams, config_from_run, simulate  # noqa: E402
from asyncrl.sim.calibrate import calibrate, fit_thread_scaling  # noqa: E402

TOLERANCE = 0.15


def describe(cfg: SimConfig) -> str:
    if cfg.placement == "colocated":
        return f"colocated {cfg.engine_threads + cfg.trainer_threads}t B={cfg.prompts_per_batch} n={cfg.samples_per_prompt}"
    return (
        f"async eta={cfg.max_staleness} gen {cfg.num_generators}x{cfg.engine_threads}t "
        f"trainer {cfg.trainer_ranks}x{cfg.trainer_threads}t B={cfg.prompts_per_batch} "
        f"n={cfg.samples_per_prompt}"
    )


def measured(run_dir: str) -> dict[str, Any]:
    """What the run measured (``asyncrl.report``); a colocated run's generator idle share
    is the time it did not generate."""
    figures = report(run_dir, [])
    coloc = Path(run_dir) / "colocated_summary.json"
    if figures["generator_idle_fraction"] is None and coloc.exists() and figures["train_time_s"]:
        generate_s = json.loads(coloc.read_text())["generate_s"]
        figures["generator_idle_fraction"] = 1 - generate_s / figures["train_time_s"]
    return figures


def with_workload(params: SimParams, other: SimParams) -> SimParams:
    """``params``' costs with ``other``'s workload (lengths and filter schedule)."""
    return dataclasses.replace(
        params,
        completion_lengths=other.completion_lengths,
        prompt_lengths=other.prompt_lengths,
        filter_schedule=other.filter_schedule,
    )


def _err(pred: float, meas: float | None) -> float | None:
    return pred / meas - 1 if meas else None


def thread_base(runs: list[str], cores: int, fit: bool) -> SimParams:
    """Default parallel fractions (assumed), or fitted over ``runs`` with ``--fit-threads``."""
    base = SimParams()
    if fit:
        gen, train, note = fit_thread_scaling(runs, cores)
        base.gen_parallel_fraction = base.gen_parallel_fraction if gen is None else gen
        base.train_parallel_fraction = base.train_parallel_fraction if train is None else train
        print(f"thread scaling fitted over the listed runs: {note or 'no pair of thread counts'}")
    print(
        f"parallel fractions: generator {base.gen_parallel_fraction:.3f}, trainer "
        f"{base.train_parallel_fraction:.3f}{' (fitted)' if fit else ' (assumed)'}"
    )
    return base


MODES = ("calibration_workload", "target_workload")
"""Predict with the calibration run's workload (lengths, filter schedule), or the predicted run's."""


def prediction_matrix(
    runs: list[str], params: dict, configs: dict
) -> dict[tuple[str, str, str], dict]:
    """Every (calibration run, predicted run, workload mode) simulated."""
    out = {}
    for cal in runs:
        for run in runs:
            for mode in MODES:
                p = params[cal] if mode == MODES[0] else with_workload(params[cal], params[run])
                out[(cal, run, mode)] = simulate(p, configs[run])
    return out


def check_row(run: str, cfg: SimConfig, m: dict, p: dict, q: dict, primary: str) -> dict[str, Any]:
    """Measured ``m`` against predicted ``p`` (calibration workload), ``q`` (run's workload)."""
    meas = m["trained_tokens_per_s"]
    return {
        "run": run,
        "config": describe(cfg),
        "in_sample": run == primary,
        "measured_trained_tokens_per_s": meas,
        "predicted_trained_tokens_per_s": p["trained_tokens_per_s"],
        "error": _err(p["trained_tokens_per_s"], meas),
        "predicted_with_run_workload": q["trained_tokens_per_s"],
        "error_with_run_workload": _err(q["trained_tokens_per_s"], meas),
        "measured_generated_tokens_per_s": m["generated_tokens_per_s"],
        "predicted_generated_tokens_per_s": p["generated_tokens_per_s"],
        "measured_generator_idle": m["generator_idle_fraction"],
        "predicted_generator_idle": p["generator_idle_fraction"],
        "measured_trainer_idle": m["trainer_idle_fraction"],
        "predicted_trainer_idle": p["trainer_idle_fraction"],
        "measured_staleness": m["staleness_histogram"],
        "predicted_staleness": p["staleness_histogram"],
    }


def print_rows(rows: list[dict], primary: str, cores: int) -> None:
    print(f"calibrated on {primary} ({cores} cores); trained tokens/s, measured vs predicted")
    print(
        f"{'run':<22} {'config':<48} {'measured':>9} {'pred':>9} {'err':>7} {'pred*':>9} {'err*':>7}"
        f"  gen idle m/p   trainer idle m/p"
    )
    for r in rows:
        name = Path(r["run"]).name + (" (cal)" if r["in_sample"] else "")
        print(
            f"{name:<22} {r['config']:<48} {fmt_or_dash(r['measured_trained_tokens_per_s'], '9.0f')} "
            f"{r['predicted_trained_tokens_per_s']:9.0f} {fmt_or_dash(r['error'], '+7.1%')} "
            f"{r['predicted_with_run_workload']:9.0f} {fmt_or_dash(r['error_with_run_workload'], '+7.1%')}  "
            f"{fmt_or_dash(r['measured_generator_idle'], '.3f')}/{r['predicted_generator_idle']:.3f}    "
            f"{fmt_or_dash(r['measured_trainer_idle'], '.3f')}/{r['predicted_trainer_idle']:.3f}"
        )
    print("(* with the predicted run's own workload: its lengths and filter schedule)")


def error_matrix(
    runs: list[str], predictions: dict[tuple[str, str, str], dict], meas: dict[str, dict]
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Relative error of trained tokens/s by workload mode, calibration run, predicted run."""
    return {
        mode: {
            cal: {
                run: _err(
                    predictions[(cal, run, mode)]["trained_tokens_per_s"],
                    meas[run]["trained_tokens_per_s"],
                )
                for run in runs
            }
            for cal in runs
        }
        for mode in MODES
    }


def print_matrix(matrix: dict[str, dict[str, dict[str, float | None]]], runs: list[str]) -> None:
    for mode, table in matrix.items():
        print(
            f"\nerror by calibration run (rows) and predicted run (columns), {mode.replace('_', ' ')}:"
        )
        print(" " * 14 + "".join(f"{Path(r).name:>14}" for r in runs))
        for cal in runs:
            print(
                f"{Path(cal).name:<14}"
                + "".join(fmt_or_dash(table[cal][r], "+14.1%") for r in runs)
            )


def check(runs: list[str], cores: int, seed: int, fit_threads: bool = False) -> dict[str, Any]:
    base = thread_base(runs, cores, fit_threads)
    params = {r: calibrate(r, cores=cores, base=base) for r in runs}
    configs = {r: config_from_run(r, cores=cores, seed=seed) for r in runs}
    meas = {r: measured(r) for r in runs}
    predictions = prediction_matrix(runs, params, configs)
    primary = runs[0]
    rows = [
        check_row(
            r,
            configs[r],
            meas[r],
            predictions[(primary, r, MODES[0])],
            predictions[(primary, r, MODES[1])],
            primary,
        )
        for r in runs
    ]
    print_rows(rows, primary, cores)
    matrix = error_matrix(runs, predictions, meas)
    print_matrix(matrix, runs)
    out_of_sample = [
        e
        for table in matrix.values()
        for cal, row in table.items()
        for run, e in row.items()
        if run != cal and e is not None
    ]
    primary_errors = [r["error"] for r in rows if r["error"] is not None and not r["in_sample"]]
    within = {r["config"] for r in rows if r["error"] is not None and abs(r["error"]) <= TOLERANCE}
    return {
        "command": "check",
        "calibrated_on": primary,
        "cores": cores,
        "fit_threads": fit_threads,
        "gen_parallel_fraction": base.gen_parallel_fraction,
        "train_parallel_fraction": base.train_parallel_fraction,
        "rows": rows,
        "matrix": matrix,
        "max_abs_error_out_of_sample": max(map(abs, primary_errors), default=None),
        "max_abs_error_any_calibration": max(map(abs, out_of_sample), default=None),
        "configs_within_15pct": len(within),
        "notes": params[primary].notes,
    }


def predict(
    runs: list[str], overrides: list[str], cores: int, seed: int, fit_threads: bool = False
) -> dict[str, Any]:
    run = runs[0]
    params = calibrate(run, cores=cores, base=thread_base(runs, cores, fit_threads))
    pairs = dict(o.split("=", 1) for o in overrides)
    cfg = config_from_run(run, cores=cores, seed=seed, **pairs)
    result = simulate(params, cfg)
    print(
        f"calibrated on {run}; predicting {describe(cfg)} for {cfg.duration_s:.0f} s on {cfg.cores} cores"
    )
    for key in (
        "steps",
        "steps_per_s",
        "trained_tokens_per_s",
        "generated_tokens_per_s",
        "generator_idle_fraction",
        "trainer_idle_fraction",
        "mean_active_batch",
    ):
        print(f"  {key:<26} {result[key]:.4g}")
    print(f"  {'staleness_histogram':<26} {result['staleness_histogram']}")
    return {
        "command": "predict",
        "calibrated_on": run,
        "config": dataclasses.asdict(cfg),
        "prediction": result,
        "params": params.to_json(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "predict"):
        p = sub.add_parser(name)
        p.add_argument("--calibrate", nargs="+", required=True, metavar="RUN")
        p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--fit-threads",
            action="store_true",
            help="fit the Amdahl parallel fractions over the listed runs (needs runs at 1 and "
            "more threads; predictions of multi-thread runs become partly in-sample)",
        )
    sub.choices["predict"].add_argument("overrides", nargs="*", help="SimConfig key=value")
    add_cluster_commands(sub)
    args = parser.parse_args(argv)
    if args.command == "check":
        result = check(args.calibrate, args.cores, args.seed, args.fit_threads)
    elif args.command == "predict":
        # ``predict --calibrate RUN [RUN ...] key=value ...``: nargs="+" takes the overrides too;
        # the first run calibrates, the others only help --fit-threads
        runs = [a for a in args.calibrate if "=" not in a]
        overrides = [a for a in args.calibrate if "=" in a] + args.overrides
        result = predict(runs, overrides, args.cores, args.seed, args.fit_threads)
    else:
        result = run_cluster_command(args)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
