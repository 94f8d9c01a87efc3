"""Processes that join and leave a running run: the launcher's pools of slots for the
roles whose count can change, generators and reward servers.

The number of processes a role wants can change while the run goes on. It is read, every
turn of the supervisor, from ``RUN_DIR/control/generators`` or ``RUN_DIR/control/rewards``
(one integer, written by a user: ``echo 3 > RUN_DIR/control/generators``, or by the
elastic controller; absent: as launched). Each pool converges on its count:

- one more is started as a copy of the role's first process under the next free id
  (``generator_K``, worker id ``gK``; ``reward_K``, ``rK``; its own log): it attaches to
  the buffer and takes work like the others;
- one fewer drains the newest: ``Supervised.drain`` asks it to leave (SIGUSR1 to a local
  process, ``scancel --signal=USR1`` to a Slurm step); a generator sends every token it
  has and the buffer hands its leases to the others, a reward server answers the batch in
  hand and the buffer sends what it still held to another; it exits with
  ``EXIT_DRAINED``, which the supervisor does not restart.

A value that is not a whole number of at least 1 is reported once and ignored, and when
the last process of a role has left (SIGUSR1 by hand) another is started: a run without
generators, or with rewards to score and no server, would wait forever. Each change is
said on the launcher's output and appended to ``RUN_DIR/control/ROLE.log`` with its time.
A copy runs with the first one's environment and placement: on a GPU machine its devices,
on Slurm its node (a step that does not fit waits for CPUs the job has free).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from asyncrl.launcher.supervise import Supervised, say


class Role(NamedTuple):
    """A role whose processes a pool grows and shrinks."""

    control: str
    """Its control file, ``RUN_DIR/control/CONTROL`` (and its log, ``CONTROL.log``)."""
    prefix: str
    """Its processes' names: ``PREFIX`` and an index."""
    worker: str
    """Its worker ids (``--worker-id``): this letter and the same index."""
    noun: str
    """What its processes are called in messages."""


GENERATORS = Role("generators", "generator_", "g", "generators")
REWARDS = Role("rewards", "reward_", "r", "reward servers")
ROLES = (GENERATORS, REWARDS)


class RolePool:
    """A role's processes, grown and shrunk to the count its control file wants."""

    def __init__(self, run_dir: Path, procs: list[Supervised], role: Role = GENERATORS) -> None:
        self.role = role
        self.path = run_dir / "control" / role.control
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.history = self.path.with_name(f"{role.control}.log")
        mine = [p for p in procs if p.name.startswith(role.prefix)]
        if not mine:
            raise ValueError(f"a pool of {role.noun} needs at least one to copy")
        self.template = mine[0]
        self.next_index = 1 + max(int(p.name.removeprefix(role.prefix)) for p in mine)
        self.refused = ""  # the last control value refused, reported once

    def live(self, procs: list[Supervised]) -> list[Supervised]:
        """The role's processes in the run: neither gone nor on their way out."""
        prefix = self.role.prefix
        return [p for p in procs if p.name.startswith(prefix) and not (p.left or p.draining)]

    def wanted(self) -> int | None:
        """The control file's count; None when there is none or it cannot be used."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        if text.isdigit() and int(text) >= 1:
            return int(text)
        if text != self.refused:
            self.refused = text
            say(f"{self.path}: {text!r} is not a number of {self.role.noun} (1 or more); ignored")
        return None

    def want(self, count: int, why: str) -> None:
        """Ask for ``count`` processes, as a write of the control file by hand does."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{count}\n")
        os.replace(tmp, self.path)  # whole: the next read never sees half a number
        self._record(f"want {count}: {why}", count)

    def adjust(self, procs: list[Supervised]) -> None:
        """Start or drain processes until the live ones number what is wanted. ``procs``
        gains the new ones (the supervisor watches them from its next turn)."""
        want, live = self.wanted(), self.live(procs)
        if want is None and not live:
            want = 1  # the last one left (SIGUSR1 by hand): without one the run cannot go on
        if want is None or want == len(live):
            return
        for _ in range(want - len(live)):
            p = self._copy()
            procs.append(p)
            p.start()
            self._record(f"started {p.name}", want)
        for p in live[want:]:  # the newest leave first
            p.drain()
            self._record(f"draining {p.name}", want)

    def _copy(self) -> Supervised:
        """The first process's command under the next free name and worker id."""
        role = self.role
        k, self.next_index = self.next_index, self.next_index + 1
        old_name = self.template.name
        old_id = role.worker + old_name.removeprefix(role.prefix)
        name, argv = f"{role.prefix}{k}", list(self.template.argv)
        for i, word in enumerate(argv):
            if word == old_id and i > 0 and argv[i - 1] == "--worker-id":
                argv[i] = f"{role.worker}{k}"
            # A Slurm step's --job-name=NAME and its task's pid file .../NAME.pid.
            for old, new in ((old_name, name), (f"{old_name}.pid", f"{name}.pid")):
                if word == old or word.endswith(("=" + old, "/" + old)):
                    argv[i] = word[: len(word) - len(old)] + new
        return self.template.copy_as(name, argv)

    def _record(self, what: str, want: int) -> None:
        say(f"{self.role.control}: {what} (wanted: {want})")
        with open(self.history, "a") as f:
            f.write(f"{time.time():.3f} {what} wanted={want}\n")


def role_pools(run_dir: Path, procs: list[Supervised]) -> dict[Role, RolePool]:
    """A pool for each role the run has processes of (none for SFT or a colocated run)."""
    return {
        role: RolePool(run_dir, procs, role)
        for role in ROLES
        if any(p.name.startswith(role.prefix) for p in procs)
    }
