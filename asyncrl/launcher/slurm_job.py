"""The body of an asyncrl Slurm job: starts the ``srun`` steps and supervises them.

    python -m asyncrl.launcher.slurm_job RUN_DIR < STEPS

The batch script that ``launch/slurm.py`` writes resolves the allocation's node names and
pipes in one step a line, ``NAME POLICY srun ...`` (POLICY: comma-separated options,
``parse_policy``: ``restart`` for a generator, ``group=buffer`` or ``group=trainer`` with
``max_restarts=N``, ``final`` for the trainer, or ``once``). Each step runs as a child
``srun`` with its log in ``RUN_DIR/logs/NAME.log`` (the trainer's is echoed to the job's
output) and is supervised like a local process (``asyncrl.launcher.supervise``): a dead
or stalled generator step is started again, a dead buffer step too (it restores its
state), a dead trainer step (all its ranks: ``--kill-on-bad-exit``) resumes from the
newest checkpoint, a death past its budget or of a ``once`` step ends the job with the
tail of its log, and the job ends once the trainer step exits 0. Generator steps join
and leave while the job goes on (``RUN_DIR/control/generators``, ``asyncrl.launcher.pool``):
a new one is another ``srun --exact`` step in the same allocation.

Stopping a step: a SIGTERM to ``srun`` makes it kill its tasks outright, so the tasks get
their SIGTERM from ``scancel --signal=TERM JOB.STEP`` instead and write their final state
(the buffer its counters); whatever still runs after the grace period is cancelled. On
``scancel`` of the job Slurm sends SIGTERM to this process and to every step's tasks; the
handler stops the steps the same way and waits for them.

``ASYNCRL_PRINT_STEPS=1`` prints the steps, as the script resolved them, as JSON and
exits: ``SLURM_JOB_NODELIST='n[1-4]' SLURM_JOB_ID=1 ASYNCRL_PRINT_STEPS=1 bash JOB.sbatch``
shows a script's placement without a cluster job.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncrl.launcher.elastic import run_adjuster
from asyncrl.launcher.prepare import clear_rendezvous
from asyncrl.launcher.supervise import (
    Supervised,
    add_stall_option,
    clear_trainer_rendezvous,
    say,
    supervise,
)


class SlurmStep(Supervised):
    """A child ``srun``; stopped through ``scancel`` on its step id. Its task writes its
    own pid file (``asyncrl.launcher.pidfile``): srun's pid is not the process's."""

    def record_pid(self) -> None:
        pass

    def step_id(self) -> str | None:
        """This step's newest id in the job (None before Slurm has created it). The name
        column is widened: squeue cuts it to 8 characters by default."""
        job = os.environ["SLURM_JOB_ID"]
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", job, "-o", "%i %200j"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        ids = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [self.name]]
        ids = [i for i in ids if i.split(".")[-1].isdigit()]
        return max(ids, key=lambda i: int(i.split(".")[-1]), default=None)

    def _scancel(self, *flags: str) -> bool:
        step = self.step_id()
        if step is not None:
            subprocess.run(["scancel", *flags, step], capture_output=True, timeout=30)
        return step is not None

    def terminate(self) -> None:
        if not self._scancel("--signal=TERM"):
            self.proc.kill()  # no step yet: srun is still waiting for resources, nothing ran

    def drain(self) -> None:
        # To the task itself: srun would take a signal as one to pass on or to end by.
        self.draining = True
        if not self._scancel("--signal=USR1"):
            self.proc.kill()  # no step yet: srun is still waiting for resources, nothing ran

    def kill(self) -> None:
        # SIGKILL at once (a plain scancel sends SIGTERM first and waits), which also ends
        # a stopped task; then srun, which would otherwise linger for the step's end.
        self._scancel("--signal=KILL")
        self.proc.kill()


def parse_policy(word: str) -> dict:
    """A step's POLICY word (``asyncrl.launcher.sbatch.step_policy``) as ``Supervised``
    keyword arguments; raises ValueError on an option it does not know."""
    options: dict = {}
    for option in word.split(","):
        key, _, value = option.partition("=")
        if option in ("restart", "final"):
            options["restartable" if option == "restart" else "final"] = True
        elif key == "group" and value:
            options["group"] = value
        elif key == "max_restarts" and value.isdigit():
            options["max_restarts"] = int(value)
        elif option != "once":
            raise ValueError(f"unknown step option {option!r}")
    return options


def parse_steps(text: str) -> list[tuple[str, dict, list[str]]]:
    """(name, ``parse_policy`` options, srun argv) per step line."""
    steps = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, policy, *argv = shlex.split(line)
        try:
            options = parse_policy(policy)
        except ValueError as e:
            raise ValueError(f"bad step line (want NAME POLICY COMMAND...): {e}: {line}") from e
        if not argv:
            raise ValueError(f"bad step line (no command): {line}")
        steps.append((name, options, argv))
    return steps


def stage_time_limit(run_dir: Path) -> float:
    """The stage's ``time_limit_s`` from its resolved config (0 when it has none)."""
    path = run_dir / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return float(config.get("time_limit_s") or 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Supervise an asyncrl job's srun steps (read from stdin)."
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--grace-s", type=float, default=20.0, help="SIGTERM to SIGKILL, per stop")
    add_stall_option(parser)
    args = parser.parse_args(argv)
    steps = parse_steps(sys.stdin.read())
    if os.environ.get("ASYNCRL_PRINT_STEPS"):
        print(json.dumps([{"name": n, "policy": p, "argv": a} for n, p, a in steps], indent=2))
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    clear_rendezvous(args.run_dir)  # what an earlier job on this run directory left
    os.environ["ASYNCRL_LAUNCH_ID"] = (
        f"{os.environ.get('SLURM_JOB_ID', os.getpid())}-{time.time_ns()}"
    )
    procs = [
        SlurmStep(name, argv, args.run_dir / "logs" / f"{name}.log", echo="final" in opts, **opts)
        for name, opts, argv in steps
    ]
    for p in procs:
        say(f"step {p.name}: {shlex.join(p.argv)}")
    adjust = run_adjuster(args.run_dir, procs)  # generators joining and leaving
    code = supervise(
        procs,
        grace_s=args.grace_s,
        stop=stop,
        before_restart=lambda group: clear_trainer_rendezvous(args.run_dir, group),
        stall_s=args.stall_timeout_s,
        time_limit_s=stage_time_limit(args.run_dir),
        adjust=adjust,
    )
    summary = args.run_dir / "summary.json"
    if code == 0:
        say(f"done: {summary.read_text().strip() if summary.exists() else 'no summary.json'}")
    elif code == 143:
        say("stopped: every step has ended")
    return code


if __name__ == "__main__":
    sys.exit(main())
