"""Background threads that must not slow the thread a process exists for.

A generator process decodes on its main thread; its weights thread (receiving and
rebuilding versions) and its engine's staging thread work beside it. Where the cores are
all busy (a small machine, or CPU engines), the scheduler shares them equally, and every
decode step that overlaps a weight update slows by the update's share. ``yield_cpu``
lowers the calling thread's scheduling priority, so that work runs in what the others
leave: updates take longer to arrive, decode steps stay nearly as fast.

The trainer's bucket sender yields too: its encoding and sending is what decode steps
overlap. Threads inherit the priority of the thread that starts them, and unprivileged code
cannot raise it back, so work that others wait for (the parameter read the next optimizer
step waits on) is started from a thread at full priority, not from a yielding one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
"""A niceness of 10 gives a thread about a tenth of the CPU time of a default one on a
contended core (Linux's CFS weights 110 against 1024), and all of an idle one."""


def yield_cpu(niceness: int = BACKGROUND_NICENESS) -> None:
    """Lower the calling thread's priority (Linux, where niceness is per thread; elsewhere
    nothing happens: there the call would name a process). Raising it needs no privilege."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError) as e:  # not Linux, or refused: run as before
        log.debug("could not lower this thread's priority: %s", e)
