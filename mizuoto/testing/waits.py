"""A test helper: how long a blocked wait takes to end once its request's lease is cancelled."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def cancel_during(wait: Callable[[], Any], lease: Any, waiting: Callable[[], bool] = lambda: True,
                  settle: float = 0.1, timeout: float = 10.0) -> tuple[BaseException | None, float]:
    """Run wait() in a thread; once waiting() holds (and `settle` s more), cancel `lease` "by the test".

    Returns what wait() raised (None if it returned) and the seconds from the cancel to its end.
    """
    outcome: list = []

    def run() -> None:
        try:
            wait()
            outcome.append((None, time.monotonic()))
        except BaseException as e:  # handed to the test
            outcome.append((e, time.monotonic()))

    t = threading.Thread(target=run)
    t.start()
    end = time.monotonic() + timeout
    while not waiting() and time.monotonic() < end and not outcome:
        time.sleep(0.01)
    time.sleep(settle)
    cancelled_at = time.monotonic()
    lease.cancel("by the test")
    t.join(timeout)
    assert outcome, f"the wait did not end within {timeout} s of its cancel"
    error, ended = outcome[0]
    return error, ended - cancelled_at
