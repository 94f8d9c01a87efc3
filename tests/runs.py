"""Helpers for tests of whole runs and their processes: waiting for a condition, the
short ``tiny_grpo`` run through the real local launcher (run to its end, or watched and
stopped by the test), and the buffer's books at a run's end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncrl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def wait_for(condition, timeout_s: float = 30.0, what: str = "the condition", poll_s: float = 0.05):
    """Poll ``condition()`` until it returns something true, and return that; fail naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(poll_s)
    return value


def records(run_dir: Path) -> list[dict]:
    """The run's metrics so far (none before its first line is written)."""
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def trained_steps(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir) if "train/loss" in r), default=0)


def generated_by(run_dir: Path, process: str) -> float:
    return max(
        (r["generator/tokens"] for r in records(run_dir) if r["process"] == process),
        default=0.0,
    )


# A short asynchronous run of the tiny model: small batches, no evaluation, no
# TensorBoard, fast heartbeats.
SHORT_GRPO = [
    "eval.every_steps=0",
    "task.train_size=200",
    "buffer.prompts_per_batch=2",
    "buffer.samples_per_prompt=4",
    "buffer.dynamic_sampling=false",
    "engine.embedded.max_slots=8",
    "transport.heartbeat_s=0.2",
    "metrics.tensorboard=false",
]


def short_grpo_command(run_dir: Path, model_dir: str, *overrides: str) -> list[str]:
    """``tiny_grpo`` through the local launcher as ``SHORT_GRPO``, bounded at 300 s;
    ``overrides`` come last and win (the step count among them)."""
    return [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_grpo.py",
        f"run_dir={run_dir}",
        f"model.path={model_dir}",
        "time_limit_s=300",  # bounds a broken run
        *SHORT_GRPO,
        *overrides,
    ]


def run_short_grpo(run_dir: Path, model_dir: str, *overrides: str) -> str:
    """Run ``short_grpo_command`` to its end; asserts it ended well and returns its output."""
    cmd = short_grpo_command(run_dir, model_dir, *overrides)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def _read_into(stream, lines: list[str]) -> None:
    for line in stream:  # one at a time: the test watches them arrive
        lines.append(line)


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


def assert_lent_drained(run_dir: Path) -> None:
    """The trainer's lent generator ``lent0`` sent tokens and was drained at the end, and
    the buffer's books balance."""
    lent = json.loads((run_dir / "generator_lent0_summary.json").read_text())
    assert lent["tokens"] > 0 and lent["leases_handed_back"] is not None, lent
    assert_books_balance(run_dir)
