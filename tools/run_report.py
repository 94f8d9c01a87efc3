"""The figures of one RL run directory as ONE JSON line (``asyncrl.report`` says which).

    python tools/run_report.py RUN_DIR [--minutes 0,2,5,10] [--plot roles.png]

``--plot`` draws, for an elastic run, trained tokens/s over time above the role counts
(generators and, where the run has them, reward servers and lending the trainer's waits,
0 or 1), so each move sits under what it did to throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.metrics import read_metrics  # noqa: E402
from asyncrl.report import report  # noqa: E402


def plot_roles(run_dir: str, out: Path) -> None:
    """Throughput and role counts over the controller's checks (its own clock)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checks = [r for r in read_metrics(run_dir) if r["process"] == "controller"]
    if not checks:
        raise SystemExit(f"{run_dir}: no controller checks (not a placement=elastic run)")
    t = [r["time"] for r in checks]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(t, [r["elastic/trained_tokens_per_s"] for r in checks])
    top.set(ylabel="trained tokens/s", title=f"{Path(run_dir).name}: throughput and roles")
    for key, label in (
        ("elastic/generators", "generators"),
        ("elastic/reward_servers", "reward servers"),
        ("elastic/lending", "lending the trainer's waits"),
    ):
        if key in checks[0]:
            bottom.step(t, [r[key] for r in checks], where="post", label=label)
    bottom.set(xlabel="controller time (s)", ylabel="processes (lending: 0 or 1)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print one JSON line of a run's figures.")
    parser.add_argument("run_dir")
    parser.add_argument("--minutes", default="0,2,5,10", help="minute marks for accuracy_at_min")
    parser.add_argument("--plot", type=Path, help="PNG of throughput and roles over time")
    args = parser.parse_args(argv)
    minutes = [float(m) for m in args.minutes.split(",") if m.strip()]
    if args.plot:
        plot_roles(args.run_dir, args.plot)
    print(json.dumps(report(args.run_dir, minutes)))


if __name__ == "__main__":
    main()
