"""One request on one model as its model's scheduler owns it: its lease, its place in line, its status.

A request's status moves one way, each move made under its scheduler's condition; every move out
of the line (admitted, or refused) is made by the model's loop (`Scheduler.schedule`), except that
a request leaving the line before the loop looks at it takes itself out:

    waiting -> (waiting for memory) -> running -> ending -> finished

- `waiting`: in its model's line, in arrival order.
- `waiting for memory`: its turn came, but memory that other models' requests hold is not free yet;
  it keeps its place at the head of the line meanwhile (no later request on the model overtakes it),
  and the loop tries again when memory is let go anywhere in the runtime.
- `running`: it holds the model; `stage` names the stage call it runs now (None between calls).
- `ending`: its iterator ended or was closed, or its caller gave up; work of its still runs on the
  model (a call that had started), and the model stays its own until that work has ended.
- `finished`: everything it held is released; `reason` says how it ended ("done", "cancelled ...",
  "past its deadline", or the error it ended with).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mizuoto.runtime.lease import Lease

WAITING = "waiting"
WAITING_FOR_MEMORY = "waiting for memory"
RUNNING = "running"
ENDING = "ending"
FINISHED = "finished"
HOLDING = (RUNNING, ENDING)  # the statuses of a request that holds its model


@dataclass(frozen=True)
class RequestInfo:
    """A request as `Runtime.requests()` shows it: where it stands now."""

    model: str
    status: str
    stage: str | None
    reason: str | None
    seconds: float  # since it arrived


@dataclass(eq=False)
class Request:
    """The scheduler's record of one request (read and written under the scheduler's condition)."""

    lease: Lease
    model: str
    ticket: int  # its place in its model's line: arrival order
    peak: int = 0  # device bytes it needs at its largest now (its next stage call's)
    reserve: int = 0  # of which it keeps this much while others run beside it (its KV cache)
    bound: int = 0  # the peak of its largest possible call (joining a batch is decided on it)
    thread: int | None = None  # the thread iterating it while it is open (a second open request there deadlocks)
    status: str = WAITING
    stage: str | None = None
    reason: str | None = None
    growing: bool = False  # waiting for room beside the requests running with it (Scheduler.resize)
    arrived: float = field(default_factory=time.monotonic)
    # what the loop admits it with: its memory (others' bytes -> admitted, or False to wait for memory), its figures
    admit: Callable[[int], bool] | None = None
    asked: tuple[int, int, int | None, int] = (0, 0, None, 0)  # (peak, reserve, budget, bound) it asked to hold with
    deciding: bool = False  # its admission is its lease's work on the loop until the loop (or its leaving) decides
    left: bool = False  # its thread gave up while the loop was admitting it: a message the loop acts on
    error: BaseException | None = None  # why it was refused, for its thread to raise

    @property
    def holds(self) -> bool:
        """Whether it holds its model now (running, or ending while its work runs)."""
        return self.status in HOLDING

    def finish(self, reason: str | None = None) -> None:
        """Mark it finished; the reason is the first one given, else what its lease says."""
        self.status, self.stage = FINISHED, None
        if self.reason is None:
            self.reason = reason if reason is not None else ended_by(self.lease)

    def info(self) -> RequestInfo:
        """A snapshot for `Runtime.requests()`."""
        return RequestInfo(self.model, self.status, self.stage, self.reason, time.monotonic() - self.arrived)


def ended_by(lease: Lease) -> str:
    """How a request with this lease ended when nothing else was said: cancelled, past its deadline, or done."""
    if lease.event.is_set():
        return f"cancelled {lease.reason}"
    if lease.expired:
        return "past its deadline"
    return "done"
