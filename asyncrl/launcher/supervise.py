"""Keep a run's processes going, the same way on one machine and inside a Slurm job.

Each ``Supervised`` is one command line with its own log (``RUN_DIR/logs/NAME.log``)
and pid file (``RUN_DIR/pids/NAME.pid``, rewritten at each start): ``python -m MODULE``
under ``launch/local.py``, an ``srun`` step under ``asyncrl.launcher.slurm_job`` (which
overrides how a step is stopped). ``supervise`` polls them:

- a restartable one (a generator) that dies is started again and rejoins;
- one in a restart group that dies takes its group down and up again: the buffer alone
  (it restores its saved state and write-ahead log), or all trainer ranks together (one
  dead rank would hang the others in a collective; they resume from the newest
  checkpoint), while the rest of the run keeps going;
- any other death, or one past its restart budget, stops everything and prints the tail
  of that log;
- when every final one (the trainer) has exited 0, the rest are stopped: the run is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _tee(stream: BinaryIO, log_file: BinaryIO, echo: BinaryIO | None) -> None:
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


def say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


class Supervised:
    """One command line of a run: its log, whether a death is repaired by a restart, and
    whether the run ends when it exits (``final``: the trainer)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        restartable: bool = False,
        final: bool = False,
        echo: bool = False,
        group: str = "",
        max_restarts: int = 20,
    ) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.restartable, self.final, self.echo = restartable, final, echo
        self.group, self.max_restarts = group, max_restarts
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        echo = sys.stdout.buffer if self.echo else None  # e.g. rank 0 is shown by the launcher too
        self.thread = threading.Thread(
            target=_tee, args=(self.proc.stdout, open(self.log_path, "ab"), echo), daemon=True
        )
        self.thread.start()
        pids = self.log_path.parent.parent / "pids"
        pids.mkdir(exist_ok=True)
        (pids / f"{self.name}.pid").write_text(f"{self.proc.pid}\n")

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """Ask it to stop (it writes its final state on SIGTERM)."""
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.proc.kill()


def stop_all(procs: list[Supervised], grace_s: float = 10.0) -> None:
    """SIGTERM to every live process, SIGKILL to those still alive after ``grace_s``."""
    for p in procs:
        if p.proc is not None and p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        if p.proc is None:
            continue
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            say(f"{p.name} did not stop within {grace_s:.0f} s; killing it")
            p.kill()
            p.proc.wait()
    for p in procs:
        if p.thread is not None:
            p.thread.join(timeout=2)


def supervise(
    procs: list[Supervised],
    grace_s: float = 10.0,
    stop: threading.Event | None = None,
    before_restart: Callable[[str], None] | None = None,
) -> int:
    """Start ``procs`` and watch them until the final ones have all exited 0 (returns 0),
    something else died (1) or ``stop`` was set, e.g. by a signal handler (143).
    ``before_restart(group)`` runs after a restart group is down, before it starts again
    (the local launcher removes the trainer ranks' rendezvous file there)."""
    for p in procs:
        p.start()
    finals = [p for p in procs if p.final]
    while True:
        if stop is not None and stop.is_set():
            say("asked to stop; stopping every process")
            stop_all(procs, grace_s)
            return 143
        for p in procs:
            code = p.poll()
            if code is None or (code == 0 and p.final):
                continue
            if stop is not None and stop.is_set():
                break  # deaths while stopping are the stop's doing
            if (p.restartable or p.group) and p.restarts < p.max_restarts:
                group = [q for q in procs if q.group == p.group] if p.group else [p]
                say(
                    f"{p.name} exited with code {code}; restart {p.restarts + 1} of "
                    f"{', '.join(q.name for q in group)}; last lines of {p.log_path}:\n"
                    f"{log_tail(p.log_path, 10)}"
                )
                stop_all([q for q in group if q is not p], grace_s)
                if p.group and before_restart is not None:
                    before_restart(p.group)
                for q in group:
                    q.restarts += 1
                    q.start()
                continue
            stop_all(procs, grace_s)
            say(
                f"{p.name} exited with code {code}; last lines of {p.log_path}:\n{log_tail(p.log_path)}"
            )
            return 1
        if all(p.poll() == 0 for p in finals):
            stop_all(procs, grace_s)  # the trainer is done: the buffer and generators stop with it
            return 0
        time.sleep(0.2)


def child_env(threads: int, **extra: str) -> dict[str, str]:
    """This process's environment for a child with ``threads`` OpenMP threads."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **extra)
