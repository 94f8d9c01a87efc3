"""Keep a run's processes going, the same way on one machine and inside a Slurm job.

Each ``Supervised`` is one command line with its own log (``RUN_DIR/logs/NAME.log``)
and pid file (``RUN_DIR/pids/NAME.pid``, rewritten at each start): ``python -m MODULE``
under ``launch/local.py``, an ``srun`` step under ``asyncrl.launcher.slurm_job`` (which
overrides how a step is stopped, and whose tasks write their pid files themselves).
``supervise`` polls them:

- a restartable one (a generator) that dies is started again and rejoins; one that
  exits with ``EXIT_DRAINED`` left the run on purpose (its leases went back to the
  buffer) and is not;
- one in a restart group that dies takes its group down and up again: the buffer alone
  (it restores its saved state and write-ahead log), or all trainer ranks together (one
  dead rank would hang the others in a collective; they resume from the newest
  checkpoint), while the rest of the run keeps going;
- a restartable one whose loop stalls (frozen, wedged) counts as dead: it is told a file,
  ``RUN_DIR/alive/NAME`` (``ALIVE_FILE_ENV``), to touch as its loop turns (``AliveMark``);
  once it has, a mark older than ``stall_s`` gets it SIGKILLed and restarted;
- any other death, one past its restart budget, or one with ``EXIT_FATAL`` (a process
  that says a restart cannot help: a generator whose attached server stays down) stops
  everything and prints the tail of that log;
- when every final one (the trainer) has exited 0, the rest are stopped: the run is done;
- a run still going ``HARD_STOP_GRACE_S`` past its stage's ``time_limit_s`` is stopped:
  the trainer ends at its limit by itself, between steps or while it waits for a batch,
  so only a process stuck elsewhere (a hung collective) gets here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from asyncrl.liveness import ALIVE_FILE_ENV, EXIT_DRAINED, EXIT_FATAL

EXIT_TIME_LIMIT = 124
"""``supervise``'s code when it stopped a run past its hard time limit."""
HARD_STOP_GRACE_S = 300.0
"""How long past ``time_limit_s`` a run may go on (its last evaluation, checkpoint and
export) before the launcher stops it."""
STALL_TIMEOUT_S = 60.0
"""Default seconds without a liveness mark before a process counts as stalled: far above
a loop turn (a decode step, a weight flip; weights stage on another thread), far below
what a silent hang would cost."""


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
        self.draining = False  # asked to leave the run (``drain``)
        self.left = False  # exited drained: watched no more, never restarted
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        run_dir = log_path.parent.parent
        self.pid_path = run_dir / "pids" / f"{name}.pid"
        # Only a generator's loop is watched: it alone is restarted on its own.
        self.alive_path = run_dir / "alive" / name if restartable else None
        self.mark: int | None = None  # the alive file's mtime when last seen
        self.mark_seen = 0.0  # when it last changed, on this supervisor's clock

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self.env
        if self.alive_path is not None:
            # A mark left by the previous start would read as a stall of this one.
            self.alive_path.parent.mkdir(exist_ok=True)
            self.alive_path.unlink(missing_ok=True)
            self.mark = None
            env = dict(os.environ if env is None else env, **{ALIVE_FILE_ENV: str(self.alive_path)})
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        echo = sys.stdout.buffer if self.echo else None  # e.g. rank 0 is shown by the launcher too
        self.thread = threading.Thread(
            target=_tee, args=(self.proc.stdout, open(self.log_path, "ab"), echo), daemon=True
        )
        self.thread.start()
        self.record_pid()

    def record_pid(self) -> None:
        self.pid_path.parent.mkdir(exist_ok=True)
        self.pid_path.write_text(f"{self.proc.pid}\n")

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """Ask it to stop (it writes its final state on SIGTERM)."""
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.proc.kill()

    def drain(self) -> None:
        """Ask it to leave the run without losing work (SIGUSR1: a generator hands its
        leases back to the buffer and exits with ``EXIT_DRAINED``)."""
        self.draining = True
        if self.proc is not None and self.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def copy_as(self, name: str, argv: list[str]) -> Supervised:
        """Another process like this one, under ``name`` (its own log and pid file)."""
        return type(self)(
            name,
            argv,
            self.log_path.with_name(f"{name}.log"),
            env=self.env,
            restartable=self.restartable,
            final=self.final,
            echo=self.echo,
            group=self.group,
            max_restarts=self.max_restarts,
        )

    def stalled_s(self) -> float:
        """Seconds since its liveness mark last changed; 0 until its first mark (a model
        still loading is not stalled) and for a process that is not watched. Changes are
        timed on this clock, so a compute node's clock skew does not count."""
        try:
            mark = self.alive_path.stat().st_mtime_ns if self.alive_path is not None else None
        except FileNotFoundError:
            mark = None
        if mark is None:
            return 0.0
        now = time.monotonic()
        if mark != self.mark:
            self.mark, self.mark_seen = mark, now
        return now - self.mark_seen


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


def poll_or_kill_stalled(p: Supervised, stall_s: float) -> int | None:
    """``p``'s exit code, None while it runs; one that stalled for over ``stall_s``
    (0: never) is SIGKILLed first, which also ends a stopped (SIGSTOP) process."""
    code = p.poll()
    if code is not None or stall_s <= 0 or (stalled := p.stalled_s()) <= stall_s:
        return code
    say(
        f"{p.name} stalled for {stalled:.0f} s (its loop has not marked {p.alive_path}); killing it"
    )
    p.kill()
    return p.proc.wait()


def restart(
    p: Supervised,
    code: int,
    procs: list[Supervised],
    grace_s: float,
    before_restart: Callable[[str], None] | None,
) -> None:
    """Start ``p`` again after its death, with its whole restart group if it has one."""
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


def supervise(
    procs: list[Supervised],
    grace_s: float = 10.0,
    stop: threading.Event | None = None,
    before_restart: Callable[[str], None] | None = None,
    stall_s: float = STALL_TIMEOUT_S,
    time_limit_s: float = 0.0,
    adjust: Callable[[list[Supervised]], None] | None = None,
) -> int:
    """Start ``procs`` and watch them until the final ones have all exited 0 (returns 0),
    something else died (1), ``stop`` was set, e.g. by a signal handler (143), or the run
    went ``HARD_STOP_GRACE_S`` past ``time_limit_s`` (``EXIT_TIME_LIMIT``; 0: no limit).
    ``before_restart(group)`` runs after a restart group is down, before it starts again
    (``clear_trainer_rendezvous``); ``stall_s``: see ``poll_or_kill_stalled``. ``adjust``
    runs every turn and may start processes and append them to ``procs`` or drain some
    (``asyncrl.launcher.pool``)."""
    hard_stop = time.monotonic() + time_limit_s + HARD_STOP_GRACE_S if time_limit_s > 0 else None
    for p in procs:
        p.start()
    finals = [p for p in procs if p.final]
    while True:
        if stop is not None and stop.is_set():
            say("asked to stop; stopping every process")
            stop_all(procs, grace_s)
            return 143
        if hard_stop is not None and time.monotonic() > hard_stop:
            say(
                f"the run is still going {HARD_STOP_GRACE_S:.0f} s past its time_limit_s="
                f"{time_limit_s:g}: stopping every process; last lines of the trainer's log:\n"
                + "\n".join(log_tail(p.log_path, 10) for p in finals[:1])
            )
            stop_all(procs, grace_s)
            return EXIT_TIME_LIMIT
        if adjust is not None:
            adjust(procs)
        for p in procs:
            code = poll_or_kill_stalled(p, stall_s)
            if code is None or (code == 0 and p.final) or p.left:
                continue
            if p.restartable and (code == EXIT_DRAINED or p.draining):
                p.left = True  # asked to leave, or left on its own: not restarted
                say(f"{p.name} left the run, drained (its work went back); exit code {code}")
                continue
            if stop is not None and stop.is_set():
                break  # deaths while stopping are the stop's doing
            repairable = code != EXIT_FATAL and (p.restartable or p.group)
            if repairable and p.restarts < p.max_restarts:
                restart(p, code, procs, grace_s, before_restart)
                continue
            stop_all(procs, grace_s)
            fatal = " (it cannot go on: a restart would not help)" if code == EXIT_FATAL else ""
            say(
                f"{p.name} exited with code {code}{fatal}; last lines of {p.log_path}:\n"
                f"{log_tail(p.log_path)}"
            )
            return 1
        if all(p.poll() == 0 for p in finals):
            stop_all(procs, grace_s)  # the trainer is done: the buffer and generators stop with it
            return 0
        time.sleep(0.2)


def clear_trainer_rendezvous(run_dir: Path, group: str) -> None:
    """Either launcher's ``before_restart``: trainer ranks restarted together meet anew,
    so the dead ones' rendezvous file goes (a buffer restores its own state)."""
    if group == "trainer":
        (run_dir / "rendezvous").unlink(missing_ok=True)


def stall_timeout(text: str) -> float:
    """``--stall-timeout-s``, refused early when negative."""
    seconds = float(text)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative (0 turns stall detection off)")
    return seconds


def add_stall_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stall-timeout-s",
        type=stall_timeout,
        default=STALL_TIMEOUT_S,
        help="restart a generator whose loop has not turned for this long, once it has "
        f"started turning (default {STALL_TIMEOUT_S:g}; 0: never)",
    )


def child_env(threads: int, **extra: str) -> dict[str, str]:
    """This process's environment for a child with ``threads`` OpenMP threads."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **extra)
