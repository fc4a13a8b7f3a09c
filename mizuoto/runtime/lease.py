"""A request's context from admission to its end: its cancel, its deadline, the model it pins.

One Lease is made when a request is admitted (by the server's job, or by `Runtime.synthesize`
when the caller gives none) and passed explicitly to every wait the request passes: a server
slot, its model's turn, room beside other models, a place in a batch, a compute call, its
output. Each wait returns within `POLL_S` of a cancel or of the deadline with RequestCancelled
(DeadlineExceeded past the deadline), whichever thread waits. While it pins a model the
runtime never evicts that model; `release()` is the one place a request ends: whatever pinned
or reserved something for it lets go there (callbacks registered with `on_release`).

A request's work on a compute loop is counted on its lease (`begin_work`/`end_work`, by the
loop that queues and runs it). A thread that gives up waiting (a cancel, the deadline) leaves at
once, but what the request holds is its work's until that work has ended: `after_work` and the
release run when the count reaches zero, on the loop's thread when it ends the last unit. So a
model is never unpinned, unheld or given other requests while a call of a cancelled one still
runs on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mizuoto.errors import DeadlineExceeded, RequestCancelled

POLL_S = 0.05  # the longest a waiting request goes without looking at its cancel and deadline

# The lease of the request whose code runs now: set by the runtime around each step of an engine's
# chunk iterator and each compute call it runs, and copied into threads started for the request, so
# engine code never passes a lease (Model.use, room and submit, and the batch, read it here).
_CURRENT: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("mizuoto_lease", default=None)


def current() -> Lease | None:
    """The lease of the request whose code runs now (None outside any request)."""
    return _CURRENT.get()


@contextlib.contextmanager
def within(lease: Lease | None) -> Iterator[None]:
    """Run the block as the request with this lease (`current()`); None leaves the current one as it is."""
    if lease is None:
        yield
        return
    token = _CURRENT.set(lease)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class Lease:
    """Cancel (an event with a reason), deadline (`timeout` seconds from now; None: none), pinned model, plan."""

    def __init__(self, timeout: float | None = None, *, cancel: threading.Event | None = None):
        self.event = cancel if cancel is not None else threading.Event()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.reason = "by its caller"
        self.model: str | None = None  # the model it pins, once the runtime pinned one
        self.plan: Any = None  # the request's memory plan, once planned
        self._lock = threading.Lock()
        self._on_release: list[Callable[[], None]] = []
        self._after_work: list[Callable[[], None]] = []
        self._work = 0  # units of the request's work queued on or running in a compute loop
        self._ending = False  # release() was called; it takes effect once no work is left
        self.released = False

    def __repr__(self) -> str:
        state = "released" if self.released else "cancelled" if self.cancelled else "live"
        return f"<Lease {state} model={self.model!r}>"

    # -- cancel and deadline ----------------------------------------------------------------------
    def cancel(self, reason: str = "by its caller") -> None:
        """End every wait of the request (from any thread); the first reason given is kept."""
        with self._lock:
            if not self.event.is_set():
                self.reason = reason
                self.event.set()

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    @property
    def cancelled(self) -> bool:
        """Cancelled, or past the deadline."""
        return self.event.is_set() or self.expired

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def check(self, where: str) -> None:
        """RequestCancelled (or DeadlineExceeded) naming `where` ("while waiting for ...") once the request ends."""
        if self.event.is_set():
            raise RequestCancelled(f"the request was cancelled {self.reason} {where}")
        if self.expired:
            raise DeadlineExceeded(f"the request ran past its deadline {where}")

    def _slice(self) -> float:
        left = self.remaining()
        return POLL_S if left is None else max(0.0, min(POLL_S, left))

    # -- waits ------------------------------------------------------------------------------------
    def wait(self, event: threading.Event, where: str) -> None:
        """Until `event` is set; the request's end ends the wait first."""
        while not event.wait(self._slice()):
            self.check(where)

    def wait_for(self, cond: threading.Condition, ready: Callable[[], bool], where: str) -> None:
        """Under `cond` (the caller holds it): until ready(); the request's end ends the wait first."""
        while not ready():
            self.check(where)
            cond.wait(self._slice())

    # -- its work on compute loops ----------------------------------------------------------------
    def begin_work(self) -> None:
        """A unit of the request's work was queued on a compute loop (the loop calls `end_work` once for it)."""
        with self._lock:
            self._work += 1

    def end_work(self) -> None:
        """A unit of work ended (run, failed or taken out of line); the last one runs what waited for it."""
        with self._lock:
            self._work -= 1
            if self._work > 0:
                return
            todo, self._after_work = self._after_work, []
        for fn in todo:
            fn()
        self._finish_release()

    def after_work(self, fn: Callable[[], None]) -> None:
        """Run fn() once none of the request's work is queued or running (at once when none is)."""
        with self._lock:
            if self._work > 0:
                self._after_work.append(fn)
                return
        fn()

    # -- the end ----------------------------------------------------------------------------------
    def on_release(self, fn: Callable[[], None]) -> None:
        """Run fn() when the lease is released (at once if it already was)."""
        with self._lock:
            if not self.released:
                self._on_release.append(fn)
                return
        fn()

    def release(self) -> None:
        """End the request: run what `on_release` registered, newest first, once; while some of its work
        still runs on a compute loop, that loop runs them when the work ends (the caller does not wait)."""
        with self._lock:
            self._ending = True
        self._finish_release()

    def _finish_release(self) -> None:
        with self._lock:
            if self.released or not self._ending or self._work > 0:
                return
            self.released = True
            todo, self._on_release = self._on_release[::-1], []
        for fn in todo:
            fn()
