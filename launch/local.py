"""Run an experiment on this machine.

    python launch/local.py experiments/NAME.py [key.sub=value ...] [--print-config]

Loads the experiment file's ``config``, applies the overrides (each parsed into its
field's type; a bad key or value stops here with a message naming it), computes derived
values, saves the resolved config as ``RUN_DIR/config.json``, then starts the stage's
trainer ranks as processes, each with its own log under ``RUN_DIR/logs/``. Rank 0's
output is also shown here. If a rank dies, the others are stopped and the tail of its
log is printed; Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncrl.config import ConfigError, apply_overrides, load_experiment, save_json, to_dict
from asyncrl.stages.common import threads_for


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiment", help="experiments/NAME.py, a file that defines `config`")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    return parser.parse_args(argv)


def resolve(experiment: str, overrides: list[str]):
    cfg = load_experiment(experiment)
    apply_overrides(cfg, overrides)
    cfg.finalize()
    return cfg


def _tee(stream, log_file, echo) -> None:
    with log_file:
        for line in iter(stream.readline, b""):
            log_file.write(line)
            log_file.flush()
            if echo is not None:
                echo.write(line)
                echo.flush()


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def start_ranks(cfg, config_path: Path) -> list[tuple[subprocess.Popen, Path, threading.Thread]]:
    run_dir = Path(cfg.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # gloo's file rendezvous must start from a fresh file.
    (run_dir / "rendezvous").unlink(missing_ok=True)
    world = cfg.trainer.num_ranks
    threads = threads_for(cfg.trainer.threads_per_rank, world)
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS=str(threads),
            PYTHONUNBUFFERED="1",
        )
        env.pop("MASTER_ADDR", None)  # local ranks meet through the rendezvous file
        log_path = logs / f"trainer_{rank}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", cfg.entry, "--config", str(config_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        log_file = open(log_path, "ab")
        echo = sys.stdout.buffer if rank == 0 else None
        thread = threading.Thread(target=_tee, args=(proc.stdout, log_file, echo), daemon=True)
        thread.start()
        procs.append((proc, log_path, thread))
    return procs


def stop_all(procs, grace_s: float = 10.0) -> None:
    for proc, _, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for proc, _, _ in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def supervise(procs) -> int:
    """Wait for every rank; on the first failure stop the rest and report it."""
    while True:
        codes = [proc.poll() for proc, _, _ in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            stop_all(procs)
            for _, _, thread in procs:
                thread.join(timeout=2)
            log_path = procs[rank][1]
            print(
                f"\n[launch] trainer rank {rank} exited with code {code}; last lines of {log_path}:\n"
                f"{log_tail(log_path)}",
                file=sys.stderr,
            )
            return 1
        if all(c == 0 for c in codes):
            for _, _, thread in procs:
                thread.join(timeout=5)
            return 0
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve(args.experiment, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    save_json(cfg, config_path)
    print(f"[launch] run directory: {run_dir}", flush=True)
    procs = start_ranks(cfg, config_path)
    try:
        code = supervise(procs)
    except KeyboardInterrupt:
        print("\n[launch] interrupted; stopping every process", file=sys.stderr)
        stop_all(procs)
        return 130
    summary = run_dir / "summary.json"
    if code == 0 and summary.exists():
        print(f"[launch] done: {summary.read_text().strip()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
