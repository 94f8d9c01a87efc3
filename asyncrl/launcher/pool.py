"""Generators that join and leave a running run: the launcher's pool of generator slots.

The number of generators a run wants can change while it goes on. It is read, every turn
of the supervisor, from ``RUN_DIR/control/generators`` (one integer, written by a user:
``echo 3 > RUN_DIR/control/generators``, or by a controller; absent: as launched). The
pool converges on it:

- one more is started as a copy of the run's first generator under the next free id
  (``generator_K``, worker id ``gK``, its own log): it attaches to the buffer and takes
  leases like the others;
- one fewer drains the newest: ``Supervised.drain`` asks it to leave (SIGUSR1 to a local
  process, ``scancel --signal=USR1`` to a Slurm step); it sends every token it has, the
  buffer hands its leases to the others, and it exits with ``EXIT_DRAINED``, which the
  supervisor does not restart.

A value that is not a whole number of at least 1 is reported once and ignored, and when
the last generator has left (SIGUSR1 by hand) another is started: a run without
generators would wait forever. Each change is said on the launcher's output and appended
to ``RUN_DIR/control/generators.log`` with its time. A copy runs with the first
generator's environment and placement: on a GPU machine its devices, on Slurm its node
(a step that does not fit waits for CPUs the job has free).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from asyncrl.launcher.supervise import Supervised, say

PREFIX = "generator_"


class GeneratorPool:
    """The run's generator processes, grown and shrunk to the count the control file wants."""

    def __init__(self, run_dir: Path, procs: list[Supervised]) -> None:
        self.path = run_dir / "control" / "generators"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.history = self.path.with_name("generators.log")
        generators = [p for p in procs if p.name.startswith(PREFIX)]
        if not generators:
            raise ValueError("a generator pool needs at least one generator to copy")
        self.template = generators[0]
        self.next_index = 1 + max(int(p.name.removeprefix(PREFIX)) for p in generators)
        self.refused = ""  # the last control value refused, reported once

    def live(self, procs: list[Supervised]) -> list[Supervised]:
        """The generators in the run: neither gone nor on their way out."""
        return [p for p in procs if p.name.startswith(PREFIX) and not (p.left or p.draining)]

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
            say(f"{self.path}: {text!r} is not a number of generators (1 or more); ignored")
        return None

    def want(self, count: int, why: str) -> None:
        """Ask for ``count`` generators, as a write of the control file by hand does."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{count}\n")
        os.replace(tmp, self.path)  # whole: the next read never sees half a number
        self._record(f"want {count}: {why}", count)

    def adjust(self, procs: list[Supervised]) -> None:
        """Start or drain generators until the live ones number what is wanted. ``procs``
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
        """The first generator's command under the next free name and worker id."""
        k, self.next_index = self.next_index, self.next_index + 1
        old_name, old_id = self.template.name, "g" + self.template.name.removeprefix(PREFIX)
        name, argv = f"{PREFIX}{k}", list(self.template.argv)
        for i, word in enumerate(argv):
            if word == old_id and i > 0 and argv[i - 1] == "--worker-id":
                argv[i] = f"g{k}"
            # A Slurm step's --job-name=NAME and its task's pid file .../NAME.pid.
            for old, new in ((old_name, name), (f"{old_name}.pid", f"{name}.pid")):
                if word == old or word.endswith(("=" + old, "/" + old)):
                    argv[i] = word[: len(word) - len(old)] + new
        return self.template.copy_as(name, argv)

    def _record(self, what: str, want: int) -> None:
        say(f"generators: {what} (wanted: {want})")
        with open(self.history, "a") as f:
            f.write(f"{time.time():.3f} {what} wanted={want}\n")


def generator_pool(run_dir: Path, procs: list[Supervised]) -> GeneratorPool | None:
    """The run's pool, or None for a run without generators (SFT, a colocated run)."""
    if not any(p.name.startswith(PREFIX) for p in procs):
        return None
    return GeneratorPool(run_dir, procs)
