"""A model's requests: its line in arrival order, their admission by the model's loop, their memory together.

Each request on a model is a `runtime.request.Request` owned here, with its lease
(`runtime.lease`); every wait here ends with that lease's cancel or deadline. A request goes into
the line (`hold`) and the model's loop admits it (`schedule`, a unit of the loop's work, run when
something came into the line or let go anywhere in the runtime): in arrival order,
`model.batch_width` at a time, none overtaking an earlier one that still waits (for a place, for
room beside the running ones, or for memory other models' requests hold), so a large request is
not starved by a stream of small ones that would each fit. The request's thread only waits for
the answer; leaving the line is a message the loop acts on when it is admitting that request at
the moment. A request holds the model from its admission until its block has ended and its last
work on the model has ended (`Lease.after_work`: a cancelled request's call still running keeps
the model). A batched request joins only while every holder, the joiner included, still fits its
own peak beside the others' working memory (checking the joiner alone would let a small request
join beside a large one that then no longer fits); a holder's later, larger call grows its peak
(`resize`).

`RequestLine` is the request half of a model's `runtime.scheduler.Scheduler` (its base class),
which adds where the model's stages are placed and how a request's chunks run.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

from mizuoto.errors import InvalidRequest, MemoryBudgetError, RequestCancelled
from mizuoto.runtime.engine import Model
from mizuoto.runtime.executor import Executor, RoomLater
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.memory import format_bytes
from mizuoto.runtime.request import ENDING, FINISHED, RUNNING, WAITING, WAITING_FOR_MEMORY, Request, RequestInfo

RECENT = 32  # finished requests a line keeps for `requests(finished=True)`


class RequestLine:
    """One model's requests in line and holding it; `executor` (the model's loop, which runs `schedule`) is set by
    the subclass before any request comes."""

    executor: Executor

    def __init__(self, model: Model, name: str, cond: threading.Condition | None,
                 released: Callable[[], None] | None) -> None:
        self.model = model
        self.name = name
        # the runtime's own condition when it made the scheduler: the holders, the line and the batch budget are
        # then decided under the one lock that also owns pins and pool admission
        self._cond = cond if cond is not None else threading.Condition()  # re-entrant (an RLock) either way
        # called (outside the lock) when a request of this model lets go: the runtime wakes every model's line,
        # since memory this model's requests held may be what another model's first in line waits for
        self._released = released if released is not None else self.wake
        # every request in line or holding the model, and the line itself (arrival order); a request is the
        # line's until its work on the model has ended (runtime.request)
        self._requests: dict[Lease, Request] = {}
        self._queue: list[Request] = []
        self._admitting: Request | None = None  # the request the loop is admitting now (outside the condition)
        self._arrivals = itertools.count()
        self.finished: collections.deque[Request] = collections.deque(maxlen=RECENT)  # the last ones, for requests()

    def _holders(self) -> list[Request]:
        return [r for r in self._requests.values() if r.holds]

    @property
    def busy(self) -> bool:
        """True while a request holds the model (running, or ending while its work runs)."""
        with self._cond:
            return any(r.holds for r in self._requests.values())

    @property
    def running(self) -> int:
        """Requests holding the model now."""
        with self._cond:
            return len(self._holders())

    @property
    def waiting(self) -> int:
        """Requests waiting to hold the model (in line, or keeping their place while they wait for memory)."""
        return len(self._queue)

    def requests(self, finished: bool = False) -> list[RequestInfo]:
        """The requests in line or holding the model, in arrival order (with `finished`, the last ones that ended)."""
        with self._cond:
            live = sorted(self._requests.values(), key=lambda r: r.ticket)
            return [r.info() for r in (list(self.finished) if finished else []) + live]

    def together(self) -> int:
        """Device bytes the holders need at once: each one's peak beside the others' reserves, at the largest."""
        with self._cond:
            rows = [(r.peak, r.reserve) for r in self._holders()]
        if not rows:
            return 0
        return max(p - r for p, r in rows) + sum(r for _, r in rows)

    def resize(self, lease: Lease, peak: int, budget: int | None = None, wait: bool = True) -> None:
        """A holder's peak for its next stage call (its reserve, what it keeps while others run, stays).

        With a `budget`, a larger peak waits until it fits beside the other holders' reserves (one
        leaving, or shrinking back after a call of its own), until the lease's end; when every other
        holder waits to grow too, none can give room to another and this one gives way at once
        (MemoryBudgetError). Without `wait` (a call on the model's own compute loop, which never
        waits) it raises `RoomLater` instead of waiting, and stays marked as growing: the loop puts
        the call aside and tries it again when something lets go.
        """
        with self._cond:
            me = self._requests.get(lease)
            if me is None or not me.holds:
                return
            grown = max(peak, me.reserve)

            def fits() -> bool:
                if not me.holds:  # it ended meanwhile
                    return True
                rows = [(grown if r is me else r.peak, r.reserve) for r in self._holders()]
                if budget is None or max(p - r for p, r in rows) + sum(r for _, r in rows) <= budget:
                    return True
                if all(r.growing for r in self._holders() if r is not me):
                    raise MemoryBudgetError(
                        f"a stage call needs {format_bytes(grown)} beside the other requests running on this"
                        f" model, which wait for room too; it gives way (retry, or raise the budget)")
                if not wait:
                    raise RoomLater(f"{format_bytes(grown)} beside the requests running with it")
                return False
            if budget is not None:  # it may wait to grow (without a budget it only shrinks back)
                me.growing, aside = True, False
                try:
                    lease.wait_for(self._cond, fits, "while waiting for room beside the requests running with it")
                except RoomLater:
                    aside = True  # still waiting to grow, put aside on the loop
                    raise
                finally:
                    me.growing = aside
            shrunk = me.holds and grown < me.peak
            if me.holds:
                me.peak = grown
            self._cond.notify_all()
        if shrunk and self._queue:
            self.wake()  # a smaller peak may let the first in line join

    @contextlib.contextmanager
    def hold(self, lease: Lease, name: str = "model", reserve: int = 0, peak: int = 0,
             budget: int | None = None, bound: int | None = None,
             admit: Callable[[int], bool] | None = None) -> Iterator[None]:
        """Hold the model for one request of `peak` bytes that keeps `reserve` of them while others run beside it;
        with a `budget`, it joins a running batch only while `together()` stays within it.

        The request goes into the model's line and the model's loop admits it (`schedule`): in
        arrival order, when a place is free and, with `admit`, once `admit(others)` made room for
        it beside the `others` bytes the requests running already need (False: memory other
        models' requests hold is not free yet; it waits at the head of the line for it). This
        thread only waits for the loop's answer; the lease's cancel or deadline ends that wait
        (RequestCancelled) and takes the request out of line. The hold ends when the block has
        ended and so has the request's work on the model (`Lease.after_work`).
        """
        me = threading.get_ident()
        if self.executor.on_thread():
            raise InvalidRequest(f"a request on {name} cannot start on its model's own compute loop")
        with self._cond:
            if any(r.thread == me for r in self._holders()):
                raise InvalidRequest(f"a request on {name} is still open in this thread; finish or close it first")
            if lease in self._requests:
                raise InvalidRequest(f"this request already holds or waits for {name}")
            request = self._requests[lease] = Request(lease, self.name, next(self._arrivals))
            request.admit, request.asked = admit, (max(peak, reserve), reserve, budget, max(bound or peak, reserve))
            # its admission is its lease's work until decided: the lease is not released under the loop's admit
            request.deciding = True
            lease.begin_work()
            bisect.insort(self._queue, request, key=lambda r: r.ticket)
        try:
            self.executor.check_open()
            self.wake()
            with self._cond:
                while request.status in (WAITING, WAITING_FOR_MEMORY):
                    status = request.status
                    where = (f"while waiting for its turn on {name}" if status == WAITING
                             else "while waiting for memory held by other models")
                    lease.wait_for(self._cond, lambda: request.status != status, where)
                if request.error is not None:
                    raise request.error
                if not request.holds:  # taken out of line by the loop: its lease ended
                    lease.check(f"while waiting for its turn on {name}")
                    raise RequestCancelled(f"the request ended while waiting for its turn on {name}: {request.reason}")
                request.thread = me
        except BaseException as e:
            self._abandon(request, e)
            raise
        try:
            yield
        finally:
            with self._cond:
                request.thread = None  # this thread may open another request now
                if request.status == RUNNING:
                    request.status = ENDING
            lease.after_work(lambda: self._let_go(request))  # the model stays held while its work runs

    def _abandon(self, request: Request, error: BaseException) -> None:
        """The request's thread stopped waiting for its admission (its lease ended, or it was refused)."""
        ended, admitted = False, False
        with self._cond:
            if request.holds:  # admitted as it gave up: its hold ends like any other's
                request.thread, request.status, admitted = None, ENDING, True
            elif request is self._admitting:
                request.left = True  # the loop is admitting it now: it takes it out once admit() has answered
            elif request.status != FINISHED:
                if request in self._queue:
                    self._queue.remove(request)
                self._end(request, f"{type(error).__name__}: {error}")
            if not request.left and request.deciding:
                request.deciding, ended = False, True
            self._cond.notify_all()
        if admitted:
            request.lease.after_work(lambda: self._let_go(request))
        if ended:
            request.lease.end_work()
        self.wake()  # the line moved on without it

    def wake(self) -> None:
        """Have the model's loop look at its line and at the work it put aside for room (a request came, one let go,
        or memory was freed somewhere)."""
        self.executor.wake()  # unconditional: work put aside just now must not miss a release that came meanwhile

    def schedule(self) -> None:
        """Admit waiting requests in arrival order while each fits: the model's loop's admission (its own thread).

        Should the line's own bookkeeping fail (a bug, not a refusal: `admit`'s errors go to their
        request), the head of the line hears that error at once rather than at its deadline, and the
        loop logs it (`Executor._fail_work`).
        """
        try:
            self._admit_in_order()
        except BaseException as bug:
            self._refuse_head(bug)
            raise

    def _refuse_head(self, error: BaseException) -> None:
        """Answer the first request still in line with `error` (its thread raises it)."""
        ended = None
        with self._cond:
            self._admitting = None
            head = next((r for r in self._queue if not r.left), None)
            if head is not None:
                self._queue.remove(head)
                head.error = error
                self._end(head, f"{type(error).__name__}: {error}")
                if head.deciding:
                    head.deciding, ended = False, head.lease
            self._cond.notify_all()
        if ended is not None:
            ended.end_work()

    def _admit_in_order(self) -> None:
        """`schedule`'s work.

        A request is admitted when a place is free (`batch_width`), it fits beside the requests
        running with it (their `budget`), and its `admit` made room on the device; when memory
        other models' requests hold is not free yet, it keeps the head of the line and the loop
        tries again at its next wake. A request whose lease ended, or whose thread left, is taken
        out of line here; a refusal (its `admit` raised) goes to its thread.
        """
        width = max(1, self.model.batch_width)
        while True:
            ends: list[Lease] = []
            with self._cond:
                head = None
                while self._queue and head is None:
                    first = self._queue[0]
                    if not (first.left or first.lease.cancelled):
                        head = first
                        break
                    self._queue.pop(0)
                    self._end(first)
                    if first.deciding:  # its admission, its lease's work, ends here
                        first.deciding = False
                        ends.append(first.lease)
                    self._cond.notify_all()
                if head is not None and not self._fits(head, width):
                    head = None
                if head is None:
                    break
                peak, reserve, _, _ = head.asked
                rows = [*((r.peak, r.reserve) for r in self._holders()), (peak, reserve)]
                others = max(p - r for p, r in rows) + sum(r for _, r in rows) - peak
                self._admitting = head
            try:
                admitted, error = (head.admit(others) if head.admit is not None else True), None
            except BaseException as e:  # refused: its thread raises it
                admitted, error = False, e
            with self._cond:
                self._admitting = None
                decided = admitted or error is not None or head.left
                if decided:
                    self._queue.remove(head)
                    head.deciding = False
                if admitted:
                    peak, reserve, _, bound = head.asked
                    head.status, head.peak, head.reserve, head.bound = RUNNING, peak, reserve, bound
                    if head.left:
                        head.status = ENDING
                elif error is not None:
                    head.error = error
                    self._end(head, f"{type(error).__name__}: {error}")
                elif head.left:
                    self._end(head)
                else:
                    head.status = WAITING_FOR_MEMORY
                self._cond.notify_all()
            for lease in ends:
                lease.end_work()
            if decided:
                head.lease.end_work()
            if admitted and head.left:
                head.lease.after_work(lambda r=head: self._let_go(r))
            if not decided:
                return  # the head waits for memory: nothing behind it overtakes it
        for lease in ends:
            lease.end_work()

    def _fits(self, request: Request, width: int) -> bool:
        """Whether `request` may join the requests holding the model now (under the condition)."""
        holders = self._holders()
        if len(holders) >= width:
            return False
        peak, reserve, budget, bound = request.asked
        if not holders or budget is None:
            return True
        # joining: every holder's largest call (its bound) must fit beside the others' reserves, so that no
        # row's call can later wait for room only rows waiting to grow too could give
        rows = [*((r.bound, r.reserve) for r in holders), (bound, reserve)]
        return max(p - r for p, r in rows) + sum(r for _, r in rows) <= budget

    def failed(self, lease: Lease, error: BaseException) -> None:
        """Note the error a holding request ends with (its reason once it finishes)."""
        with self._cond:
            request = self._requests.get(lease)
            if request is not None and request.reason is None:
                request.reason = f"{type(error).__name__}: {error}"

    def _let_go(self, request: Request) -> None:
        """The request's hold ends (its last work on the model has ended): the loop looks at the line again."""
        with self._cond:
            if request.holds:
                self._end(request)
            self._cond.notify_all()
        self._released()

    def _end(self, request: Request, reason: str | None = None) -> None:
        """It is finished (under the condition): out of the scheduler, into the recent ones."""
        request.finish(reason)
        if self._requests.get(request.lease) is request:
            del self._requests[request.lease]
            self.finished.append(request)

    def refuse_line(self) -> None:
        """Refuse every request still in line (its model closes): each one's thread raises RequestCancelled."""
        refused = []
        with self._cond:
            for request in [r for r in self._queue if r is not self._admitting]:  # that one: the loop answers it
                self._queue.remove(request)
                request.error = RequestCancelled(f"{self.name}: the model was closed")
                self._end(request, str(request.error))
                if request.deciding:
                    request.deciding = False
                    refused.append(request.lease)
            self._cond.notify_all()
        for lease in refused:
            lease.end_work()
