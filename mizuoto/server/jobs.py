"""Synthesis jobs: each runs in its own worker thread and hands chunks to the event loop.

The runtime's iterators are synchronous and may block (a model runs one request at a time), so
a job owns one thread from the first call to the iterator's close. The job's Lease
(`runtime.lease`) is its Session's (session.py: made when the request arrives, with the request
timeout as its deadline), the request's one context: a session's model load before its text, the
job's slot wait, its model's load and pin, every wait in the runtime and the worker's wait for a
slow client take it. Cancelling (client gone, deadline passed, server stopping) ends each of
those waits within `lease.POLL_S` and stops the engine at its next stage call; the worker closes
the iterator in its own thread and releases the lease, which ends the request: the model's pin
and whatever the engine held go. A queued job's worker first waits for its slot (admission.py);
the slot is released when the computation ends, before the response is sent. Streamed text comes
in through a TextFeed.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mizuoto.runtime.lease import POLL_S, Lease
from mizuoto.runtime.threads import spawn
from mizuoto.server.admission import JobSlots, Ticket
from mizuoto.server.errors import ApiError, past_deadline

_END = object()
_DONE = object()  # the end of a TextFeed's text
QUEUE_CHUNKS = 8  # chunks a worker may run ahead of a slow client


async def in_time(awaitable: Any, idle: float, end: float | None, stalled: str, late: str) -> Any:
    """Await what a client sends within `idle` seconds and before `end` (a monotonic time; None: no end);
    past either, the 408 saying which ran out (`stalled` or `late`): a client that trickles below the
    idle timeout still meets the end."""
    left = idle if end is None else min(idle, max(end - time.monotonic(), 0.0))
    try:
        return await asyncio.wait_for(awaitable, left)
    except asyncio.TimeoutError:
        raise ApiError(408, late if left < idle else stalled) from None


async def in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a new thread that ends with the call, awaited from the event loop.

    For torch work outside jobs (loading, encoding, decoding uploads): each thread that runs a
    parallel region keeps an OpenMP team for as long as it lives, and a second live team slows
    every job's compute (docs/performance.md, "Threads"); asyncio's pooled executor threads live on.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def on_loop(ok: bool, value: Any) -> None:
        if not done.cancelled():
            done.set_result(value) if ok else done.set_exception(value)

    def settle(ok: bool, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(on_loop, ok, value)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    spawn(lambda: fn(*args), settle)
    return await done


class Cancelled(Exception):
    """Raised inside a worker (e.g. by a streamed-text iterator) when its job was cancelled."""


class ClientGone(Exception):
    """The client disconnected; its job was cancelled."""


class TextFeed:
    """Streamed text for a job (a WebSocket or Wyoming session): a blocking iterator of pieces fed from the event
    loop; cancelling it, or the end of `lease` (the session's, which its job takes), makes it raise."""

    def __init__(self, lease: Lease | None = None):
        self._queue: queue.Queue = queue.Queue()
        self.cancelled = False
        self.lease = lease

    def put(self, text: str) -> None:
        """Add a piece of text."""
        self._queue.put(text)

    def done(self) -> None:
        """The text is complete."""
        self._queue.put(_DONE)

    def cancel(self) -> None:
        """End the text: the job's iterator raises Cancelled."""
        self.cancelled = True
        self._queue.put(_DONE)

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self.lease is not None and self.lease.cancelled:
                    raise Cancelled() from None
                continue
            if self.cancelled:
                raise Cancelled()
            if item is _DONE:
                return
            yield item


class Job:
    """One synthesis running in a worker thread under `lease` (its session's); iterate it from the event loop
    with `next()`."""

    def __init__(self, start: Callable[[Lease], Iterator[Any]], admission: JobSlots, ticket: Ticket,
                 lease: Lease, on_finish: Callable[[Job], None], on_admit: Callable[[float], None],
                 retry_after: int = 1):
        self.lease = lease
        self.cancelled = self.lease.event  # set by cancel(); the deadline is the lease's own
        self.retry_after = retry_after  # seconds, in the Retry-After of a queue-timeout 503
        self.started = time.monotonic()
        self.finished = threading.Event()
        self._start = start
        self._admission = admission
        self._ticket = ticket
        self._on_admit = on_admit
        self._on_finish = on_finish
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._space = threading.Semaphore(QUEUE_CHUNKS)
        self._thread = threading.Thread(target=self._work, name="mizuoto-job", daemon=True)

    def run(self) -> Job:
        """Start the worker: it waits for its ticket's slot and runs; the slot goes with the request's lease."""
        self._thread.start()
        return self

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.lease.cancel("because the server's event loop is gone")

    def _work(self) -> None:
        if not self._admission.wait(self._ticket, self.lease):
            self.lease.release()
            self._put(self._ended() or ApiError(
                503, f"the request waited {self._admission.timeout:g} s in the queue without a free slot"
                     " (--queue-timeout); retry shortly", headers={"Retry-After": str(self.retry_after)}))
            self.finished.set()
            self._on_finish(self)
            return
        self._on_admit(self._ticket.waited)
        # the slot is the request's until its lease is released, which waits for the request's last work on a
        # compute loop (a cancelled request's running call keeps it; Lease.release): never freed while it computes
        self.lease.on_release(self._admission.release)
        iterator = None
        try:
            iterator = self._start(self.lease)  # every wait and stage call of the request takes the lease
            for chunk in iterator:
                while not self._space.acquire(timeout=0.1):  # a slow client: bounded by the lease too
                    if self.lease.cancelled:
                        break
                if self.lease.cancelled:
                    break
                self._put(chunk)
            self._put(self._ended() or _END)
        except BaseException as e:  # reported to the consumer, who turns it into a response
            self._put(self._ended() or e)
        finally:
            try:
                if iterator is not None and hasattr(iterator, "close"):
                    iterator.close()
            finally:
                iterator = None
                self.lease.release()  # the request ends here: its model's pin and its slot go once its work ends
                self.finished.set()
                self._on_finish(self)

    def _ended(self) -> BaseException | None:
        """What the consumer hears when the lease ended the job: Cancelled, or a 504 past the deadline."""
        if self.cancelled.is_set():
            return Cancelled()
        if self.lease.expired:
            return past_deadline()
        return None

    def cancel(self, reason: str = "because its client left") -> None:
        """End the request: every wait it is in returns, and the engine stops at its next stage call."""
        self.lease.cancel(reason)

    async def next(self) -> Any:
        """The next chunk, or None at the end; the worker's error is raised here; the deadline gives 504."""
        try:
            item = await asyncio.wait_for(self._queue.get(), self.lease.remaining())
        except asyncio.TimeoutError:
            self.cancel()
            raise past_deadline() from None
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        self._space.release()
        return item

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker thread to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
