"""Running torch work in a thread that ends with it, so its OpenMP team ends too.

Each thread that enters a parallel region keeps a libgomp team for as long as it lives, and once
the live teams' threads outnumber the CPUs every team's workers stop spinning between regions:
a decode step beside a second team runs 15-25% slower (docs/performance.md, "Threads"). Work
that must not leave a team behind runs here: `spawn` for the server's loads and uploads (awaited
through `server.jobs.in_fresh_thread`), `in_thread` for an inline reference's decoding and the
bench's load and phases.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def spawn(fn: Callable[[], Any], settle: Callable[[bool, Any], None],
          name: str = "mizuoto-compute") -> threading.Thread:
    """Start fn() in a new daemon thread; from it, settle(True, result) or settle(False, exception)."""

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except BaseException as e:  # handed to settle
            outcome = (False, e)
        settle(*outcome)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def in_thread(fn: Callable[[], Any], name: str = "mizuoto-compute") -> Any:
    """fn() run in a new thread, waited for; its result, or its exception raised here."""
    out: list[tuple[bool, Any]] = []
    spawn(fn, lambda ok, value: out.append((ok, value)), name).join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
