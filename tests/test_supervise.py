"""The supervision that ``launch/local.py`` and the Slurm job share, without Slurm: the
supervisor restarts, reports and stops real processes; a task's pid file names the
process itself after it execs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from asyncrl.launcher.supervise import Supervised, supervise
from asyncrl.liveness import EXIT_DRAINED

ROOT = Path(__file__).resolve().parents[1]


# ---- the supervisor (no Slurm) -------------------------------------------------------
def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEP = _python("import time; time.sleep(600)")


def test_supervisor_restarts_generators_and_stops_the_rest_when_the_trainer_ends(tmp_path, capfd):
    marker, restarted = tmp_path / "died_once", tmp_path / "restarted"
    # Dies the first time (as a killed generator would), runs until stopped the second.
    flaky = _python(
        f"import pathlib, sys, time\nm = pathlib.Path({str(marker)!r})\n"
        "if not m.exists(): m.touch(); print('dying now', flush=True); sys.exit(3)\n"
        f"pathlib.Path({str(restarted)!r}).touch()\ntime.sleep(600)"
    )
    # The trainer ends once the generator runs again (a fixed sleep would race the restart
    # on a loaded machine); the 120 s limit only keeps a broken supervisor from hanging.
    trainer = _python(
        f"import pathlib, time\nr, t = pathlib.Path({str(restarted)!r}), time.monotonic()\n"
        "while not r.exists() and time.monotonic() - t < 120: time.sleep(0.05)\n"
        "print('trained')"
    )
    buffer = Supervised("buffer", SLEEP, tmp_path / "buffer.log")
    generator = Supervised("generator_0", flaky, tmp_path / "generator_0.log", restartable=True)
    procs = [
        buffer,
        generator,
        Supervised("trainer", trainer, tmp_path / "trainer.log", final=True),
    ]
    assert supervise(procs, grace_s=5) == 0
    assert generator.restarts == 1
    assert buffer.proc.returncode == generator.proc.returncode == -signal.SIGTERM
    err = capfd.readouterr().err
    assert "generator_0 exited with code 3; restart 1" in err
    assert "dying now" in err  # the tail of its log
    assert (tmp_path / "trainer.log").read_text() == "trained\n"


def test_a_generator_that_left_drained_is_not_restarted_and_the_run_goes_on(tmp_path, capfd):
    left = tmp_path / "left"
    drained = _python(
        f"import pathlib, sys\npathlib.Path({str(left)!r}).touch()\nsys.exit({EXIT_DRAINED})"
    )
    # The trainer ends a while after the generator left: long enough for a restart to show.
    trainer = _python(
        f"import pathlib, time\nr, t = pathlib.Path({str(left)!r}), time.monotonic()\n"
        "while not r.exists() and time.monotonic() - t < 120: time.sleep(0.05)\n"
        "time.sleep(1.5)"
    )
    generator = Supervised("generator_1", drained, tmp_path / "generator_1.log", restartable=True)
    procs = [
        Supervised("generator_0", SLEEP, tmp_path / "generator_0.log", restartable=True),
        generator,
        Supervised("trainer", trainer, tmp_path / "trainer.log", final=True),
    ]
    assert supervise(procs, grace_s=5) == 0
    assert generator.restarts == 0 and generator.left
    assert generator.proc.returncode == EXIT_DRAINED
    err = capfd.readouterr().err
    assert err.count("generator_1 left the run, drained") == 1 and "restart 1" not in err


def test_supervisor_reports_a_death_with_its_log_and_stops_everything(tmp_path, capfd):
    failing = _python(
        "import time; print('scoring failed: boom', flush=True); time.sleep(1); exit(1)"
    )
    trainer = Supervised("trainer", SLEEP, tmp_path / "trainer.log", final=True)
    procs = [Supervised("buffer", failing, tmp_path / "buffer.log"), trainer]
    assert supervise(procs, grace_s=5, stop=threading.Event()) == 1
    assert trainer.proc.returncode == -signal.SIGTERM
    err = capfd.readouterr().err
    assert f"buffer exited with code 1; last lines of {tmp_path / 'buffer.log'}" in err
    assert "scoring failed: boom" in err


def test_a_task_names_itself_in_its_pid_file_then_becomes_the_process(tmp_path):
    """A step's command as the script writes it: the pid in the file is the process's
    own, after exec (a trainer rank's file is named by its RANK)."""
    pid_file = tmp_path / "pids" / "trainer_{rank}.pid"
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.launcher.pidfile", str(pid_file), *command],
        cwd=ROOT,
        env=dict(os.environ, RANK="3"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (tmp_path / "pids" / "trainer_3.pid").read_text() == out
