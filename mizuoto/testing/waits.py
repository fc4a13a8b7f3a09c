"""Test helpers for waits: how long a blocked wait takes to end once its request's lease is cancelled, and
a context held by another thread while a test makes something wait for it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def held_elsewhere(hold: Callable[[], contextlib.AbstractContextManager], timeout: float = 10.0) -> Iterator[None]:
    """While the block runs, another thread is inside `hold()`'s context; at the block's end it leaves and is joined.

    What the thread raises entering or leaving the context is raised here. The thread leaves on its own
    after 3 x `timeout` s, so a test that fails inside the block leaves no thread behind.
    """
    entered, release, failed = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            with hold():
                entered.set()
                release.wait(3 * timeout)
        except BaseException as e:  # handed to the test
            failed.append(e)
            entered.set()

    t = threading.Thread(target=run, name="held-elsewhere")
    t.start()
    try:
        assert entered.wait(timeout), f"the other thread did not enter its context within {timeout} s"
        if failed:
            raise failed[0]
        yield
    finally:
        release.set()
        t.join(timeout)
    assert not t.is_alive(), f"the other thread did not leave its context within {timeout} s"
    if failed:
        raise failed[0]
