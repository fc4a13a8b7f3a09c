"""Runs requests through one model's stages, moving stage modules between host and device as its plan says.

Cancellation: a request run with a `cancel` event raises RequestCancelled at its next stage
call (every `use(stage)`) once the event is set.

Concurrency: `model.batch_width` requests at a time per model (one, unless its sequence stage
batches), each held from its first chunk until its generator finishes or is closed; other
threads wait their turn in arrival order: none overtakes an earlier one that is still waiting
(for a row, or for room beside the running ones), so a large request is not starved by a
stream of small ones that would each fit. A thread that opens a second stream on a model while
its first is still open gets an error instead of a deadlock. A batched request may also wait for
room: `hold(peak=..., budget=...)` admits it only while every holder, the joiner included, still
fits its own peak beside the others' working memory (checking the joiner alone would let a small
request join beside a large one that then no longer fits).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import torch

from mizuoto.runtime.engine import AudioChunk, Model, SynthesisRequest
from mizuoto.errors import InvalidRequest, RequestCancelled
from mizuoto.runtime.memory import Plan

CANCEL_POLL_S = 0.1  # how often a request waiting for its turn looks at its cancel event


class Scheduler:
    """Owns the placement of one model's movable modules; `trace` records every move as (stage, "device" | "host")."""

    def __init__(self, model: Model, device: str | torch.device, host: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.plan: Plan | None = None
        self.trace: list[tuple[str, str]] = []
        self._on_device: set[str] = set()
        self._cond = threading.Condition()
        self._owners: set[int] = set()  # threads holding the model
        self._cancels: dict[int, threading.Event | None] = {}  # each bound thread's request's
        self._held: dict[int, tuple[int, int]] = {}  # (peak, reserve) of each holder (batched models)
        self._queue: collections.deque[int] = collections.deque()  # waiting threads, first come first

    @property
    def busy(self) -> bool:
        """True while a request runs."""
        return bool(self._owners)

    def holds(self, thread: int) -> bool:
        """Whether `thread` (an ident) holds the model now."""
        return thread in self._owners

    @property
    def running(self) -> int:
        """Requests holding the model now."""
        return len(self._owners)

    @property
    def waiting(self) -> int:
        """Requests waiting to hold the model."""
        return len(self._queue)

    def together(self, joiner: tuple[int, int] | None = None) -> int:
        """Device bytes the holders (and `joiner`, as (peak, reserve)) need at once: each one's peak beside
        the others' reserves, at the largest."""
        rows = [*self._held.values(), *([joiner] if joiner else [])]
        if not rows:
            return 0
        return max(p - r for p, r in rows) + sum(r for _, r in rows)

    @contextlib.contextmanager
    def hold(self, name: str = "model", reserve: int = 0, peak: int = 0,
             budget: int | None = None, cancel: threading.Event | None = None) -> Iterator[None]:
        """Hold the model for one request of `peak` bytes that keeps `reserve` of them while others run beside it;
        with a `budget`, it joins a running batch only while `together()` stays within it. Setting
        `cancel` while it waits for its turn ends the wait with RequestCancelled (within CANCEL_POLL_S)."""
        me = threading.get_ident()
        if me in self._owners:
            raise InvalidRequest(f"a request on {name} is still open in this thread; finish or close it first")
        width = max(1, self.model.batch_width)
        with self._cond:
            self._queue.append(me)
            try:
                while self._queue[0] != me or len(self._owners) >= width or (
                        self._owners and budget is not None and self.together((peak, reserve)) > budget):
                    if cancel is not None and cancel.is_set():
                        raise RequestCancelled(f"the request was cancelled while waiting for its turn on {name}")
                    self._cond.wait(CANCEL_POLL_S if cancel is not None else None)
            finally:
                self._queue.remove(me)
                self._cond.notify_all()  # the next in line may fit now (or the line moved on without me)
            self._owners.add(me)
            self._held[me] = (max(peak, reserve), reserve)
        try:
            yield
        finally:
            with self._cond:
                self._owners.discard(me)
                self._held.pop(me, None)
                self._cond.notify_all()

    def apply(self, plan: Plan) -> None:
        """Adopt `plan`: pinned stages onto the device, the others out to the host."""
        with self._turn():
            self._apply(plan)

    def _turn(self) -> contextlib.AbstractContextManager:
        # a batched model may be running other requests' stage calls: moves wait for their turn
        return self.model.turn_lock() if self.model.batch_width > 1 else contextlib.nullcontext()

    def _apply(self, plan: Plan) -> None:
        self.plan = plan
        for name in self._resident(plan.pinned):
            self._move(name, False)
        for name in plan.pinned:
            if name not in self._on_device:
                self._move(name, True)

    def offload(self) -> None:
        """Every movable module to the host (fixed ones stay)."""
        with self._turn():
            self._offload()

    def _offload(self) -> None:
        for name in self._resident(()):
            self._move(name, False)
        self.plan = None

    def execute(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        """Run the request under the current plan (call inside `hold`); `cancel` stops it at a stage call."""
        with self.bound(cancel):
            yield from self.model.synthesize(request)

    @contextlib.contextmanager
    def bound(self, cancel: threading.Event | None = None) -> Iterator[None]:
        """Let the model's `use(stage)` calls go through this scheduler's gate during the block."""
        me = threading.get_ident()
        with self._cond:
            if not self._cancels:
                self.model.bind(self._gate)
            self._cancels[me] = cancel
        try:
            yield
        finally:
            with self._cond:
                self._cancels.pop(me, None)
                if not self._cancels:
                    self.model.bind(None)

    @contextlib.contextmanager
    def _gate(self, stage: str, hold: bool = True) -> Iterator[torch.device]:
        cancel = self._cancels.get(threading.get_ident())
        if cancel is not None and cancel.is_set():
            raise RequestCancelled(f"the request was cancelled before its {stage} stage call")
        if self.plan is None:
            raise InvalidRequest("no plan applied to this model")
        if hold:  # a batched model's turn lock is held here (Model.use): moves never overlap compute
            wanted = self.plan.group_of(stage)
            for name in self._resident(wanted):
                self._move(name, False)
            for name in wanted:
                if name not in self._on_device:
                    self._move(name, True)
        yield self.device

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
