"""Whether a call leaves an OpenMP team behind in the thread that made it (Linux).

libgomp gives each thread that enters a parallel region a team of worker threads for as long as
that thread lives; new threads inherit their creator's OS name. So: name a probe thread, run the
call in it, and count the other OS threads bearing that name once the call returned.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

from mizuoto.runtime.threads import in_thread

_PR_SET_NAME = 15
_SETTLE_S = 2.0  # a team's workers of a thread that just ended take a moment to exit


def supported() -> bool:
    """Whether threads can be counted by name here (Linux: /proc and prctl)."""
    return os.path.isdir("/proc/self/task") and hasattr(ctypes.CDLL(None), "prctl")


def _named(name: str) -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == name
        except OSError:  # the thread ended meanwhile
            pass
    return count


def threads_left_by(fn: Callable[[], Any], name: str = "mzt-omp-probe") -> int:
    """OS threads that fn() leaves alive beside its calling thread (a team's workers: 0 when it made none)."""

    def run() -> int:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)
        fn()  # an exception reaches the caller through in_thread
        end = time.monotonic() + _SETTLE_S
        while (n := _named(name) - 1) and time.monotonic() < end:
            time.sleep(0.01)
        return n

    return in_thread(run, name)
