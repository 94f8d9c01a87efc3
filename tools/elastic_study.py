"""The elastic placement against every fixed count of a role, on this machine.

    python tools/elastic_study.py [--experiment experiments/tiny_grpo.py] [--seeds 0,1,2] \
        [--role generators|rewards] [--counts 1,2] [--time-limit 240] \
        [--reward-model DIR] [--lend] [--set KEY=VALUE ...] [--out runs/studies/elastic]

For each seed, one run at each fixed count of the role (``num_generators``, or
``reward.model_servers`` with ``--role rewards``, which scores with the reward model in
``--reward-model`` on servers of its own) and one ``placement=elastic`` run that starts at
the smallest count and may go to the largest, not told which is best. Every run trains
for ``--time-limit`` seconds on the same cores, one after another
(``asyncrl.launcher.study``). Ends with one JSON line: the median trained tokens/s of
each fixed count and of the elastic runs, elastic against the best fixed count (the
acceptance figure: within 5%), and the elastic runs' time at each count and moves.

``--lend`` adds, at each fixed count, a run whose trainer generates while it waits for
its batch (``generate_while_waiting=true``), summarized against the best fixed count
without it. With a single count there is no elastic run (it would have nowhere to move).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.launcher.study import Point, add_set_argument, run_points, write_csv  # noqa: E402

ROLE_KEYS = {"generators": "num_generators", "rewards": "reward.model_servers"}


def points_for(args: argparse.Namespace) -> list[Point]:
    counts = [int(c) for c in args.counts.split(",")]
    low, high = min(counts), max(counts)
    key = ROLE_KEYS[args.role]
    common = [f"time_limit_s={args.time_limit}", "rl.max_steps=1000000", *args.set]
    if args.role == "rewards":
        if not args.reward_model:
            raise SystemExit("--role rewards needs --reward-model DIR")
        common += ["reward.source=model", f"reward.model_path={args.reward_model}"]
        bounds = [f"elastic.min_reward_servers={low}", f"elastic.max_reward_servers={high}"]
        # Generators stay where the experiment puts them: only the reward role moves.
        bounds += ["elastic.min_generators=1", "elastic.max_generators=1", "num_generators=1"]
    else:
        bounds = [f"elastic.min_generators={low}", f"elastic.max_generators={high}"]
    points = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        base = [f"seed={seed}", *common]
        for count in counts:
            labels = {"seed": seed, "placement": "fixed", "count": count}
            points.append(Point(f"fixed{count}_s{seed}", [*base, f"{key}={count}"], labels))
            if args.lend:
                lend = [*base, f"{key}={count}", "generate_while_waiting=true"]
                labels = {"seed": seed, "placement": "lending", "count": count}
                points.append(Point(f"lend{count}_s{seed}", lend, labels))
        if low == high:
            continue
        elastic = [*base, "placement=elastic", f"{key}={low}", *bounds]
        labels = {"seed": seed, "placement": "elastic", "count": low}
        points.append(Point(f"elastic_s{seed}", elastic, labels))
    return points


def summarize(results: list[dict], role: str) -> dict:
    def median(rows: list[dict]) -> float | None:
        values = [r["trained_tokens_per_s"] for r in rows if r["trained_tokens_per_s"]]
        return statistics.median(values) if values else None

    def by_count(placement: str) -> dict[str, float | None]:
        rows = [r for r in results if r["placement"] == placement]
        counts = sorted({r["count"] for r in rows})
        return {str(c): median([r for r in rows if r["count"] == c]) for c in counts}

    fixed, lending = by_count("fixed"), by_count("lending")
    elastic_rows = [r for r in results if r["placement"] == "elastic"]
    elastic = median(elastic_rows)
    best = max((v for v in fixed.values() if v), default=None)
    best_lending = max((v for v in lending.values() if v), default=None)
    return {
        "role": role,
        "seeds": sorted({r["seed"] for r in results}),
        "fixed_trained_tokens_per_s": fixed,
        "elastic_trained_tokens_per_s": elastic,
        "elastic_against_best_fixed": elastic / best - 1 if elastic and best else None,
        "lending_trained_tokens_per_s": lending,
        "lending_against_best_fixed": best_lending / best - 1 if best_lending and best else None,
        "elastic_runs": [
            {
                "seed": r["seed"],
                "trained_tokens_per_s": r["trained_tokens_per_s"],
                **(r["elastic"] or {}),
            }
            for r in elastic_rows
        ],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="experiments/tiny_grpo.py")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--role", choices=sorted(ROLE_KEYS), default="generators")
    parser.add_argument("--counts", default="1,2", help="fixed counts of the role to sweep")
    parser.add_argument("--time-limit", type=float, default=240.0, help="seconds per run")
    parser.add_argument("--reward-model", default="", help="value-head HF directory (rewards)")
    parser.add_argument(
        "--lend", action="store_true", help="also each fixed count with generate_while_waiting"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/studies/elastic"))
    add_set_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    points = points_for(args)
    timeout = args.time_limit * 3 + 600  # start-up, the final evaluation, a slow machine
    results = run_points(args.experiment, points, args.out, targets=[], timeout_s=timeout)
    write_csv(results, args.out / "results.csv", drop=("generators", "evals", "elastic"))
    print(json.dumps(summarize(results, args.role)))


if __name__ == "__main__":
    main()
