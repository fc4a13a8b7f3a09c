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
import time
from collections.abc import Callable
from typing import Any

from mizuoto.runtime.lease import Lease


_spawned: set[threading.Thread] = set()  # threads spawn() started that have not ended (join_spawned)
_spawned_lock = threading.Lock()


def spawn(fn: Callable[[], Any], settle: Callable[[bool, Any], None],
          name: str = "mizuoto-compute") -> threading.Thread:
    """Start fn() in a new daemon thread; from it, settle(True, result) or settle(False, exception).

    The thread is tracked until it ends: whoever shuts the process's work down joins what is left
    (`join_spawned`), so a caller that stopped waiting (its request was cancelled) leaves no thread behind.
    """

    def run() -> None:
        try:
            try:
                outcome: tuple[bool, Any] = (True, fn())
            except BaseException as e:  # handed to settle
                outcome = (False, e)
            settle(*outcome)
        finally:
            with _spawned_lock:
                _spawned.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _spawned_lock:
        _spawned.add(thread)
    thread.start()
    return thread


def join_spawned(timeout: float) -> list[threading.Thread]:
    """Join the threads spawn() started that still run, within `timeout` s in all; those still running after it."""
    end = time.monotonic() + timeout
    with _spawned_lock:
        threads = list(_spawned)
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def in_thread(fn: Callable[[], Any], name: str = "mizuoto-compute", lease: Lease | None = None) -> Any:
    """fn() run in a new thread, waited for; its result, or its exception raised here.

    With a `lease`, its cancel or deadline ends the wait (RequestCancelled); the thread then runs to its
    end as the request's work (`Lease.begin_work`: the request's release waits for it) and is joined by
    `join_spawned`.
    """
    out: list[tuple[bool, Any]] = []
    done = threading.Event()

    def settle(ok: bool, value: Any) -> None:
        out.append((ok, value))
        if lease is not None:
            lease.end_work()
        done.set()
    if lease is not None:
        lease.check("before its work began")
        lease.begin_work()
    thread = spawn(fn, settle, name)
    if lease is None:
        thread.join()
    else:
        lease.wait(done, "while its work ran in a thread")
    ok, value = out[0]
    if not ok:
        raise value
    return value
