"""How far off-policy can training go before learning suffers, and how much faster is it?

    python tools/staleness_study.py [--experiment experiments/tiny_grpo.py] \
        [--etas 0,1,2,4,8,none] [--seeds 0] [--time-limit 270 | --steps N] \
        [--out runs/studies/staleness]

Runs the experiment once per η (``buffer.max_staleness``; ``none`` is unbounded) with the
decoupled PPO loss on and off (``rl.loss.use_decoupled_loss``), each with the same seeds
and time budget, one after another on this machine. At η = 0 the two losses are the same
objective (behavior = proximal policy), so that point runs once and stands in both
series. Writes ``results.csv`` (one row per run: wall time, trained and generated
tokens/s, generator and trainer idle fractions, staleness histogram, accuracy at each
minute, seconds to each target) and three plots in the shape of AReaL's Tables 2 and 7:
``accuracy_vs_time.png`` (per η, decoupled loss), ``throughput_vs_eta.png`` and
``final_accuracy_vs_eta.png`` (with and without the decoupled loss). The default budget
(11 runs of 270 s plus start-up and evaluation) fits in an hour. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.launcher.study import Point, add_set_argument, run_points, write_csv  # noqa: E402


def points_for(etas: list[str], seeds: list[int], time_limit: float, steps: int = 0) -> list[Point]:
    """One run per (seed, η, loss); with ``steps``, each runs that many steps whatever
    the time (AReaL's Table 2 compares at equal steps), else for ``time_limit`` seconds."""
    budget = (
        [f"rl.max_steps={steps}", "time_limit_s=0"] if steps else [f"time_limit_s={time_limit}"]
    )
    points = []
    for seed in seeds:
        for eta in etas:
            for decoupled in (True, False):
                if eta == "0" and not decoupled:
                    continue  # the same objective as decoupled at η = 0
                name = f"eta{eta}-{'dec' if decoupled else 'std'}-s{seed}"
                overrides = [
                    f"buffer.max_staleness={eta}",
                    f"rl.loss.use_decoupled_loss={decoupled}",
                    f"seed={seed}",
                    *budget,
                ]
                points.append(
                    Point(name, overrides, {"eta": eta, "decoupled": decoupled, "seed": seed})
                )
    return points


def plot(results: list[dict], out: Path, etas: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(decoupled: bool) -> list[dict]:
        return [r for r in results if r["decoupled"] == decoupled or r["eta"] == "0"]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in series(True):
        t, acc = zip(*r["evals"]) if r["evals"] else ((), ())
        ax.plot(t, acc, label=f"η={r['eta']} (seed {r['seed']})")
    ax.set(
        xlabel="wall time (s)",
        ylabel="held-out accuracy",
        title="accuracy against time, decoupled loss",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_time.png", dpi=120)

    def mean_by_eta(rows: list[dict], key: str) -> list[float | None]:
        values = []
        for eta in etas:
            got = [r[key] for r in rows if r["eta"] == eta and r[key] is not None]
            values.append(sum(got) / len(got) if got else None)
        return values

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("trained_tokens_per_s", "trained"),
        ("generated_tokens_per_s", "generated"),
    ):
        ys = mean_by_eta(series(True), key)
        ax.plot(etas, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    ax.set(xlabel="η (max staleness)", ylabel="tokens/s", title="throughput against η")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_eta.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for decoupled, label in ((True, "decoupled PPO"), (False, "standard PPO (behavior = old)")):
        ys = mean_by_eta(series(decoupled), "final_eval_accuracy")
        ax.plot(etas, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    ax.set(
        xlabel="η (max staleness)",
        ylabel="final held-out accuracy",
        title="final accuracy against η",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "final_accuracy_vs_eta.png", dpi=120)
    plt.close("all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="experiments/tiny_grpo.py")
    parser.add_argument(
        "--etas", default="0,1,2,4,8,none", help="comma-separated; none = unbounded"
    )
    parser.add_argument("--seeds", default="0")
    parser.add_argument(
        "--time-limit", type=float, default=270.0, help="seconds of training per run"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="run every point for this many steps instead of --time-limit seconds",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=3600.0, help="seconds before a --steps run is killed"
    )
    parser.add_argument(
        "--targets", default="0.45,0.5", help="accuracy targets for seconds_to_target"
    )
    add_set_argument(parser)
    parser.add_argument("--out", default="runs/studies/staleness")
    args = parser.parse_args(argv)
    etas = [e.strip().lower() for e in args.etas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    out = Path(args.out)
    points = points_for(etas, seeds, args.time_limit, args.steps)
    for point in points:
        point.overrides += args.set
    timeout = args.run_timeout if args.steps else args.time_limit + 600
    results = run_points(args.experiment, points, out, targets, timeout_s=timeout)
    write_csv(results, out / "results.csv")
    plot(results, out, etas)
    table = [
        {
            k: r[k]
            for k in (
                "eta",
                "decoupled",
                "seed",
                "steps",
                "trained_tokens_per_s",
                "generated_tokens_per_s",
                "generator_idle_fraction",
                "trainer_idle_fraction",
                "final_eval_accuracy",
                "s_to_target",
                "staleness_histogram",
            )
        }
        for r in results
    ]
    print(json.dumps({"study": "staleness", "out": str(out), "runs": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
