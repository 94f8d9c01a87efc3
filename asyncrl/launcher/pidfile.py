"""Run a command that first names itself in a pid file: how a Slurm step's task does it.

    python -m asyncrl.launcher.pidfile RUN_DIR/pids/NAME.pid COMMAND [ARGS...]

Under ``launch/local.py`` the supervisor's child is the process itself, and its pid file
(``RUN_DIR/pids/NAME.pid``) holds that pid. Inside a Slurm job the child is ``srun``, and
the process runs under ``slurmstepd``, so each step's command writes its own pid file
through this module and then becomes the command (``exec`` keeps the pid): the file
names the process on its node, as it does locally (``tools/chaos.py`` kills by it). A
``{rank}`` in the path becomes ``$RANK``: trainer ranks that ``torchrun`` starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m asyncrl.launcher.pidfile PID_FILE COMMAND [ARGS...]")
    path = Path(argv[0].replace("{rank}", os.environ.get("RANK", "0")))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)  # a reader never sees half a pid
    sys.stdout.flush()
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
