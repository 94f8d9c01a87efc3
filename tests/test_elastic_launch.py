"""Generators join and leave a running run through the real local launcher: one more is
started when ``RUN_DIR/control/generators`` asks for two, it takes leases and sends
tokens, and asking for one again drains it: it hands its leases back and is not
restarted. The run trains on with the first one until the test stops it, and the buffer's
books balance: nothing lost, nothing taken back for a dead holder, no token wasted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def _read_into(stream, lines: list[str]) -> None:
    for line in stream:  # one at a time: the test watches them arrive
        lines.append(line)


def _trained(run_dir: Path) -> int:
    return max((r["step"] for r in _records(run_dir) if "train/loss" in r), default=0)


def _generated_by(run_dir: Path, process: str) -> float:
    return max(
        (r["generator/tokens"] for r in _records(run_dir) if r["process"] == process),
        default=0.0,
    )


def run_then_stop(cmd: list[str], steps) -> tuple[int | None, str]:
    """Start the launcher ``cmd``, call ``steps(lines)`` (its output so far, growing)
    while it runs, then stop it with SIGTERM; its exit code and whole output."""
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=_read_into, args=(launcher.stdout, lines), daemon=True)
    reader.start()
    try:
        steps(lines)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
    reader.join(timeout=30)
    return launcher.returncode, "".join(lines)


def run_short_grpo(run_dir: Path, model_dir: str, *overrides: str) -> str:
    """``tiny_grpo`` through the local launcher with small batches, no evaluation and
    ``overrides`` (the step count among them), bounded at 300 s; asserts it ended well and
    returns its output."""
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={model_dir}",
        "time_limit_s=300",  # bounds a broken run
        "eval.every_steps=0",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=4",
        "buffer.dynamic_sampling=false",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "metrics.tensorboard=false",
        *overrides,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def assert_books_balance(run_dir: Path) -> dict:
    """The buffer's books at the end of a run balance: every sample created has ended or
    is in flight (nothing lost), nothing was taken back for a dead holder, no token was
    wasted. Returns the counters."""
    c = json.loads((run_dir / "buffer_counters.json").read_text())
    ended = sum(
        c.get(f"buffer/samples_{k}", 0) for k in ("consumed", "stale", "filtered", "failed")
    )
    assert c["buffer/samples_created"] == ended + c["buffer/in_flight_samples"], c
    assert c.get("buffer/leases_revoked_holder_silent", 0) == 0, c
    assert c["buffer/tokens_revoked_alive"] == 0, c
    return c


def assert_drained_and_balanced(run_dir: Path, worker: str) -> None:
    """The drained generator ``worker`` made tokens and handed its leases back, and the
    buffer's books balance (``assert_books_balance``)."""
    left = json.loads((run_dir / f"generator_{worker}_summary.json").read_text())
    assert left["tokens"] > 0 and left["leases_handed_back"] is not None
    c = assert_books_balance(run_dir)
    assert c.get("buffer/leases_revoked_drained", 0) == left["leases_handed_back"]


def test_a_generator_joins_and_leaves_a_running_run_losing_nothing(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        # Runs until the test stops it (the tiny model trains ~10 steps a second, and a
        # generator takes seconds to start): the limit only bounds a broken run.
        "rl.max_steps=1000000",
        "time_limit_s=600",
        "eval.every_steps=0",
        "task.train_size=200",
        "buffer.prompts_per_batch=2",
        "buffer.samples_per_prompt=4",
        "buffer.dynamic_sampling=false",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "metrics.interval_s=0.5",
        "metrics.tensorboard=false",
        "num_generators=1",
    ]
    control = run_dir / "control" / "generators"

    def steps(lines: list[str]) -> None:
        _wait(lambda: _trained(run_dir) >= 2, 120, "a trained step")
        control.write_text("2\n")
        _wait(lambda: _generated_by(run_dir, "generator_g1") > 0, 120, "g1's first tokens")
        control.write_text("1\n")
        _wait(lambda: any("generator_1 left the run" in line for line in lines), 120, "g1 to go")
        after = _trained(run_dir)
        _wait(lambda: _trained(run_dir) >= after + 5, 120, "steps after g1 left")

    code, out = run_then_stop(cmd, steps)
    assert code == 130, out[-3000:]  # stopped by the test, as asked
    assert "generators: started generator_1 (wanted: 2)" in out
    assert "generators: draining generator_1 (wanted: 1)" in out
    assert "generator_1 left the run, drained" in out and "restart" not in out, out[-3000:]
    assert_drained_and_balanced(run_dir, "g1")
