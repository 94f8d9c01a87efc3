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

from asyncrl.launcher.pool import RolePool
from asyncrl.launcher.supervise import Supervised, supervise
from asyncrl.liveness import EXIT_DRAINED
from tests.runs import wait_for

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


def test_the_pool_starts_and_drains_generators_as_the_control_file_says(tmp_path, capfd):
    """``RUN_DIR/control/generators`` 2 starts a copy of the first generator under the next
    id; 1 drains the newest (SIGUSR1), which leaves and is not restarted; a bad value is
    reported and ignored; the run ends with the trainer as always."""
    run_dir, seen, done = tmp_path / "run", tmp_path / "seen", tmp_path / "done"
    seen.mkdir()
    logs = run_dir / "logs"
    # A generator: says which worker id it runs as, leaves drained on SIGUSR1.
    generator = _python(
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGUSR1, lambda *_: sys.exit({EXIT_DRAINED}))\n"
        f"pathlib.Path({str(seen)!r}, sys.argv[-1]).touch()\n"
        "while True: time.sleep(0.05)"
    ) + ["--worker-id", "g0"]
    trainer = _python(
        f"import pathlib, time\nd, t = pathlib.Path({str(done)!r}), time.monotonic()\n"
        "while not d.exists() and time.monotonic() - t < 120: time.sleep(0.05)"
    )
    procs = [
        Supervised("buffer", SLEEP, logs / "buffer.log"),
        Supervised("generator_0", generator, logs / "generator_0.log", restartable=True),
        Supervised("trainer", trainer, logs / "trainer.log", final=True),
    ]
    pool = RolePool(run_dir, procs)
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("code", supervise(procs, grace_s=5, adjust=pool.adjust))
    )
    thread.start()
    try:
        wait_for(lambda: (seen / "g0").exists(), 60, "generator_0")
        pool.path.write_text("2\n")
        wait_for(lambda: (seen / "g1").exists(), 60, "a second generator")
        pool.path.write_text("1\n")
        wait_for(lambda: procs[-1].left, 60, "the second generator to leave")
        pool.path.write_text("lots\n")
        wait_for(lambda: pool.refused == "lots", 60, "the bad value to be seen")
    finally:
        done.touch()
        thread.join(timeout=60)
    assert result["code"] == 0
    names = [p.name for p in procs]
    assert names == ["buffer", "generator_0", "trainer", "generator_1"]
    assert procs[3].proc.returncode == EXIT_DRAINED and procs[3].restarts == 0
    assert not procs[1].left and procs[1].restarts == 0
    history = (run_dir / "control" / "generators.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in history] == [
        "started generator_1 wanted=2",
        "draining generator_1 wanted=1",
    ]
    assert (logs / "generator_1.log").exists()
    assert "'lots' is not a number of generators" in capfd.readouterr().err
