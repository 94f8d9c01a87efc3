"""Run an experiment on this machine.

    python launch/local.py experiments/NAME.py [key.sub=value ...] [--print-config] [--share-gpus]
        [--stall-timeout-s S]

Loads the experiment file's ``config``, applies the overrides (each parsed into its
field's type; a bad key or value stops here with a message naming it), computes derived
values, saves the resolved config as ``RUN_DIR/config.json``, then starts the
experiment's processes (trainer ranks; for RL also the buffer and the generators), each
with its own log under ``RUN_DIR/logs/`` and its own GPUs on a GPU machine (trainer
ranks, then each generator with its servers' tensor-parallel GPUs; more wanted than there
are stops here unless ``--share-gpus``: ``asyncrl.launcher.devices``). Rank 0's output is
also shown here.
A generator that dies is restarted and rejoins; a dead buffer is restarted from its saved
state and write-ahead log, dead trainer ranks (all of them together) from their newest checkpoint,
while the other processes keep running; a generator whose loop has not turned for
``--stall-timeout-s`` is killed and restarted; a process that keeps dying stops the run
with the tail of its log. The run ends when the trainer ranks finish; Ctrl-C stops everything.
Generators join and leave while the run goes on: ``echo N > RUN_DIR/control/generators``
(``asyncrl.launcher.pool``).
When an output the experiment starts from is missing (its ``prerequisites()``, e.g. the
SFT policy), the experiment that makes it runs first. ``launch/slurm.py`` runs the same files on a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from asyncrl.config import ConfigError, to_dict
from asyncrl.launcher.devices import local_devices
from asyncrl.launcher.elastic import run_adjuster
from asyncrl.launcher.prepare import Prepared, clear_rendezvous, prepare, stage_chain
from asyncrl.launcher.supervise import (
    STALL_TIMEOUT_S,
    Supervised,
    add_stall_option,
    child_env,
    clear_trainer_rendezvous,
    supervise,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiment", help="experiments/NAME.py, a file that defines `config`")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--share-gpus",
        action="store_true",
        help="let processes share GPUs when they want more than there are (small models)",
    )
    add_stall_option(parser)
    return parser.parse_intermixed_args(argv)


def local_processes(stage: Prepared, devices: dict[str, str] | None = None) -> list[Supervised]:
    """Each process of the stage as ``python -m MODULE``; trainer ranks are numbered here
    and meet through the rendezvous file in the run directory. ``devices``: each one's
    ``CUDA_VISIBLE_DEVICES`` (default: ``asyncrl.launcher.devices.local_devices``)."""
    world = stage.cfg.trainer.num_ranks
    devices = local_devices(stage.cfg, stage.processes) if devices is None else devices
    procs = []
    for spec in stage.processes:
        env = child_env(spec.threads)
        if spec.name in devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[spec.name]
        if spec.rank is not None:
            env.update(RANK=str(spec.rank), WORLD_SIZE=str(world), LOCAL_RANK=str(spec.rank))
            env.pop("MASTER_ADDR", None)  # local ranks meet through the rendezvous file
        procs.append(
            Supervised(
                spec.name,
                [sys.executable, "-m", spec.module, *spec.args],
                stage.run_dir / "logs" / f"{spec.name}.log",
                env=env,
                restartable=spec.restartable,
                final=spec.rank is not None,
                echo=spec.rank == 0,
                group=spec.group,
                max_restarts=spec.max_restarts,
            )
        )
    return procs


def run_stage(
    stage: Prepared, devices: dict[str, str] | None = None, stall_s: float = STALL_TIMEOUT_S
) -> int:
    print(f"[launch] run directory: {stage.run_dir}", flush=True)
    clear_rendezvous(stage.run_dir)
    # One id per launch: trainer ranks restarted within it keep the stage's clock.
    os.environ["ASYNCRL_LAUNCH_ID"] = f"{os.getpid()}-{time.time_ns()}"
    procs = local_processes(stage, devices)
    # SIGTERM (kill, a batch system) and SIGINT (Ctrl-C; also `kill -INT`, which a shell
    # ignores for its background jobs unless handled) both stop every process of the run.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    adjust = run_adjuster(stage.run_dir, procs)  # generators joining and leaving
    code = supervise(
        procs,
        stop=stop,
        before_restart=lambda group: clear_trainer_rendezvous(stage.run_dir, group),
        stall_s=stall_s,
        time_limit_s=stage.cfg.time_limit_s,
        adjust=adjust,
    )
    if stop.is_set():
        print("\n[launch] interrupted; stopped every process", file=sys.stderr)
        return 130
    summary = stage.run_dir / "summary.json"
    if code == 0 and summary.exists():
        print(f"[launch] done: {summary.read_text().strip()}")
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        chain = stage_chain(args.experiment, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(chain[-1]), indent=2))
        return 0
    for before, cfg in zip([None, *chain], chain):
        if before is not None:
            print(f"[launch] {before.run_dir} done; starting {cfg.name}", flush=True)
        elif len(chain) > 1:
            # What the experiment starts from comes from other stages (e.g. SFT before RL).
            names = ", ".join(c.name for c in chain[:-1])
            print(
                f"[launch] {chain[-1].name} needs outputs of {names}: running them first",
                flush=True,
            )
        try:
            prepared = prepare(cfg)
            # More GPUs wanted than there are stops here, before any process starts.
            devices = local_devices(prepared.cfg, prepared.processes, args.share_gpus)
        except ConfigError as e:  # a check that needed this stage's inputs (preflight)
            print(f"error: {e}", file=sys.stderr)
            return 2
        code = run_stage(prepared, devices, args.stall_timeout_s)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
