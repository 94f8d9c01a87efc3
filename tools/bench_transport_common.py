"""What the transport benchmark's two halves share (``tools/bench_transport.py``): the run
id on every message, the longest wait for anything, and the cleanup of child processes."""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import time

RUN_ID = "bench"
WAIT_S = 120.0  # longest wait for any one thing before the bench gives up


def cleanup(children: list) -> None:
    """End every child this bench started (servers, senders, subscribers), politely first."""
    for child in children:
        if isinstance(child, subprocess.Popen) and child.poll() is None:
            child.send_signal(signal.SIGTERM)
        elif isinstance(child, mp.process.BaseProcess) and child.is_alive():
            child.terminate()
    deadline = time.monotonic() + 10
    for child in children:
        popen = isinstance(child, subprocess.Popen)
        while (child.poll() is None if popen else child.is_alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if child.poll() is None if popen else child.is_alive():
            child.kill()
        child.wait() if popen else child.join()
