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


@pytest.mark.parametrize("yield_staging", [True, False])
def test_a_generators_engine_stages_at_the_lower_priority(tiny_model_dir, yield_staging):
    """A generator's engine stages while it decodes; one whose caller waits for the
    staging (the colocated trainer, evaluation, the HTTP front) keeps the caller's."""
    mine = niceness(threading.get_native_id())
    cfg = EmbeddedEngineConfig(max_slots=2, threads=1)
    engine = EmbeddedEngine(tiny_model_dir, cfg, yield_staging=yield_staging)
    try:
        stager = engine.weights.thread
        deadline = time.time() + (5 if yield_staging else 1)  # it lowers it as it starts
        while niceness(stager.native_id) == mine and time.time() < deadline:
            time.sleep(0.01)
        want = max(mine, BACKGROUND_NICENESS) if yield_staging else mine
        assert niceness(stager.native_id) == want
        assert niceness(threading.get_native_id()) == mine
    finally:
        engine.close()
