"""No silent stall: a generator whose loop stops turning is killed and restarted by the
launcher (``asyncrl.launcher.supervise``), and nothing else waits for it."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.launcher.supervise import Supervised, supervise
from asyncrl.liveness import AliveMark
from asyncrl.metrics import read_metrics
from tests.conftest import launch


def test_supervisor_restarts_a_process_whose_loop_stalls_not_one_still_starting(tmp_path, capfd):
    """The first start marks its loop a few times, then freezes itself (SIGSTOP); the
    restart marks until the trainer ends. A process that never marks (still loading a
    model) is never taken for stalled."""
    died, restarted = tmp_path / "froze_once", tmp_path / "restarted"
    looping = (
        "import os, pathlib, signal, time\n"
        "from asyncrl.liveness import AliveMark\n"
        f"died, restarted = pathlib.Path({str(died)!r}), pathlib.Path({str(restarted)!r})\n"
        "alive, first = AliveMark(every_s=0.1), not died.exists()\n"
        "died.touch(); restarted.touch() if not first else None\n"
        "for turn in range(100000):\n"
        "    alive.touch(time.time()); time.sleep(0.05)\n"
        "    if first and turn == 5: os.kill(os.getpid(), signal.SIGSTOP)\n"
    )
    trainer = (
        f"import pathlib, time\nr, t = pathlib.Path({str(restarted)!r}), time.monotonic()\n"
        "while not r.exists() and time.monotonic() - t < 120: time.sleep(0.05)\n"
    )
    logs = tmp_path / "logs"
    stalling = Supervised(
        "generator_0", [sys.executable, "-c", looping], logs / "g0.log", restartable=True
    )
    never_marks = [sys.executable, "-c", "import time; time.sleep(600)"]
    loading = Supervised("generator_1", never_marks, logs / "g1.log", restartable=True)
    procs = [
        stalling,
        loading,
        Supervised("trainer", [sys.executable, "-c", trainer], logs / "t.log", final=True),
    ]
    assert supervise(procs, grace_s=5, stall_s=1.5) == 0
    assert stalling.restarts == 1 and loading.restarts == 0
    err = capfd.readouterr().err
    assert re.search(r"\[launch\] generator_0 stalled for [1-9] s", err), err
    assert "generator_0 exited with code -9; restart 1 of generator_0" in err
    assert (tmp_path / "alive" / "generator_0").exists()


def trainer_steps(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    steps = [
        r["step"] for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r
    ]
    return max(steps, default=0)


def freeze_generator(run_dir: Path, seen: dict, after_steps: int = 3) -> None:
    """Once the trainer has stepped ``after_steps`` times, SIGSTOP generator_1; then note
    the trainer's step while it stays frozen, until the launcher starts a new one."""
    pid_file, deadline = run_dir / "pids" / "generator_1.pid", time.time() + 240
    while time.time() < deadline and trainer_steps(run_dir) < after_steps:
        time.sleep(0.2)
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGSTOP)
    seen.update(pid=pid, stopped_at=time.time(), step_at_stop=trainer_steps(run_dir))
    seen["steps"] = []  # (seconds frozen, trainer step)
    while time.time() < deadline and int(pid_file.read_text()) == pid:
        seen["step_while_frozen"] = trainer_steps(run_dir)
        seen["steps"].append(
            (round(time.time() - seen["stopped_at"], 1), seen["step_while_frozen"])
        )
        time.sleep(0.5)
    seen["frozen_s"] = time.time() - seen["stopped_at"]


@pytest.mark.slow  # about 2 minutes on a busy 2-core machine: startup, then a 45 s run
def test_a_frozen_generator_is_restarted_and_the_trainer_keeps_stepping(tmp_path, tiny_model_dir):
    """Two generators; one is frozen with SIGSTOP mid-run (the trainer publishes a version
    every step, on a PUB socket that never blocks). The trainer keeps stepping on the
    other's samples (the frozen one's leases come back after its heartbeat timeout), the
    launcher says the generator stalled, kills and restarts it, and the run ends well."""
    run_dir, seen = tmp_path / "run", {}
    watcher = threading.Thread(target=freeze_generator, args=(run_dir, seen), daemon=True)
    watcher.start()
    output = launch(
        "tiny_grpo.py",
        f"model.path={tiny_model_dir}",
        f"run_dir={run_dir}",
        "eval.every_steps=0",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=4",
        "buffer.dynamic_sampling=false",
        "buffer.heartbeat_timeout_s=2",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "metrics.tensorboard=false",
        "num_generators=2",
        "rl.max_steps=100000",
        "time_limit_s=45",
        "--stall-timeout-s",
        "10",
    )
    watcher.join(timeout=10)
    assert "frozen_s" in seen, f"{seen}\n{output[-3000:]}"
    stalled = re.search(r"\[launch\] generator_1 stalled for (\d+) s", output)
    assert stalled and int(stalled.group(1)) >= 10, output
    assert "generator_1 exited with code -9; restart 1 of generator_1" in output, output
    # Not before the stall timeout, less the alive mark's interval (its last mark may
    # precede the SIGSTOP by up to AliveMark.every_s); nor did it wait on anything else.
    assert 10 - AliveMark().every_s <= seen["frozen_s"] < 40, seen
    assert seen["step_while_frozen"] >= seen["step_at_stop"] + 2, seen
    assert not Path(f"/proc/{seen['pid']}").exists()
    # The restarted generator's loop turned, and the trainer went on past the restart.
    assert (run_dir / "alive" / "generator_1").exists()
    assert trainer_steps(run_dir) > seen["step_while_frozen"]
