"""Continuous batching of a decoder LM: concurrent sequences share its one-token steps.

A model with a batch width W > 1 runs up to W requests at once. Each request's token loop (the
engine's own `generate`) runs in a producer thread of its own and talks to its *row* as it
would to `DecodeSteps`: `scores(inputs)` and `draw(...)`. The batch loop, one long-lived thread
per model, does every forward pass: a row's multi-position input (its prefill, or a streamed-text
piece) alone, at batch 1, exactly as a request running alone does; one-position inputs of all
rows together, in one step of fixed width W (empty rows are zeros), attention per row over
that row's own KV cache. Tokens go to the request through a queue as they are drawn, so the
rows' steps never wait for a request's flow and vocoder work; that work runs on the loop's
thread too (`call`), alternating with the steps, so all of the model's heavy compute runs on one
long-lived thread: the batch loop is the model's executor (`runtime.executor.Executor`).

Why the width is fixed: on the CPU a row of a linear layer at batch 1 differs in the last bits
from the same row at batch 2, and batch 16 from batches 2-8; at one fixed width a row's result
does not depend on what the other rows hold or where it sits (measured, and tested on every
fixture case). So a seeded request gives the same tokens under any load; they may differ from
the unbatched path's (which is upstream's), and the docs say how often.

Each row keeps its own generator, sampler state, length limits and KV cache (the engine makes
the cache, sized as its options say); a row leaves when its sequence ends, freeing its place. A
sequence may take several rows at once (`run(..., rows=2)`: classifier-free guidance's conditioned
and unconditioned rows, Chatterbox's T3): they join together when that many are free, and its
token loop submits each row's input before collecting each result, so they share the step.

A row moves through explicit states (PRODUCING, WAITING, PENDING, RUNNING, FINISHED below). The
loop copies what a pass reads when it takes the work, under the condition, so a consumer that
leaves mid-pass ends its own row only. Every wait of a request (a place in the batch, its row's
pass, a call, its next token) takes the request's lease and ends with it. An error in a forward
pass goes to that pass's rows; a failure of the loop itself goes to every request waiting on it,
and the loop goes on. close() answers everything still waiting and joins the loop.

On the CPU the batcher packs the decoder's layers when it is made, at the model's load
(`mizuoto.nn.lm.packed_linear`: weights in column blocks, products 2x faster at 8 rows than
`F.linear`'s, the same bytes; 0.8 s for Qwen2-0.5B). The decoder is the batch's from its load
on, never changed by a first batch: its prefills use the packed layers too, and any loop over
it runs the batch's numerics, not upstream's (a model that batches runs every request through
its batch; the bench's single-request table times the same packed layers).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from mizuoto.errors import RequestCancelled
from mizuoto.runtime.decode import BatchStep
from mizuoto.runtime.executor import JOIN_S, Executor
from mizuoto.runtime.lease import POLL_S, Lease, current
from mizuoto.nn.lm.packed_linear import pack_linears
from mizuoto.nn.lm.decoder import Decoder
from mizuoto.nn.lm.sampling import on_device

log = logging.getLogger("mizuoto.runtime")

# How long the batch loop waits for a row still drawing its token before stepping without it.
# A row that misses a step joins the next one: results do not depend on it, only throughput.
STRAGGLER_WAIT_S = 0.05
_END = object()


class _Stopped(RequestCancelled):
    """The request consuming a row went away; its producer unwinds."""


# A row's states. The producer (the request's token loop) moves a row from PRODUCING to PENDING by
# handing it an input; the loop moves it to RUNNING when it takes that input for a pass (copying
# the input and the cache under the condition) and back to PRODUCING when it delivers the result.
PRODUCING = "producing"  # the producer runs its own code (drawing, streamed text); the loop may wait for it
WAITING = "waiting"      # the producer waits for something else (streamed text): steps go on without it
PENDING = "pending"      # an input is waiting for the loop
RUNNING = "running"      # the loop is running the row's input
FINISHED = "finished"    # the consumer left or the row's sequence ended


class Row:
    """One sequence's place in the batch; implements `decode.TokenSteps` for the engine's token loop.

    Every field but `cache` and `sampler` is read and written under the batcher's condition.
    """

    def __init__(self, batcher: "DecodeBatcher", index: int, lease: Lease | None) -> None:
        self.batcher, self.index, self.lease = batcher, index, lease
        self.cache: Any = None
        self.sampler = batcher.sampler
        self.state = PRODUCING
        self.pending: torch.Tensor | None = None
        self.result: Any = None
        self.owing = False  # its input counts as its lease's work until answered
        self.done = threading.Event()

    def attach(self, cache: Any) -> "Row":
        """Adopt the KV cache the engine made for this sequence; the row is then its decode steps."""
        self.cache = cache
        return self

    def compute(self, fn: Callable[[], Any]) -> Any:
        """fn() on the batch loop's thread (the engine builds its LM input there: no OpenMP team here)."""
        return self.batcher.call(fn, self.lease, "lm input")

    def scores(self, inputs: torch.Tensor) -> torch.Tensor:
        """Feed (1, T, hidden) inputs; the head's output for the last position, once the loop has run it."""
        self.submit(inputs)
        return self.collect()

    def submit(self, inputs: torch.Tensor) -> None:
        """Hand the loop (1, T, hidden) inputs without waiting: a sequence of several rows submits each, then
        collects each, so its rows can share a pass."""
        b = self.batcher
        with b.cond:
            b.check_open()
            if self.state == FINISHED:
                raise _Stopped("the request was closed")
            self.done.clear()
            self.pending, self.state = inputs, PENDING
            if self.lease is not None:  # the request's work until the loop delivers its result
                self.lease.begin_work()
                self.owing = True
            b.cond.notify_all()

    def collect(self) -> torch.Tensor:
        """The head's output for the inputs submitted last, once the loop has run them."""
        self.batcher.wait_for(self.done, self.lease, "while its LM step ran")
        result, self.result = self.result, None
        if isinstance(result, BaseException):
            raise result
        return result

    def draw(self, scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        """One token id from `scores`, with this row's generator (the engine's sampler, as unbatched)."""
        return (self.batcher.fast_sampler if scores.device.type == "cuda" else self.sampler)(scores, decoded, generator)

    def external(self, items: Iterable[Any]) -> Iterator[Any]:
        """`items` (e.g. streamed text), the loop not waiting for this row while it waits for the next."""
        it = iter(items)
        while True:
            with self.batcher.cond:
                if self.state == PRODUCING:
                    self.state = WAITING
                self.batcher.cond.notify_all()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                with self.batcher.cond:
                    if self.state == WAITING:
                        self.state = PRODUCING
            yield item


class _Pass:
    """What the loop runs for one row in a pass, copied under the condition when it picks the work."""

    def __init__(self, row: Row) -> None:
        self.row, self.inputs, self.cache = row, row.pending, row.cache
        row.state, row.pending = RUNNING, None


class DecodeBatcher(Executor):
    """Shares `decoder`'s one-token steps among up to `width` sequences (see the module docstring).

    `head` maps normed hidden states (B, T, hidden) to scores, (V,) for B = 1 and (B, V) else;
    `gate()` is the stage gate the loop holds around its forward passes (the model's `use`);
    `sampler` draws as the unbatched loop does (its fast on-device form on CUDA); `pack`: pack the
    layers (`nn.lm.packed_linear`; only float32 CPU weights are packed); `cuda_graphs`: on CUDA,
    replay each step's row-independent parts as CUDA graphs captured at the width
    (`runtime.decode.BatchStep`; the same results as eager steps).
    """

    label = "LM batch loop"
    thread_suffix = "batch"

    def __init__(self, decoder: Decoder, head: Callable[[torch.Tensor], torch.Tensor], width: int,
                 gate: Callable[[], contextlib.AbstractContextManager], sampler: Any, name: str = "lm",
                 pack: bool = True, cuda_graphs: bool = False) -> None:
        if width < 2:
            raise ValueError(f"a batch needs a width of at least 2, got {width}")
        super().__init__(name)
        self.decoder, self.head, self.width, self.gate = decoder, head, width, gate
        self.packed = 0  # layers packed (CPU float32 only): now, at load, so no later batch changes the decoder
        if pack:
            try:
                self.packed = pack_linears(decoder.layers)
            except Exception:  # the dense layers still work, only slower
                log.exception("%s: packing the LM's layers for the batch failed; they stay as they are", name)
        # step_rows unless captured (a GPT-2 decoder's learned positions are not in the graphed segments)
        self.batch_step = BatchStep(decoder, head, width, graphs=cuda_graphs and not decoder.config.learned_positions)
        # the draw follows the scores: on CUDA the fast on-device form of an upstream-style sampler (the decoder is
        # built on the host and placed later, so where it is now says nothing), elsewhere the engine's own
        self.sampler, self.fast_sampler = sampler, on_device(sampler)
        self.rows: list[Row | None] = [None] * width
        self._strays: list[threading.Thread] = []  # producers left waiting for streamed text (joined by close)
        self.steps = 0           # batched steps run
        self.row_steps = 0       # rows served by them (occupancy = row_steps / (steps * width))
        self.prefills = 0
        self._last = ""  # the kind of work run last ("call" or a step), to alternate them

    # -- requests -------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        """Rows in use now."""
        return sum(r is not None for r in self.rows)

    def run(self, produce: Callable[[Any], Iterator[int]], lease: Lease | None = None,
            rows: int = 1) -> Iterator[int]:
        """Yield the tokens of `produce(row)` (the engine's token loop over the row's steps, `runtime.sequence`).

        `rows` > 1: the sequence takes that many rows at once (classifier-free guidance's conditioned
        and unconditioned rows) and `produce` gets them as a tuple. Waits for free rows first. The
        lease ends that wait and the wait for each token; closing the iterator (or the lease's end)
        stops the producer at its next step and frees the rows.
        """
        if not 1 <= rows <= self.width:
            raise ValueError(f"a sequence takes 1 to {self.width} rows of this batch, not {rows}")
        lease = lease if lease is not None else current()  # the request whose token loop this is
        group = self._join(lease, rows)
        tokens: queue.Queue = queue.Queue()

        def producer() -> None:
            try:
                for token in produce(group[0] if rows == 1 else group):
                    tokens.put(token)
                tokens.put(_END)
            except BaseException as e:  # handed to the consumer
                tokens.put(e)
            finally:
                for row in group:
                    self._leave(row)

        # the producer runs as the request (its context: lease.current() is the request's lease)
        thread = threading.Thread(target=contextvars.copy_context().run, args=(producer,),
                                  name=f"mizuoto-{self.name}-row{group[0].index}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = tokens.get(timeout=POLL_S)
                except queue.Empty:
                    if lease is not None:
                        lease.check("while its LM ran")
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if lease is not None:  # tokens that keep coming never end the wait above: a cancel ends the sequence
                    lease.check("while its LM ran")
                yield item
        finally:
            waiting = False
            with self.cond:
                for row in group:
                    # a row in a pass (RUNNING) keeps its copied input and the pass goes on: the loop
                    # wakes its producer with _Stopped when the pass ends; only this row ends
                    waiting = waiting or row.state == WAITING
                    if row.state == PENDING:
                        self._deliver(row, _Stopped("the request was closed"))
                    row.state = FINISHED
                    if waiting and self.rows[row.index] is row:  # its place is free at once (see below)
                        self.rows[row.index] = None
                self._strays = [t for t in self._strays if t.is_alive()]
                if waiting:
                    self._strays.append(thread)
                self.cond.notify_all()
            self._settle_ends()
            if not waiting:  # it stops at its next input, within a pass
                thread.join(JOIN_S)
            # A producer waiting for streamed text waits inside the caller's text source, which nothing here
            # can interrupt: its rows are given up now, and it stops (_Stopped) at its next input once the
            # source yields or ends; close() joins it.

    def close(self) -> None:
        """Close the loop (Executor.close), then join the producers left waiting for streamed text (bounded)."""
        super().close()
        with self.cond:
            strays, self._strays = self._strays, []
        for thread in strays:
            thread.join(JOIN_S)
            if thread.is_alive():
                log.warning("%s: a producer still waits in its streamed-text source %.0f s after close",
                            self.name, JOIN_S)

    def _join(self, lease: Lease | None, n: int = 1) -> tuple[Row, ...]:
        """`n` rows taken together once that many are free (a pair never holds one row while waiting for the other)."""
        with self.cond:
            def free() -> bool:
                self.check_open()
                return sum(r is None for r in self.rows) >= n
            (lease or Lease()).wait_for(self.cond, free, "while waiting for a place in the batch")
            group = []
            for index in [i for i, r in enumerate(self.rows) if r is None][:n]:
                self.rows[index] = Row(self, index, lease)
                group.append(self.rows[index])
            self._start()
            return tuple(group)

    def _leave(self, row: Row) -> None:
        with self.cond:
            row.state = FINISHED
            if self.rows[row.index] is row:
                self.rows[row.index] = None
            self.cond.notify_all()

    # -- the loop ---------------------------------------------------------------------------------
    def _deliver(self, row: Row, result: Any) -> None:
        if row.owing:  # an input's one answer ends its work (once the condition is released: _settle_ends)
            row.owing = False
            self._ends.append(row.lease)
        row.result, row.pending = result, None
        if row.state in (PENDING, RUNNING):
            row.state = PRODUCING
        row.done.set()

    def _answer(self, row: Row, result: Any) -> None:
        """A pass's result to a row it took (under the condition); a row whose consumer left meanwhile
        gets _Stopped instead, so its producer unwinds now."""
        if row.state == RUNNING:
            self._deliver(row, result)
        elif row.state == FINISHED and not row.done.is_set():
            self._deliver(row, _Stopped("the request was closed"))

    def _fail_waiting(self, error: BaseException) -> None:
        """Every row input and call not yet taken gets `error` (under the condition)."""
        for row in self.rows:
            if row is not None and row.state == PENDING:
                self._deliver(row, error)
        super()._fail_waiting(error)

    def _fail_work(self, kind: str, item: Any, error: BaseException) -> None:
        if kind == "call":
            super()._fail_work(kind, item, error)
        else:
            for p in item:
                self._answer(p.row, error)

    def _idle_timeout(self) -> float | None:
        # a row still drawing its token: wait a little for it, then step without it
        return STRAGGLER_WAIT_S if any(r is not None and r.state == PENDING for r in self.rows) else None

    def _work(self, waited: bool) -> tuple[str, Any] | None:
        """What to run next (under the condition), the loop's policy (docs/performance.md, "Batching"):

        1. every waiting prefill (new rows join the next step together);
        2. an urgent call (a request's first audio), oldest first;
        3. otherwise calls and steps in turn, calls in the order they came.

        The rows taken are copied (`_Pass`) and RUNNING: what the pass reads no longer changes
        if their consumers leave meanwhile.
        """
        rows = [r for r in self.rows if r is not None]
        pending = [r for r in rows if r.state == PENDING]
        singles = [r for r in pending if r.pending.shape[1] > 1]
        if singles:
            return "prefill", [_Pass(r) for r in singles]
        urgent = next((c for c in self._calls if c.urgent), None)
        if urgent is not None:
            self._calls.remove(urgent)
            return "call", urgent
        step_ready = bool(pending) and (waited or not any(r.state == PRODUCING for r in rows))
        if self._calls and not (step_ready and self._last == "call"):
            return "call", self._calls.popleft()
        return ("step", [_Pass(r) for r in pending]) if step_ready else None

    def _run(self, kind: str, items: Any) -> None:
        """One unit of work: a call, or a pass over the rows taken (each row gets its own result)."""
        self._last = kind
        if kind == "call":
            super()._run(kind, items)
            return
        try:
            with torch.inference_mode(), self.timing(kind if kind == "prefill" else f"step {len(items)}"), self.gate():
                if kind == "prefill":
                    results = {p.row.index: self.head(self.decoder(p.inputs, p.cache)) for p in items}
                else:
                    results = self._step(items)
        except BaseException as e:  # every row in this pass gets it
            results = {p.row.index: e for p in items}
        with self.cond:
            for p in items:
                self._answer(p.row, results[p.row.index])
            if kind == "prefill":
                self.prefills += len(items)
        self._settle_ends()

    def _step(self, items: list[_Pass]) -> dict[int, torch.Tensor]:
        first = items[0].inputs
        x = torch.zeros(self.width, 1, first.shape[-1], dtype=first.dtype, device=first.device)
        caches: list[Any] = [None] * self.width
        for p in items:
            x[p.row.index] = p.inputs[0]
            caches[p.row.index] = p.cache
        scores = self.batch_step(x, caches)
        if self.batch_step.captured:  # overwritten by the next step, which a straggler's draw may outlast
            scores = scores.clone()
        self.steps += 1
        self.row_steps += len(items)
        return {p.row.index: scores[p.row.index] for p in items}

    def stats(self) -> dict[str, float]:
        """Rows now, steps run and their mean occupancy (0-1), prefills run."""
        occupancy = self.row_steps / (self.steps * self.width) if self.steps else 0.0
        return {"width": self.width, "active": self.active, "steps": self.steps, "occupancy": occupancy,
                "prefills": self.prefills}
