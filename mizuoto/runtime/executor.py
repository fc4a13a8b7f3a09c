"""One model's compute thread: stage calls submitted with a request's lease run there, in order.

Heavy compute runs on one long-lived thread per model (docs/performance.md, "Threads"): each
thread that runs a parallel region keeps an OpenMP team while it lives, and more live teams
than cores slow all of them. A model whose LM batches has its batch loop as its executor
(`runtime.batching.DecodeBatcher` extends this class); every other model gets a plain Executor
from its scheduler: the same loop at width 1.

A call waits for its outcome bounded by its lease: a cancel or the deadline takes a call not yet
started out of line; a call already running goes on to its next stage call, where the placement
sees the same lease (`running_lease`). A failure of the loop itself goes to every waiter and the
loop goes on (`failures` counts them). close() answers whatever still waits and joins the thread.

Placement: the runtime that adopts the model sets `placement` once (its `Scheduler`): a stage
call (`Model.use`) enters `placement.place(stage, lease)`, which brings the stage's modules where
the plan says, and a call's reservation (`Model.room`) enters `placement.reserve(stage, lease,
working, sizes)`. Without one, stages run where their modules are and nothing is reserved.

The loop also runs its placement's admission (`placement.schedule()`, kind "admit") when woken
(`wake`: a request came into the model's line, or memory was let go anywhere), before any other
work. A call whose room others hold (`RoomLater`, raised by its reservation: a loop that batches
never waits for room) is put aside, unanswered and still its lease's work, and goes back to the
front of the line at the next wake.

The loop keeps where its time went (`timings()`: by kind of work, and "idle"); a call names its
kind when submitted, and work nested in a call (`timing`) is counted under its own kind only.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mizuoto.errors import MizuotoError, RequestCancelled
from mizuoto.runtime.lease import POLL_S, Lease, within

log = logging.getLogger("mizuoto.runtime")

JOIN_S = 10.0  # how long close() waits for the loop's current work (a pass or a stage call)


class RoomLater(Exception):
    """A call's memory (`Model.room`) is held by others now: raised on a loop, which never waits for room; the loop
    puts the call aside, unanswered, and runs it again when memory is let go (`Executor.wake`). Never reaches a
    request."""


class Call:
    """A function waiting for the executor's thread with its request's lease, and then its outcome."""

    def __init__(self, fn: Callable[[], Any], lease: Lease | None, kind: str = "call", urgent: bool = False) -> None:
        self.fn, self.lease, self.kind, self.urgent = fn, lease, kind, urgent
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        if lease is not None:  # the request's work until it is finished (Lease.after_work, release)
            lease.begin_work()

    def finish(self, result: Any, error: BaseException | None, ends: list[Lease] | None = None) -> None:
        """Its outcome, once: the request's work ends first, so a waiter that wakes sees what it released.

        Under a loop's condition, give `ends` (the loop's list): the work is ended there once the
        condition is released (`Executor._settle_ends`), since ending it may release the request.
        """
        if self.done.is_set():
            return
        self.result, self.error = result, error
        if self.lease is not None:
            if ends is not None:
                ends.append(self.lease)
            else:
                self.lease.end_work()
        self.done.set()


class Executor:
    """Runs submitted calls on one long-lived thread, first come first served (started on the first call)."""

    label = "compute loop"  # names the thread and the loop's failures
    thread_suffix = "compute"

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.closed = False
        self.failures = 0  # failures of the loop itself so far (each answered to its waiters)
        self._thread: threading.Thread | None = None
        self._calls: collections.deque[Call] = collections.deque()
        self.placement: Any = None  # the runtime's placement of the model's stages (see above), set once
        self._running: Call | None = None  # the call on the thread now: its lease is its stage calls'
        self._working = False  # the loop runs a unit of work now (a call, or a batch's step)
        self._seconds: collections.Counter[str] = collections.Counter()  # the loop's time by kind of work
        self._nested = 0.0  # seconds of the current unit of work already counted under a nested kind
        # requests' work answered under the condition, ended once it is released (a request's release runs
        # then, and may take other locks: never under this condition)
        self._ends: list[Lease] = []
        self._admit = False  # the placement's line has something to decide (`wake`): the loop's next unit of work
        self._aside: list[Call] = []  # calls waiting for room others hold (RoomLater), in the order they came

    # -- submitting -------------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any], lease: Lease | None = None, kind: str = "call", *,
             urgent: bool = False) -> Any:
        """fn() on the executor's thread (at once when already on it); its result, or its exception raised here.

        `kind` names the work in the loop's `timings()` (e.g. "flow"); a call made on the thread
        itself is counted under its kind, apart from the work it runs in. `urgent`: a request's
        first audio, which a loop with other work to weigh it against may run first (the batch's).
        """
        if threading.current_thread() is self._thread:
            with self.timing(kind), within(lease):
                return fn()
        if lease is not None:
            lease.check("before its compute call")
        job = self.post(fn, lease, kind, urgent=urgent)
        try:
            self.wait_for(job.done, lease, "while waiting for its compute call")
        except RequestCancelled as e:
            with self.cond:
                for line in (self._calls, self._aside):
                    if job in line:  # not started (or put aside for room): it never runs
                        line.remove(job)
                        job.finish(None, e, self._ends)
            self._settle_ends()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def post(self, fn: Callable[[], Any], lease: Lease | None = None, kind: str = "call", *,
             urgent: bool = False) -> Call:
        """Queue fn() without waiting for it; the Call's `done` is set once it ran (or the loop closed).

        It counts as the lease's work until then (`Lease.begin_work`), and nothing takes it out of
        line: a request's cleanup is posted so, and runs even when its request gave up waiting.
        """
        with self.cond:
            self.check_open()
            job = Call(fn, lease, kind, urgent)
            self._start()
            self._calls.append(job)
            self.cond.notify_all()
        return job

    def wake(self) -> None:
        """Have the loop run its placement's admission (`placement.schedule()`) as its next unit of work.

        Called outside every lock above this condition (a request came into the line, one let go,
        memory was freed); a closed loop ignores it (its placement refused what was in line).
        """
        with self.cond:
            if self.closed:
                return
            self._admit = True
            self._start()
            self.cond.notify_all()

    def pending(self) -> int:
        """Calls waiting (in line or put aside for room) plus the unit of work running now: 0 when the loop is idle.

        A cancelled request stops waiting at once, but a call of its that had started runs to its end
        here (its working memory is live until then).
        """
        with self.cond:
            return len(self._calls) + len(self._aside) + int(self._working)

    def running_lease(self) -> Lease | None:
        """The lease of the call being run, when asked from the executor's own thread (else None)."""
        job = self._running
        return job.lease if job is not None and threading.current_thread() is self._thread else None

    def on_thread(self) -> bool:
        """Whether the caller runs on the executor's own thread."""
        return threading.current_thread() is self._thread

    def check_open(self) -> None:
        """RequestCancelled once the executor was closed (its model is closing)."""
        if self.closed:
            raise RequestCancelled(f"{self.name}: the model was closed")

    def wait_for(self, event: threading.Event, lease: Lease | None, where: str) -> None:
        """Until the loop (or close) sets `event`; the lease ends the wait first, a dead loop with an error."""
        while not event.wait(POLL_S):
            thread = self._thread
            if thread is not None and not thread.is_alive() and not event.is_set():
                raise MizuotoError(f"{self.name}: the {self.label} ended without answering")
            if lease is not None:
                lease.check(where)

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Count the block's time under `kind` (not under the work it runs in); only on the loop's thread."""
        if threading.current_thread() is not self._thread:
            yield
            return
        start, nested = time.perf_counter(), self._nested
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = self._nested - nested  # already counted under kinds nested in this one
            self._nested = nested + elapsed
            with self.cond:  # timings() copies it from another thread
                self._seconds[kind] += elapsed - inner

    def timings(self) -> dict[str, float]:
        """Seconds the loop spent so far by kind of work (its calls' kinds, its own, "idle")."""
        with self.cond:
            return dict(self._seconds)

    def rename(self, name: str) -> None:
        """Call it `name` from now on (its thread too)."""
        with self.cond:
            self.name = name
            if self._thread is not None:
                self._thread.name = f"mizuoto-{name}-{self.thread_suffix}"

    @property
    def alive(self) -> bool:
        """Whether the loop's thread is running now."""
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"mizuoto-{self.name}-{self.thread_suffix}",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Answer what waits with RequestCancelled, stop the loop after its current work, and join it."""
        with self.cond:
            self.closed = True
            self._fail_waiting(RequestCancelled(f"{self.name}: the model was closed"))
            self.cond.notify_all()
            thread = self._thread
        self._settle_ends()
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_S)
            if thread.is_alive():
                log.warning("%s: the %s is still running %.0f s after close", self.name, self.label, JOIN_S)

    def _settle_ends(self) -> None:
        """End the requests' work answered under the condition (call with the condition released)."""
        with self.cond:
            ends, self._ends = self._ends, []
        for lease in ends:
            lease.end_work()

    # -- the loop (subclasses add work kinds) -----------------------------------------------------
    def _prepare(self) -> None:
        """Run once on the thread before its first work."""

    def _work(self) -> tuple[str, Any] | None:
        """What to run next (under the condition); None: the loop sleeps until notified."""
        admit = self._admission()
        if admit is not None:
            return admit
        return ("call", self._calls.popleft()) if self._calls else None

    def _admission(self) -> tuple[str, Any] | None:
        """The placement's admission when it is due (under the condition): before any other work, since
        the requests it admits bring the work that follows."""
        if not self._admit:
            return None
        self._admit = False
        self._calls.extendleft(reversed(self._aside))  # what waited for room is tried again first, in order
        self._aside = []
        return ("admit", None) if self.placement is not None else None

    def _run(self, kind: str, item: Any) -> None:
        """Run one unit of work taken by `_work` (outside the condition)."""
        if kind == "admit":
            placement = self.placement
            if placement is not None:
                with self.timing("admit"):
                    placement.schedule()
            return
        try:
            with self.timing(item.kind), within(item.lease):  # the request's code sees its lease (lease.current)
                result = item.fn()
        except RoomLater:  # its room is held by others now: aside, unanswered, until memory is let go
            with self.cond:
                self._aside.append(item)
        except BaseException as e:  # handed to the caller
            item.finish(None, e)
        else:
            item.finish(result, None)

    def _fail_work(self, kind: str, item: Any, error: BaseException) -> None:
        """The loop failed while running `item`: answer it (under the condition)."""
        if kind == "admit":  # the line is the placement's (schedule answers its own refusals): the next wake
            return
        if not item.done.is_set():
            item.finish(None, error, self._ends)

    def _fail_waiting(self, error: BaseException) -> None:
        """Everything submitted and not yet taken gets `error` (under the condition)."""
        while self._calls:
            self._calls.popleft().finish(None, error, self._ends)
        while self._aside:
            self._aside.pop(0).finish(None, error, self._ends)

    def _loop(self) -> None:
        self._prepare()
        while True:
            work = None
            try:
                with self.cond:
                    while not self.closed and (work := self._work()) is None:
                        idle = time.perf_counter()
                        self.cond.wait()
                        self._seconds["idle"] += time.perf_counter() - idle
                    if self.closed:
                        return
                    self._running = work[1] if work[0] == "call" else None
                    self._working = True
                self._run(*work)
            except BaseException as e:  # the loop's own failure: every waiter hears of it, the loop goes on
                log.exception("%s: the %s failed; its waiting requests get the error", self.name, self.label)
                error = MizuotoError(f"{self.name}: the {self.label} failed: {e!r}")
                with self.cond:
                    self.failures += 1
                    if work is not None:
                        self._fail_work(*work, error)
                    self._fail_waiting(error)
                self._settle_ends()
            finally:
                self._running = None
                self._working = False
