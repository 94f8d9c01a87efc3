"""Studies: many runs of one experiment under different overrides, side by side.

``tools/staleness_study.py`` and ``tools/throughput_study.py`` describe their points
(a name and the overrides that make it) and call ``run_points``: each point is one real
run of ``launch/local.py`` in ``STUDY_DIR/NAME`` with its output in ``launch.log``,
run one after another so they never share the cores, and read back through
``asyncrl.report``. A point whose run directory already holds a ``summary.json`` is not
run again, so an interrupted study resumes where it stopped. Results go to a CSV (one
row per point, nested figures flattened) and the caller draws its plots.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.metrics import read_metrics
from asyncrl.report import report, seconds_to

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Point:
    """One run of a study."""

    name: str
    """Names its run directory, ``STUDY_DIR/NAME``."""
    overrides: list[str]
    """``key=value`` overrides of the experiment (``run_dir`` is added here)."""
    labels: dict[str, Any] = field(default_factory=dict)
    """What the point varies (η, decoupled, seed …), copied into its CSV row."""


def add_set_argument(parser) -> None:
    """``--set KEY=VALUE ...``: overrides every run of a study gets (e.g. a smaller batch)."""
    parser.add_argument(
        "--set",
        nargs="*",
        action="extend",  # --set a=1 --set b=2 keeps both
        default=[],
        metavar="KEY=VALUE",
        help="overrides applied to every run (e.g. a smaller batch)",
    )


def evals_of(run_dir: Path) -> list[tuple[float, float]]:
    """``(trainer seconds, held-out accuracy)`` of every evaluation of a run."""
    return [
        (r["time"], r["eval/accuracy"])
        for r in read_metrics(run_dir)
        if r["process"] == "trainer" and "eval/accuracy" in r
    ]


def run_points(
    experiment: str, points: list[Point], study_dir: Path, targets: list[float], timeout_s: float
) -> list[dict[str, Any]]:
    """Run each point (or reuse its finished run) and return one result per point: its
    labels, the ``asyncrl.report`` figures, the evaluations and the seconds to each
    accuracy target (None: not reached)."""
    study_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i, point in enumerate(points):
        run_dir = study_dir / point.name
        if not (run_dir / "summary.json").exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            started = time.time()
            print(
                f"[study] {i + 1}/{len(points)} {point.name}: {' '.join(point.overrides)}",
                flush=True,
            )
            with open(run_dir / "launch.log", "w") as log:
                code = subprocess.run(
                    [
                        sys.executable,
                        str(ROOT / "launch" / "local.py"),
                        experiment,
                        f"run_dir={run_dir}",
                        *point.overrides,
                    ],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                ).returncode
            if code != 0:
                raise RuntimeError(f"{point.name} exited with {code}; see {run_dir / 'launch.log'}")
            print(f"[study] {point.name} done in {time.time() - started:.0f} s", flush=True)
        evals = evals_of(run_dir)
        figures = report(run_dir, [0, 1, 2, 5, 10])
        results.append(
            {
                "name": point.name,
                **point.labels,
                **figures,
                "evals": evals,
                "s_to_target": {f"{t:g}": seconds_to(evals, t) for t in targets},
            }
        )
    return results


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a.b`` columns; lists as JSON text."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        elif isinstance(v, list):
            out[f"{prefix}{k}"] = json.dumps(v)
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_csv(
    results: list[dict[str, Any]], path: Path, drop: tuple[str, ...] = ("generators", "evals")
) -> None:
    rows = [flatten({k: v for k, v in r.items() if k not in drop}) for r in results]
    columns = list(dict.fromkeys(c for row in rows for c in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
