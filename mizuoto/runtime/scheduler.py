"""Runs requests through one model's stages on its executor, moving stage modules as its plan says.

Leases: every request holds the model with its lease (`runtime.lease`), and every wait here
(its turn, a compute call) ends with that lease's cancel or deadline. A stage call checks the
lease it was given (`Model.use(stage, lease)`), or the lease of the executor call it runs in.

Executor: all of a model's heavy compute runs on one long-lived thread (`runtime.executor`). A
model whose LM batches brings its own (its batch loop, `Model.executor`) and submits its stage
calls itself; any other model is given the scheduler's Executor, and each step of the engine's
chunk iterator runs there (width 1: one request at a time, so its steps run in order). The
scheduler is that executor's placement, set once when it is made: the model's stage calls
(`Model.use`) and call reservations (`Model.room`) come here through it (`place`, `reserve`).

Concurrency: `model.batch_width` requests at a time per model (one, unless its sequence stage
batches), each held from its first chunk until its iterator finishes or is closed; other
requests wait their turn in arrival order: none overtakes an earlier one that is still waiting
(for a row, or for room beside the running ones), so a large request is not starved by a
stream of small ones that would each fit. A thread that opens a second stream on a model while
its first is still open gets an error instead of a deadlock. A batched request may also wait for
room: `hold(peak=..., budget=...)` admits it only while every holder, the joiner included, still
fits its own peak beside the others' working memory (checking the joiner alone would let a small
request join beside a large one that then no longer fits).

Placement: the runtime decides a model's target (a plan, or offloaded) under its own lock and
calls `sync()` outside it; `sync` and a stage call's moves take the scheduler's turn lock (batched
models) and then its move lock, in that order, so whichever thread syncs last
leaves the modules where the latest target says.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from mizuoto.runtime.engine import AudioChunk, Model, SynthesisRequest, takes_lease
from mizuoto.errors import InvalidRequest, MemoryBudgetError
from mizuoto.runtime.executor import JOIN_S, Executor
from mizuoto.runtime.lease import POLL_S, Lease
from mizuoto.runtime.memory import Plan, format_bytes

log = logging.getLogger("mizuoto.runtime")
_END = object()


class Scheduler:
    """Owns the placement of one model's movable modules; `trace` records every move as (stage, "device" | "host")."""

    def __init__(self, model: Model, device: str | torch.device, host: str | torch.device = "cpu",
                 name: str = "model", executor: Executor | None = None, cond: threading.Condition | None = None,
                 room: Callable[..., contextlib.AbstractContextManager] | None = None):
        self.model = model
        self._room = room  # the runtime's reservation of one stage call's working memory (Model.room)
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.plan: Plan | None = None  # the plan the modules are placed for now
        self.target: Plan | None = None  # the plan the runtime chose last (None: offloaded)
        self.trace: list[tuple[str, str]] = []
        self._on_device: set[str] = set()
        # the runtime's own condition when it made this scheduler: the holders, the line and the batch
        # budget are then decided under the one lock that also owns pins and pool admission
        self._cond = cond if cond is not None else threading.Condition()  # re-entrant (an RLock) either way
        self._moves = threading.RLock()
        # a batched model's stage calls (whole `use` blocks) and module moves take turns on it
        self._turns = threading.RLock()
        self._owners: dict[Lease, tuple[int, int]] = {}  # (peak, reserve) of each holder
        self._threads: dict[Lease, int] = {}  # the thread each holder iterates in (to refuse a self-deadlock)
        # waiting requests by arrival (their tickets); one waiting for room beside other models keeps its place
        self._queue: list[tuple[int, Lease]] = []
        self._arrivals = itertools.count()
        self._places: dict[Lease, int] = {}  # each holder's or waiter's ticket
        self._keeping: set[Lease] = set()  # waiting for room elsewhere, in line meanwhile (keep_place)
        self._growing: set[Lease] = set()  # holders waiting for room for a stage call (resize)
        self._bounds: dict[Lease, tuple[int, int]] = {}  # (peak at its largest call, reserve) of each holder
        own = getattr(model, "executor", None)
        # `executor`: the one the model was loaded on, kept for its requests (unless it brings its own)
        self.executor: Executor = own if own is not None else executor if executor is not None else Executor(name)
        self._runs_chunks = own is None  # else the engine submits its own compute to its executor
        model.executor = self.executor
        self.executor.placement = self

    @property
    def busy(self) -> bool:
        """True while a request holds the model."""
        return bool(self._owners)

    @property
    def running(self) -> int:
        """Requests holding the model now."""
        return len(self._owners)

    @property
    def waiting(self) -> int:
        """Requests waiting to hold the model."""
        return len(self._queue)

    def together(self) -> int:
        """Device bytes the holders need at once: each one's peak beside the others' reserves, at the largest."""
        with self._cond:
            rows = list(self._owners.values())
        if not rows:
            return 0
        return max(p - r for p, r in rows) + sum(r for _, r in rows)

    def resize(self, lease: Lease, peak: int, budget: int | None = None, wait: bool = True) -> None:
        """A holder's peak for its next stage call (its reserve, what it keeps while others run, stays).

        With a `budget`, a larger peak waits until it fits beside the other holders' reserves (one
        leaving, or shrinking back after a call of its own), until the lease's end; when every other
        holder waits to grow too, none can give room to another and this one gives way at once
        (MemoryBudgetError); so it does without `wait` (a call on the model's own compute loop).
        """
        with self._cond:
            if lease not in self._owners:
                return
            reserve = self._owners[lease][1]
            grown = (max(peak, reserve), reserve)

            def fits() -> bool:
                if lease not in self._owners:  # it ended meanwhile
                    return True
                rows = [grown if other is lease else held for other, held in self._owners.items()]
                if budget is None or max(p - r for p, r in rows) + sum(r for _, r in rows) <= budget:
                    return True
                if not wait or set(self._owners) - {lease} <= self._growing:
                    raise MemoryBudgetError(
                        f"a stage call needs {format_bytes(grown[0])} beside the other requests running on this"
                        f" model, which wait for room too; it gives way (retry, or raise the budget)")
                return False
            self._growing.add(lease)
            try:
                lease.wait_for(self._cond, fits, "while waiting for room beside the requests running with it")
            finally:
                self._growing.discard(lease)
            if lease in self._owners:
                self._owners[lease] = grown
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self, lease: Lease, name: str = "model", reserve: int = 0, peak: int = 0,
             budget: int | None = None, bound: int | None = None) -> Iterator[None]:
        """Hold the model for one request of `peak` bytes that keeps `reserve` of them while others run beside it;
        with a `budget`, it joins a running batch only while `together()` stays within it. The lease's
        cancel or deadline ends the wait for a turn (RequestCancelled)."""
        me = threading.get_ident()
        width = max(1, self.model.batch_width)
        with self._cond:
            if me in self._threads.values():
                raise InvalidRequest(f"a request on {name} is still open in this thread; finish or close it first")
            if lease not in self._keeping:
                ticket = self._places.setdefault(lease, next(self._arrivals))
                bisect.insort(self._queue, (ticket, lease), key=lambda entry: entry[0])

            def turn() -> bool:
                if self._queue[0][1] is not lease or len(self._owners) >= width:
                    return False
                if not self._owners or budget is None:
                    return True
                # joining: every holder's largest call (its bound) must fit beside the others' reserves, so
                # that no row's call can later wait for room only rows waiting to grow too could give
                rows = [*self._bounds.values(), (max(bound or peak, reserve), reserve)]
                return max(p - r for p, r in rows) + sum(r for _, r in rows) <= budget
            try:
                lease.wait_for(self._cond, turn, f"while waiting for its turn on {name}")
            except BaseException:
                self._places.pop(lease, None)
                raise
            finally:
                self._queue = [entry for entry in self._queue if entry[1] is not lease]
                self._keeping.discard(lease)
                self._cond.notify_all()  # the next in line may fit now (or the line moved on without me)
            self._owners[lease] = (max(peak, reserve), reserve)
            self._bounds[lease] = (max(bound or peak, reserve), reserve)
            self._threads[lease] = me
        try:
            yield
        finally:
            with self._cond:
                self._threads.pop(lease, None)  # this thread may open another request now
            lease.after_work(lambda: self._let_go(lease))  # the model stays held while its work runs

    def keep_place(self, lease: Lease) -> None:
        """Call inside `hold` before leaving it to wait for room elsewhere: the request stays in line at its place, so
        none that came later takes the model meanwhile; it enters `hold` again at the front, or `leave_line`."""
        with self._cond:
            self._keeping.add(lease)
            bisect.insort(self._queue, (self._places[lease], lease), key=lambda entry: entry[0])

    def leave_line(self, lease: Lease) -> None:
        """The request no longer waits (it runs, or ended while waiting for room): its place goes."""
        with self._cond:
            if lease in self._keeping:
                self._keeping.discard(lease)
                self._queue = [entry for entry in self._queue if entry[1] is not lease]
            if lease not in self._owners:
                self._places.pop(lease, None)
            self._cond.notify_all()

    def _let_go(self, lease: Lease) -> None:
        """The request's hold ends (its last work on the model has ended)."""
        with self._cond:
            if lease not in self._keeping:
                self._places.pop(lease, None)
            self._owners.pop(lease, None)
            self._bounds.pop(lease, None)
            self._cond.notify_all()

    # -- placement --------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> None:
        """Adopt `plan` now: pinned stages onto the device, the others out to the host."""
        self.target = plan
        self.sync()

    def offload(self) -> None:
        """Every movable module to the host now (fixed ones stay)."""
        self.target = None
        self.sync()

    def sync(self, lease: Lease | None = None) -> None:
        """Move the modules where the latest target says (the runtime set it under its lock).

        On a batched model the moves wait for the stage call running now; a `lease` ends that wait
        (RequestCancelled), leaving the moves to the next sync or stage call.
        """
        with self._turn(lease, "while its model's modules waited to move"), self._moves:
            plan = self.target
            if plan is None:
                for name in self._resident(()):
                    self._move(name, False)
                self.plan = None
                return
            self.plan = plan
            for name in self._resident(plan.pinned):
                self._move(name, False)
            for name in plan.pinned:
                if name not in self._on_device:
                    self._move(name, True)

    @contextlib.contextmanager
    def _turn(self, lease: Lease | None = None, where: str = "") -> Iterator[None]:
        # a batched model may be running other requests' stage calls: moves wait for their turn,
        # in slices that look at the waiting request's lease
        if self.model.batch_width <= 1:
            yield
            return
        while not self._turns.acquire(timeout=POLL_S):
            if lease is not None:
                lease.check(where)
        try:
            yield
        finally:
            self._turns.release()

    # -- running ----------------------------------------------------------------------------------
    def execute(self, request: SynthesisRequest, lease: Lease) -> Iterator[AudioChunk]:
        """Run the request under the current plan (call inside `hold`); the lease stops it at a stage call."""
        if not self._runs_chunks:
            yield from self._synthesize(request, lease)
            return
        chunks = self.executor.call(lambda: iter(self._synthesize(request, lease)), lease)
        try:
            while (chunk := self.executor.call(lambda: next(chunks, _END), lease)) is not _END:
                yield chunk
        finally:
            # The engine's cleanup runs where its work ran, after a step still running for this request
            # (which stops at its next stage call). It is the request's last work: what the request
            # holds is released when it has run (Lease.after_work), by the loop if this thread gave up.
            try:
                closing = self.executor.post(chunks.close, lease, "close")
                if not lease.cancelled:
                    self.executor.wait_for(closing.done, Lease(JOIN_S), "while its request closed")
                    if closing.error is not None:
                        raise closing.error
            except Exception as e:  # a `finally`: logged, not raised over the request's own outcome
                log.warning("%s: closing a request on its executor: %s", self.executor.name, e)

    def _synthesize(self, request: SynthesisRequest, lease: Lease) -> Iterator[AudioChunk]:
        if takes_lease(self.model):
            return self.model.synthesize(request, lease=lease)
        return self.model.synthesize(request)

    def close(self) -> None:
        """Stop and join the executor this scheduler made (a model's own one closes with the model); the model,
        if used on, runs where its modules are."""
        self.executor.placement = None
        if self._runs_chunks:
            self.executor.close()
            self.model.executor = None

    # -- the executor's placement (Model.use, Model.room) ----------------------------------------
    @contextlib.contextmanager
    def place(self, stage: str, lease: Lease | None = None) -> Iterator[torch.device]:
        """`stage`'s modules where the plan groups them for the block (a batched model's calls take turns)."""
        running = self.executor.running_lease() if lease is None else None  # Model.use checked a given one
        if running is not None:
            running.check(f"before its {stage} stage call")
        # moves never overlap another request's compute on a batched model
        with self._turn(lease if lease is not None else running, f"before its {stage} stage call"):
            if self.plan is None:
                raise InvalidRequest("no plan applied to this model")
            with self._moves:
                wanted = self.plan.group_of(stage)
                for name in self._resident(wanted):
                    self._move(name, False)
                for name in wanted:
                    if name not in self._on_device:
                        self._move(name, True)
            yield self.device

    def reserve(self, stage: str, lease: Lease | None, working: int, sizes: dict) -> contextlib.AbstractContextManager:
        """The runtime's room for one call (`Model.room`): for the lease given, or the executor call's it is made in."""
        lease = lease if lease is not None else self.executor.running_lease()
        if self._room is None or lease is None:
            return contextlib.nullcontext()
        return self._room(stage, lease, working, sizes)

    def _resident(self, keep: tuple[str, ...]) -> list[str]:
        """Stages on the device that are not in `keep`, in stage order."""
        return [s.name for s in self.model.stages if s.name in self._on_device and s.name not in keep]

    def _move(self, name: str, to_device: bool) -> None:
        # Tracked by intent, not by comparing devices: on a CPU-only machine device and host coincide.
        device = self.device if to_device else self.host
        for module in self.model.stage(name).movable().values():
            module.to(device)
        if to_device:
            self._on_device.add(name)
        else:
            self._on_device.discard(name)
        self.trace.append((name, "device" if to_device else "host"))
