"""What a supervised process and its supervisor (``asyncrl.launcher.supervise``) agree on,
kept below both: the file a process touches to show its loop turns, the exit code that
says a restart cannot help, and the switch by which the elastic launcher has the trainer
lend its waits to generation."""

from __future__ import annotations

import os
from pathlib import Path

ALIVE_FILE_ENV = "ASYNCRL_ALIVE_FILE"
"""Names the file a supervised process touches to show its loop turns."""
EXIT_FATAL = 78
"""The exit code of a process whose death a restart cannot repair (EX_CONFIG): the run
stops with the tail of its log instead of starting it again."""
EXIT_DRAINED = 79
"""The exit code of a generator or reward server that left the run on purpose, drained
(its leases or batches went back to the buffer and its slot to another role): the
launcher does not restart it."""


class AliveMark:
    """The process's side of stall detection: ``touch()`` once per loop turn marks the
    file its supervisor named in ``ASYNCRL_ALIVE_FILE``, at most every ``every_s``
    (nothing without one: a process started by hand is not watched)."""

    def __init__(self, every_s: float = 1.0) -> None:
        path = os.environ.get(ALIVE_FILE_ENV)
        self.path, self.every_s, self.last = Path(path) if path else None, every_s, 0.0

    def touch(self, now: float) -> None:
        if self.path is not None and now - self.last >= self.every_s:
            self.path.touch()
            self.last = now


class LendSwitch:
    """Whether the trainer lends its waits to generation now (``elastic.lend_waits``): the
    elastic launcher writes ``RUN_DIR/control/lending`` (``1`` or ``0``), the trainer reads
    it before each batch it asks for. No file: not lending."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "control" / "lending"

    def set(self, on: bool) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("1\n" if on else "0\n")
        tmp.replace(self.path)  # a reader sees the old value or the new, whole

    @property
    def on(self) -> bool:
        try:
            return self.path.read_text().strip() == "1"
        except FileNotFoundError:
            return False
