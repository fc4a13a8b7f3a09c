"""Runs requests through one model's stages on its executor, moving stage modules as its plan says.

Requests: a model's line and its requests' admission are `runtime.request_line.RequestLine`, this
class's base: `model.batch_width` requests at a time per model, admitted by the model's loop in
arrival order (`hold`, `schedule`). Every wait here (a compute call, module moves) ends with the
request's lease's cancel or deadline. A stage call checks the lease of the request whose code
runs (`runtime.lease.current`, set around each step of the engine's iterator and each compute
call). A thread that opens a second stream on a model while its first is still open gets an
error instead of a deadlock.

Executor: all of a model's heavy compute runs on one long-lived thread (`runtime.executor`). A
model whose LM batches runs it on its continuous batch's loop (`Model.batch_loop`, made from the
sequence stage it declares); any other model is given the scheduler's Executor. At width 1 each
step of the engine's chunk iterator runs there (one request at a time, so its steps run in
order); above it, each request's iterator runs in its own thread and sends its compute there
(`Model.compute`, `Model.decode`). The scheduler is that executor's placement, set once when it
is made: the line's admission (`schedule`), the model's stage calls (`Model.use`) and call
reservations (`Model.room`) come here through it (`schedule`, `place`, `reserve`).

Placement: the runtime decides a model's target (a plan, or offloaded) under its own lock and
calls `sync()` outside it; `sync` and a stage call's moves take the scheduler's turn lock (batched
models) and then its move lock, in that order, so whichever thread syncs last
leaves the modules where the latest target says.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from mizuoto.runtime.engine import AudioChunk, Model, SynthesisRequest
from mizuoto.errors import InvalidRequest
from mizuoto.runtime.executor import JOIN_S, Executor
from mizuoto.runtime.lease import POLL_S, Lease, within
from mizuoto.runtime.memory import Plan
from mizuoto.runtime.request_line import RequestLine

log = logging.getLogger("mizuoto.runtime")
_END = object()


class Scheduler(RequestLine):
    """One model's requests (its `RequestLine`), the placement of its movable modules and its requests' runs;
    `trace` records every move as (stage, "device" | "host")."""

    def __init__(self, model: Model, device: str | torch.device, host: str | torch.device = "cpu",
                 name: str = "model", executor: Executor | None = None, cond: threading.Condition | None = None,
                 room: Callable[..., contextlib.AbstractContextManager] | None = None,
                 released: Callable[[], None] | None = None):
        super().__init__(model, name, cond, released)
        self._room = room  # the runtime's reservation of one stage call's working memory (Model.room)
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.plan: Plan | None = None  # the plan the modules are placed for now
        self.target: Plan | None = None  # the plan the runtime chose last (None: offloaded)
        self.trace: list[tuple[str, str]] = []
        self._on_device: set[str] = set()
        self._moves = threading.RLock()
        # a batched model's stage calls (whole `use` blocks) and module moves take turns on it
        self._turns = threading.RLock()
        own = model.batch_loop()  # a batching model's continuous batch, made now (at load) if not yet
        # `executor`: the one the model was loaded on, kept for its requests (unless it batches: its batch loop)
        self.executor: Executor = own if own is not None else executor if executor is not None else Executor(name)
        # A model running one request at a time has each step of its chunk iterator run on the executor here. One
        # that runs several at once (batch_width > 1) runs its requests' own code in their threads and submits its
        # compute (Model.compute, Model.decode) to the executor: the runtime's, or the model's batch loop.
        self._runs_chunks = own is None and model.batch_width <= 1
        self._made = own is None  # the scheduler made the executor (else it is the model's batch)
        model.executor = self.executor
        self.executor.placement = self

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
        """The engine's chunks, each step of its iterator run as the request (`lease.current()` is its lease)."""
        with within(lease):
            chunks = iter(self.model.synthesize(request))
        try:
            while True:
                with within(lease):
                    chunk = next(chunks, _END)
                # a cancel or deadline that came during the step's last stage call ends the request here
                # (on a batched model no later stage call of this request would see it)
                lease.check("after its stage call")
                if chunk is _END:
                    return
                yield chunk
        finally:
            with within(lease):
                chunks.close()

    def close(self) -> None:
        """Refuse the requests still in line, stop and join the model's compute loop (the executor this scheduler
        made, or the model's batch: an engine's own close need not remember it; closing twice is harmless); the
        model, if used on, runs where its modules are."""
        self.refuse_line()
        self.executor.placement = None
        self.executor.close()
        if self._made:
            self.model.executor = None

    # -- the executor's placement (Model.use, Model.room) ----------------------------------------
    @contextlib.contextmanager
    def place(self, stage: str, lease: Lease | None = None) -> Iterator[torch.device]:
        """`stage`'s modules where the plan groups them for the block (a batched model's calls take turns)."""
        running = self.executor.running_lease() if lease is None else None  # Model.use checked a given one
        if running is not None:
            running.check(f"before its {stage} stage call")
        lease = lease if lease is not None else running
        # moves never overlap another request's compute on a batched model
        with self._turn(lease, f"before its {stage} stage call"):
            if self.plan is None:
                raise InvalidRequest("no plan applied to this model")
            with self._moves:
                wanted = self.plan.group_of(stage)
                for name in self._resident(wanted):
                    self._move(name, False)
                for name in wanted:
                    if name not in self._on_device:
                        self._move(name, True)
            request = self._requests.get(lease)
            if request is not None:
                request.stage = stage  # what the request runs now (Runtime.requests)
            try:
                yield self.device
            finally:
                if request is not None:
                    request.stage = None

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
