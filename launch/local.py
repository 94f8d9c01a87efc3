"""Run an experiment on this machine.

    python launch/local.py experiments/NAME.py [key.sub=value ...] [--print-config]

Loads the experiment file's ``config``, applies the overrides (each parsed into its
field's type; a bad key or value stops here with a message naming it), computes derived
values, saves the resolved config as ``RUN_DIR/config.json``, then starts the
experiment's processes (trainer ranks; for RL also the buffer and the generators), each
with its own log under ``RUN_DIR/logs/``. Rank 0's output is also shown here. A generator
that dies is restarted and rejoins; any other death stops the run with the tail of that
process's log. The run ends when the trainer ranks finish; Ctrl-C stops everything.
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
from asyncrl.stages.common import ProcessSpec


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


class Running:
    """One started process: its spec, Popen, log and the thread copying its output."""

    def __init__(self, spec: ProcessSpec, run_dir: Path, world: int) -> None:
        self.spec, self.restarts = spec, 0
        self.log_path = run_dir / "logs" / f"{spec.name}.log"
        self.start(world)

    def start(self, world: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.spec.threads), PYTHONUNBUFFERED="1")
        if self.spec.rank is not None:
            env.update(
                RANK=str(self.spec.rank), WORLD_SIZE=str(world), LOCAL_RANK=str(self.spec.rank)
            )
            env.pop("MASTER_ADDR", None)  # local ranks meet through the rendezvous file
        self.proc = subprocess.Popen([sys.executable, "-m", self.spec.module, *self.spec.args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        echo = sys.stdout.buffer if self.spec.rank == 0 else None  # rank 0 is shown here too
        self.thread = threading.Thread(target=_tee, args=(self.proc.stdout, open(self.log_path, "ab"), echo),
                                       daemon=True)  # fmt: skip
        self.thread.start()


def start_all(cfg, config_path: Path) -> list[Running]:
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "rendezvous").unlink(missing_ok=True)  # gloo's file rendezvous starts fresh
    for stale in (run_dir / "endpoints").glob("*.json"):
        stale.unlink()  # endpoints of an earlier launch on this run directory
    world = cfg.trainer.num_ranks
    return [Running(spec, run_dir, world) for spec in cfg.processes(str(config_path))]


def stop_all(running: list[Running], grace_s: float = 10.0) -> None:
    for r in running:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for r in running:
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
    for r in running:
        r.thread.join(timeout=2)


def supervise(running: list[Running], world: int, max_restarts: int = 20) -> int:
    """Until every trainer rank has exited 0: restart dead generators; any other death
    stops the run with the tail of that process's log."""
    trainers = [r for r in running if r.spec.rank is not None]
    while True:
        for r in running:
            code = r.proc.poll()
            if code is None or (code == 0 and r.spec.rank is not None):
                continue
            if r.spec.restartable and r.restarts < max_restarts:
                r.restarts += 1
                print(
                    f"[launch] {r.spec.name} exited with code {code}; restart {r.restarts}",
                    file=sys.stderr,
                )
                r.start(world)
                continue
            stop_all(running)
            print(f"\n[launch] {r.spec.name} exited with code {code}; last lines of {r.log_path}:\n"
                  f"{log_tail(r.log_path)}", file=sys.stderr)  # fmt: skip
            return 1
        if all(r.proc.poll() == 0 for r in trainers):
            stop_all(running)  # the trainer is done: the buffer and generators stop with it
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
    first = getattr(cfg, "init_from_experiment", "")
    if first and not Path(cfg.model.path).exists():
        # The starting checkpoint comes from another stage (e.g. SFT before RL): run it first.
        print(f"[launch] {cfg.model.path} is missing: running {first} first", flush=True)
        code = main([first])
        if code != 0:
            return code
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    save_json(cfg, config_path)
    print(f"[launch] run directory: {run_dir}", flush=True)
    running = start_all(cfg, config_path)
    try:
        code = supervise(running, cfg.trainer.num_ranks)
    except KeyboardInterrupt:
        print("\n[launch] interrupted; stopping every process", file=sys.stderr)
        stop_all(running)
        return 130
    summary = run_dir / "summary.json"
    if code == 0 and summary.exists():
        print(f"[launch] done: {summary.read_text().strip()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
