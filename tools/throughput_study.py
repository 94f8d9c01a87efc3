"""Asynchronous against synchronous: time to an accuracy target and throughput.

    python tools/throughput_study.py [--experiment experiments/tiny_grpo.py] [--seeds 0] \
        [--time-limit 600] [--target 0.5] [--stop-at-target] [--sweep-time-limit 150] \
        [--out runs/studies/throughput]

Three modes of the same experiment, same seeds, budget and cores, one after another:
``async`` (the experiment's η), ``sync`` (η = 0, the same placement: generation waits for
each new version) and ``colocated`` (one process alternates generation and training on
every core). Then a sweep of the generator-to-trainer resource ratio on this machine
(generator threads × generators : trainer threads), shorter runs that measure throughput
and idle time only. Writes ``results.csv`` and ``ratio_sweep.csv``, and ends with one JSON
line: ``{"async_s_to_target", "sync_s_to_target", "colocated_s_to_target", ...}`` (the
median over seeds of the trainer-clock seconds to the first evaluation at or above the
target; null when a mode never reached it) with each mode's trained tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.launcher.study import Point, add_set_argument, run_points, write_csv  # noqa: E402

MODES = {"async": [], "sync": ["buffer.max_staleness=0"], "colocated": ["placement=colocated"]}
# (generators, threads per generator, trainer threads) on this 2-core machine
RATIOS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1)]


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the runs, or None when any run missed (a missed target is not a time)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="experiments/tiny_grpo.py")
    parser.add_argument("--seeds", default="0")
    parser.add_argument(
        "--modes", default="async,sync,colocated", help="modes to run (empty: sweep only)"
    )
    parser.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds of training per mode run"
    )
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy target")
    parser.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end each mode's run once it reaches the target (its throughput figures then "
        "cover the run up to there)",
    )
    parser.add_argument(
        "--sweep-time-limit", type=float, default=150.0, help="0 skips the ratio sweep"
    )
    add_set_argument(parser)
    parser.add_argument("--out", default="runs/studies/throughput")
    return parser.parse_args(argv)


def run_modes(
    args: argparse.Namespace, modes: dict[str, list[str]], seeds: list[int], out: Path
) -> dict[str, Any]:
    """Every mode at every seed; per mode the medians over seeds, and async's speedups."""
    points = [
        Point(
            f"{mode}-s{seed}",
            [
                *extra,
                f"seed={seed}",
                f"time_limit_s={args.time_limit}",
                *([f"stop_at_accuracy={args.target}"] if args.stop_at_target else []),
                *args.set,
            ],
            {"mode": mode, "seed": seed},
        )
        for seed in seeds
        for mode, extra in modes.items()
    ]
    results = run_points(
        args.experiment, points, out, [args.target], timeout_s=args.time_limit + 600
    )
    write_csv(results, out / "results.csv")
    key = f"{args.target:g}"
    summary: dict[str, Any] = {}
    for mode in modes:
        runs = [r for r in results if r["mode"] == mode]
        summary[f"{mode}_s_to_target"] = median_or_none([r["s_to_target"][key] for r in runs])
        summary[f"{mode}_trained_tokens_per_s"] = statistics.median(
            r["trained_tokens_per_s"] or 0.0 for r in runs
        )
        summary[f"{mode}_final_accuracy"] = statistics.median(
            r["final_eval_accuracy"] or 0.0 for r in runs
        )
    for other in ("sync", "colocated"):
        if "async" not in modes or other not in modes:
            continue
        a, b = summary["async_s_to_target"], summary[f"{other}_s_to_target"]
        summary[f"async_speedup_vs_{other}"] = round(b / a, 3) if a and b else None
    return summary


def run_ratio_sweep(args: argparse.Namespace, seed: int, out: Path) -> list[dict[str, Any]]:
    """Short runs over ``RATIOS``: throughput and idle fractions of each resource split."""
    sweep = [
        Point(
            f"ratio-g{g}x{t}-t{tt}",
            [
                f"num_generators={g}",
                f"engine.embedded.threads={t}",
                f"trainer.threads_per_rank={tt}",
                f"time_limit_s={args.sweep_time_limit}",
                "eval.every_steps=0",
                f"seed={seed}",
                *args.set,
            ],
            {"num_generators": g, "generator_threads": t, "trainer_threads": tt},
        )
        for g, t, tt in RATIOS
    ]
    swept = run_points(args.experiment, sweep, out, [], timeout_s=args.sweep_time_limit + 600)
    write_csv(swept, out / "ratio_sweep.csv")
    return [
        {
            k: r[k]
            for k in (
                "num_generators",
                "generator_threads",
                "trainer_threads",
                "trained_tokens_per_s",
                "generated_tokens_per_s",
                "generator_idle_fraction",
                "trainer_idle_fraction",
            )
        }
        for r in swept
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    modes = {m: MODES[m] for m in args.modes.split(",") if m}
    summary: dict = {"study": "throughput", "target": args.target, "seeds": seeds}
    summary |= run_modes(args, modes, seeds, out)
    if args.sweep_time_limit > 0:
        summary["ratio_sweep"] = run_ratio_sweep(args, seeds[0], out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
