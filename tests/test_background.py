"""Background threads yield the CPU to the thread their process exists for."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from asyncrl.background import BACKGROUND_NICENESS, yield_cpu
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's"
)


def niceness(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def test_yield_cpu_lowers_only_the_calling_thread():
    mine = niceness(threading.get_native_id())
    seen = {}

    def work() -> None:
        yield_cpu()
        seen["nice"] = niceness(threading.get_native_id())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["nice"] == max(mine, BACKGROUND_NICENESS)
    assert niceness(threading.get_native_id()) == mine


def test_the_engines_staging_thread_runs_at_the_lower_priority(tiny_model_dir):
    mine = niceness(threading.get_native_id())
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=2, threads=1))
    try:
        stager = next(t for t in threading.enumerate() if t.name == "weight-stager")
        deadline = time.time() + 10  # it lowers its priority as it starts
        while niceness(stager.native_id) == mine and time.time() < deadline:
            time.sleep(0.01)
        assert niceness(stager.native_id) == max(mine, BACKGROUND_NICENESS)
        assert niceness(threading.get_native_id()) == mine
    finally:
        engine.close()
