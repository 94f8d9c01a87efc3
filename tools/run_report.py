"""The figures of one RL run directory as ONE JSON line (``asyncrl.report`` says which).

python tools/run_report.py RUN_DIR [--minutes 0,2,5,10]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.report import report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print one JSON line of a run's figures.")
    parser.add_argument("run_dir")
    parser.add_argument("--minutes", default="0,2,5,10", help="minute marks for accuracy_at_min")
    args = parser.parse_args(argv)
    minutes = [float(m) for m in args.minutes.split(",") if m.strip()]
    print(json.dumps(report(args.run_dir, minutes)))


if __name__ == "__main__":
    main()
