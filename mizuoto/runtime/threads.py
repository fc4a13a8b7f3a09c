"""Running torch work in a thread that ends with it, so its OpenMP team ends too.

Each thread that enters a parallel region keeps a libgomp team for as long as it lives, and once
the live teams' threads outnumber the CPUs every team's workers stop spinning between regions:
a decode step beside a second team runs 15-25% slower (docs/performance.md, "Threads"). Work
that must not leave a team behind (an inline reference's decoding, the bench's load and phases) runs here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(fn: Callable[[], Any], name: str = "mizuoto-compute") -> Any:
    """fn() run in a new thread, waited for; its result, or its exception raised here."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # handed to the caller
            out.append((False, e))

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
