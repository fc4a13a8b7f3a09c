"""Admission of synthesis jobs: `limit` run at once, up to `max_queued` more wait in line (FIFO), the rest get 503.

A request is admitted on the event loop (`enter`, which never blocks): it gets a ticket that is
either granted at once (a slot was free and nobody was waiting) or waits in the queue. The job's
worker thread then blocks in `wait` until a finishing job hands it its slot (slots pass straight to
the oldest waiter, so a newcomer never overtakes the line), its request's lease ends (the client
left, the deadline passed, the server stops), or the queue timeout passes.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from mizuoto.runtime.lease import POLL_S, Lease


class Ticket:
    """A place in line; `granted` is set when the job holds a slot."""

    def __init__(self) -> None:
        self.granted = threading.Event()
        self.queued_at = time.monotonic()
        self.waited = 0.0  # seconds spent in the queue, once granted


class JobSlots:
    """At most `limit` jobs run; at most `max_queued` wait for a slot, first come first served."""

    def __init__(self, limit: int, max_queued: int = 0, timeout: float | None = None):
        self.limit = limit
        self.max_queued = max_queued
        self.timeout = timeout
        self.active = 0
        self._waiting: deque[Ticket] = deque()
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        """Jobs waiting for a slot now."""
        return len(self._waiting)

    def full(self) -> bool:
        """True when a new request would be refused."""
        with self._lock:
            return self.active >= self.limit and len(self._waiting) >= self.max_queued

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits (no queueing)."""
        with self._lock:
            if self.active >= self.limit or self._waiting:
                return False
            self.active += 1
            return True

    def enter(self) -> Ticket | None:
        """A ticket, granted now or queued; None when every slot and every place in the queue is taken."""
        ticket = Ticket()
        with self._lock:
            if self.active < self.limit and not self._waiting:
                self.active += 1
                ticket.granted.set()
            elif len(self._waiting) < self.max_queued:
                self._waiting.append(ticket)
            else:
                return None
        return ticket

    def wait(self, ticket: Ticket, lease: Lease) -> bool:
        """Block until the ticket holds a slot (True), or the lease ends or the queue times out (False, out of line)."""
        end = None if self.timeout is None else ticket.queued_at + self.timeout
        while not ticket.granted.is_set() and not lease.cancelled:
            left = POLL_S if end is None else min(POLL_S, end - time.monotonic())
            if left <= 0:
                break
            ticket.granted.wait(left)
        with self._lock:
            if ticket.granted.is_set():
                ticket.waited = time.monotonic() - ticket.queued_at
                return True
            self._waiting.remove(ticket)
            return False

    def release(self) -> None:
        """Give a slot back: to the oldest waiter if there is one."""
        with self._lock:
            if self._waiting:
                self._waiting.popleft().granted.set()
            else:
                self.active -= 1
