"""Runs requests through one model's stages, moving stage modules between host and device as its plan says.

Cancellation: a request run with a `cancel` event raises RequestCancelled at its next stage
call (every `use(stage)`) once the event is set.

Concurrency: one request at a time per model, by a lock held from the first chunk until the
generator finishes or is closed; other threads wait their turn (a lock, not a queue: arrival
order is not guaranteed). A thread that opens a second stream on a model while its first is
still open gets an error instead of a deadlock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from mizuoto.runtime.engine import AudioChunk, Model, SynthesisRequest
from mizuoto.errors import InvalidRequest, RequestCancelled
from mizuoto.runtime.memory import Plan


class Scheduler:
    """Owns the placement of one model's movable modules; `trace` records every move as (stage, "device" | "host")."""

    def __init__(self, model: Model, device: str | torch.device, host: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.plan: Plan | None = None
        self.trace: list[tuple[str, str]] = []
        self._on_device: set[str] = set()
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._cancel: threading.Event | None = None  # the running request's

    @property
    def busy(self) -> bool:
        """True while a request runs."""
        return self._lock.locked()

    @contextlib.contextmanager
    def hold(self, name: str = "model") -> Iterator[None]:
        """Hold the model for one request."""
        if self._owner == threading.get_ident():
            raise InvalidRequest(f"a request on {name} is still open in this thread; finish or close it first")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def apply(self, plan: Plan) -> None:
        """Adopt `plan`: pinned stages onto the device, the others out to the host."""
        self.plan = plan
        for name in self._resident(plan.pinned):
            self._move(name, False)
        for name in plan.pinned:
            if name not in self._on_device:
                self._move(name, True)

    def offload(self) -> None:
        """Every movable module to the host (fixed ones stay)."""
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
        self._cancel = cancel
        self.model.bind(self._gate)
        try:
            yield
        finally:
            self.model.bind(None)
            self._cancel = None

    @contextlib.contextmanager
    def _gate(self, stage: str) -> Iterator[torch.device]:
        if self._cancel is not None and self._cancel.is_set():
            raise RequestCancelled(f"the request was cancelled before its {stage} stage call")
        if self.plan is None:
            raise InvalidRequest("no plan applied to this model")
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
