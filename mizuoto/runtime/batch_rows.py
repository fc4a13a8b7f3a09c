"""A continuous batch's per-request state (runtime.batching): its rows, its sequences and what a pass copies.

Every field is read and written under the batcher's condition, except a row's cache and sampler and
a sequence's token loop, which only the batch loop's thread touches.
"""

from __future__ import annotations

import contextvars
import queue
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mizuoto.errors import RequestCancelled
from mizuoto.runtime.lease import Lease


class Stopped(RequestCancelled):
    """The request consuming a sequence went away; its loop is closed."""


# A row's states: IDLE (its sequence's loop runs or waits), PENDING (an input waits for a pass), RUNNING (in one).
IDLE, PENDING, RUNNING = "idle", "pending", "running"
# A sequence's states (runtime.batching's docstring says what each means).
READY, FORWARD, TEXT, ENDED = "ready", "forward", "text", "ended"
ASIDE = "aside"  # a sequence whose room others hold as it starts: it starts again when memory is let go


class Row:
    """One row of a sequence in the batch: its cache and the input it waits a pass for (under the batcher's condition)."""

    def __init__(self, batcher: Any, index: int, lease: Lease | None) -> None:  # batcher: its DecodeBatcher
        self.batcher, self.index, self.lease = batcher, index, lease
        self.cache: Any = None
        self.sampler = batcher.sampler
        self.state = IDLE
        self.pending: torch.Tensor | None = None
        self.line: Line | None = None

    def attach(self, cache: Any) -> "Row":
        """Adopt the KV cache the engine made for this row."""
        self.cache = cache
        return self

    def compute(self, fn: Callable[[], Any]) -> Any:
        """fn() on the batch loop's thread (the engine builds its LM input there: no OpenMP team elsewhere)."""
        return self.batcher.call(fn, self.lease, "lm input")

    def draw(self, scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        """One token id from `scores`, with this row's generator (the engine's sampler, as unbatched)."""
        return (self.batcher.fast_sampler if scores.device.type == "cuda" else self.sampler)(scores, decoded, generator)


class Line:
    """One sequence: its rows, its token loop (a coroutine made on the loop's thread) and what it is owed.

    Every field but `loop` is read and written under the batcher's condition.
    """

    def __init__(self, rows: tuple[Row, ...], make: Callable[[], Iterator[int]], lease: Lease | None) -> None:
        self.rows, self.make, self.lease = rows, make, lease
        self.context = contextvars.copy_context()  # the request's: lease.current() is its lease in its loop
        self.loop: Any = None
        self.state = READY
        self.value: Any = None  # what the loop is resumed with: a pass's results, or a streamed item
        self.error: BaseException | None = None  # ... or thrown into it
        self.answers: dict[int, Any] = {}  # row index -> its result in the pass the line waits for
        self.out: queue.Queue = queue.Queue()  # tokens, Next requests, then the end or an error
        self.left = False  # the request stopped reading: its loop is closed at its next resume
        self.started = False  # its loop gave its first pass, token or wait (before it, a RoomLater puts it aside)


class Pass:
    """What the loop runs for one row in a pass, copied under the condition when it picks the work."""

    def __init__(self, row: Row) -> None:
        self.row, self.inputs, self.cache = row, row.pending, row.cache
        row.state, row.pending = RUNNING, None


class Running:
    """Stands for a call while a sequence's loop runs on the thread: its stage calls see the request's lease."""

    def __init__(self, lease: Lease | None) -> None:
        self.lease = lease
