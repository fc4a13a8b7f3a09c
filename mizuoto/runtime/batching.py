"""Continuous batching of a decoder LM: concurrent sequences share its one-token steps.

A model with a batch width W > 1 runs up to W requests at once. Each request's token loop (the
engine's own, `runtime.sequence`) is a coroutine this loop drives on its own thread: the loop
sends it each pass's scores, and it runs to its next pass (drawing its token, building its next
input) and yields that pass's inputs (`sequence.Forward`), its tokens in between. No request has
a thread of its own here: the batch loop, one long-lived thread per model, runs every forward
pass and every row's loop. A row's multi-position input (its prefill, or a streamed-text piece)
runs alone, at batch 1, exactly as a request running alone does; one-position inputs of all rows
together, in one step of fixed width W (empty rows are zeros), attention per row over that row's
own KV cache. Tokens go to the request through a queue as they are drawn, so the rows' steps
never wait for a request's flow and vocoder work; that work runs on the loop's thread too
(`call`), alternating with the steps, so all of the model's heavy compute runs on one long-lived
thread: the batch loop is the model's executor (`runtime.executor.Executor`).

Why the width is fixed: on the CPU a row of a linear layer at batch 1 differs in the last bits
from the same row at batch 2, and batch 16 from batches 2-8; at one fixed width a row's result
does not depend on what the other rows hold or where it sits (measured, and tested on every
fixture case). So a seeded request gives the same tokens under any load; they may differ from
the unbatched path's (which is upstream's), and the docs say how often.

Each row keeps its own generator, sampler state, length limits and KV cache (the engine makes
the cache, sized as its options say); a sequence's rows leave when its loop ends, freeing their
places. A sequence may take several rows at once (`run(..., rows=2)`: classifier-free guidance's
conditioned and unconditioned rows, Chatterbox's T3): they join together when that many are free
and their inputs share a pass.

A sequence (`Line`) moves through explicit states: READY (its loop is to be resumed), FORWARD
(its rows' inputs wait for or run in a pass), TEXT (it waits for streamed input, which the
request's thread takes from its source: the caller's iterator never blocks the loop), ENDED. The
loop copies what a pass reads when it takes the work, under the condition, so a request that
leaves mid-pass ends its own rows only. A request leaving (its token iterator closed, its lease
cancelled) is a message to the loop: its loop is closed there, on the loop's thread, after any
pass of its still running, and its rows and its lease's work end then. A sequence whose room
(`Model.decode`'s reservation, made as its loop starts) is held by others is put ASIDE with its
rows, unstarted, and starts again when the loop is woken (memory let go). Every wait of a request (a
place in the batch, its next token) takes the request's lease and ends with it. An error in a
forward pass goes to that pass's rows; a failure of the loop itself goes to every request waiting
on it, and the loop goes on. close() answers everything still waiting and joins the loop.

On the CPU the batcher packs the decoder's layers when it is made, at the model's load
(`mizuoto.nn.lm.packed_linear`: weights in column blocks, products 2x faster at 8 rows than
`F.linear`'s, the same bytes; 0.8 s for Qwen2-0.5B). The decoder is the batch's from its load
on, never changed by a first batch: its prefills use the packed layers too, and any loop over
it runs the batch's numerics, not upstream's (a model that batches runs every request through
its batch; the bench's single-request table times the same packed layers).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mizuoto.errors import MemoryBudgetError, MizuotoError
from mizuoto.runtime.batch_rows import (ASIDE, ENDED, FORWARD, IDLE, PENDING, READY, RUNNING, TEXT, Line, Pass, Row,
                                        Running, Stopped)
from mizuoto.runtime.decode import BatchStep
from mizuoto.runtime.executor import Executor, RoomLater
from mizuoto.runtime.lease import POLL_S, Lease, current
from mizuoto.runtime.sequence import Forward, Next
from mizuoto.nn.lm.packed_linear import pack_linears
from mizuoto.nn.lm.decoder import Decoder
from mizuoto.nn.lm.sampling import on_device

log = logging.getLogger("mizuoto.runtime")
_END = object()


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
        self._lines: list[Line] = []  # the sequences in the batch, in the order they joined
        self._unclosed: list[Line] = []  # ended from outside (close, a failure) with their loop still open
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
        loop runs on the batch's thread; streamed input it waits for is taken from its source here,
        in the caller's thread. The lease ends the wait for rows and for each token; closing the
        iterator (or the lease's end) has the loop closed on the batch's thread and its rows freed.
        """
        if not 1 <= rows <= self.width:
            raise ValueError(f"a sequence takes 1 to {self.width} rows of this batch, not {rows}")
        if self.on_thread():  # its tokens would wait for this very thread
            raise MizuotoError(f"{self.name}: a token loop cannot be started from the batch loop's own thread "
                               "(from inside a compute call); decode from the request's thread")
        lease = lease if lease is not None else current()  # the request whose token loop this is
        group = self._join(lease, rows)
        line = Line(group, lambda: produce(group[0] if rows == 1 else group), lease)
        with self.cond:
            for row in group:
                row.line = line
            self._lines.append(line)
            if lease is not None:  # the request's work until its loop has ended on this thread
                lease.begin_work()
            self.cond.notify_all()
        try:
            while True:
                try:
                    item = line.out.get(timeout=POLL_S)
                except queue.Empty:
                    if lease is not None:
                        lease.check("while its LM ran")
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Next):
                    self._fetch(line, item.source)
                    continue
                if lease is not None:  # tokens that keep coming never end the wait above: a cancel ends the sequence
                    lease.check("while its LM ran")
                yield item
        finally:
            with self.cond:
                line.left = True
                for row in line.rows:
                    # a row in a pass (RUNNING) keeps its copied input and the pass goes on; the loop closes
                    # the sequence once that pass has answered
                    if row.state == PENDING:
                        row.state, row.pending = IDLE, None
                        line.answers[row.index] = Stopped("the request was closed")
                if line.state in (TEXT, ASIDE) or (line.state == FORWARD and len(line.answers) == len(line.rows)):
                    line.state = READY
                self.cond.notify_all()

    def _fetch(self, line: Line, source: Iterator[Any]) -> None:
        """The sequence's next streamed item, taken here (the request's thread) and handed to its loop."""
        try:
            value, error = next(source, None), None
        except BaseException as e:  # thrown into the engine's loop, where upstream would meet it
            value, error = None, e
        with self.cond:
            if line.state == TEXT:
                line.value, line.error, line.state = value, error, READY
                self.cond.notify_all()

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

    def _end_line(self, line: Line, outcome: Any, closed: bool = True) -> None:
        """The sequence is over (under the condition): its request hears `outcome`, its rows are free, its work ends.
        Not `closed`: its loop is still open, and is closed on the loop's thread next (or by close())."""
        if line.state == ENDED:
            return
        line.state = ENDED
        if not closed and line.loop is not None:
            self._unclosed.append(line)
        line.out.put(outcome)
        for row in line.rows:
            row.state, row.pending = IDLE, None
            if self.rows[row.index] is row:
                self.rows[row.index] = None
        if line in self._lines:
            self._lines.remove(line)
        if line.lease is not None:
            self._ends.append(line.lease)
        self.cond.notify_all()

    def close(self) -> None:
        """Close the loop (Executor.close: every sequence hears it), then close the sequences' loops it left open
        here (the batch's thread has ended, so their cleanup runs in the closing thread)."""
        super().close()
        self._close_loops()

    def _close_loops(self) -> None:
        """Close the loops of the sequences ended from outside (their engine cleanup runs)."""
        with self.cond:
            lines, self._unclosed = self._unclosed, []
        for line in lines:
            try:
                line.context.run(line.loop.close)
            except Exception:  # a loop still running (close timed out), or its cleanup failed: logged only
                log.exception("%s: closing a sequence's token loop", self.name)

    # -- the loop ---------------------------------------------------------------------------------
    def _answer(self, row: Row, result: Any) -> None:
        """A pass's result to a row it took (under the condition); its sequence resumes once all its rows have theirs."""
        line = row.line
        if row.state != RUNNING or line is None:
            return
        row.state = IDLE
        line.answers[row.index] = result
        if line.state == FORWARD and len(line.answers) == len(line.rows):
            results = [line.answers[r.index] for r in line.rows]
            line.answers = {}
            line.error = next((r for r in results if isinstance(r, BaseException)), None)
            line.value = None if line.error is not None else results
            line.state = READY

    def _admission(self) -> tuple[str, Any] | None:
        """The line's admission when due; the sequences put aside for room start again with the calls."""
        if self._admit:
            for line in self._lines:
                if line.state == ASIDE:
                    line.state = READY
        return super()._admission()

    def _fail_waiting(self, error: BaseException) -> None:
        """Every sequence and call not yet taken gets `error` (under the condition)."""
        for line in list(self._lines):
            self._end_line(line, error, closed=False)
        super()._fail_waiting(error)

    def _fail_work(self, kind: str, item: Any, error: BaseException) -> None:
        if kind in ("call", "admit"):
            super()._fail_work(kind, item, error)
        elif kind == "resume":
            for line in item:
                self._end_line(line, error, closed=False)
        elif kind != "close":
            for p in item:
                self._answer(p.row, error)

    def _work(self) -> tuple[str, Any] | None:
        """What to run next (under the condition), the loop's policy (docs/performance.md, "Batching"):

        0. the model's line, when something came or let go: the scheduler admits new requests
           (`Scheduler.schedule`), which then bring their work;
        1. every sequence to resume (its pass answered, its streamed item come, or new): each runs to
           its next pass, so every row is ready for the step that follows;
        2. every waiting prefill (new rows join the next step together);
        3. an urgent call (a request's first audio), oldest first;
        4. otherwise calls and steps in turn, calls in the order they came.

        The rows taken are copied (`Pass`) and RUNNING: what the pass reads no longer changes
        if their requests leave meanwhile.
        """
        if self._unclosed:
            return "close", None
        admit = self._admission()
        if admit is not None:
            return admit
        ready = [line for line in self._lines if line.state == READY]
        if ready:
            return "resume", ready
        pending = [r for r in self.rows if r is not None and r.state == PENDING]
        singles = [r for r in pending if r.pending.shape[1] > 1]
        if singles:
            return "prefill", [Pass(r) for r in singles]
        urgent = next((c for c in self._calls if c.urgent), None)
        if urgent is not None:
            self._calls.remove(urgent)
            return "call", urgent
        if self._calls and not (pending and self._last == "call"):
            return "call", self._calls.popleft()
        return ("step", [Pass(r) for r in pending]) if pending else None

    def _run(self, kind: str, items: Any) -> None:
        """One unit of work: a call, the sequences to resume, or a pass over the rows taken."""
        if kind == "admit":
            super()._run(kind, items)
            return
        self._last = kind
        if kind == "call":
            super()._run(kind, items)
            return
        if kind == "close":
            self._close_loops()
            return
        if kind == "resume":
            for line in items:
                self._resume(line)
            self._settle_ends()
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

    def _resume(self, line: Line) -> None:
        """Run a sequence's loop to its next pass or wait (its tokens to its request on the way), or to its end."""
        with self.cond:
            value, error, line.value, line.error = line.value, line.error, None, None
            left = line.left
        outcome: Any = None
        self._running = Running(line.lease)  # its stage calls (compute) see the request's lease
        try:
            with self.timing("lm loop"):
                if left:
                    if line.loop is not None:
                        line.context.run(line.loop.close)
                    outcome = _END
                    return
                if line.loop is None:
                    line.loop = line.context.run(line.make)
                while True:
                    if error is not None:
                        if not hasattr(line.loop, "throw"):
                            raise error
                        op = line.context.run(line.loop.throw, error)
                    elif hasattr(line.loop, "send"):
                        op = line.context.run(line.loop.send, value)
                    else:  # a plain iterator of tokens: it runs its own passes
                        op = line.context.run(next, line.loop)
                    value = error = None
                    line.started = True
                    if isinstance(op, Forward):
                        with self.cond:
                            if line.state == ENDED:  # close() ended it meanwhile: it closes the loop
                                return
                            if line.left:  # the request left while its loop ran: close it at once
                                line.state = READY
                                return
                            for row, x in zip(op.rows, op.inputs):
                                row.pending, row.state = x, PENDING
                            line.state = FORWARD
                        return
                    if isinstance(op, Next):
                        with self.cond:
                            if line.state == ENDED:
                                return
                            line.state = TEXT
                            line.out.put(op)
                        return
                    line.out.put(op)  # a token
        except StopIteration:
            outcome = _END
        except RoomLater as e:
            if line.started:  # only a sequence's start reserves: past it, a failure like any other
                outcome = MemoryBudgetError(f"its LM call's room is held by others: {e}")
            else:  # its room is held by others as it starts: aside, its rows kept, until memory is let go
                line.loop = None
                with self.cond:
                    if line.state != ENDED:
                        line.state = READY if line.left else ASIDE
        except BaseException as e:  # the engine's loop failed: its request hears why
            outcome = e
        finally:
            self._running = None
            if outcome is not None:
                with self.cond:
                    self._end_line(line, outcome)

    def _step(self, items: list[Pass]) -> dict[int, torch.Tensor]:
        first = items[0].inputs
        x = torch.zeros(self.width, 1, first.shape[-1], dtype=first.dtype, device=first.device)
        caches: list[Any] = [None] * self.width
        for p in items:
            x[p.row.index] = p.inputs[0]
            caches[p.row.index] = p.cache
        scores = self.batch_step(x, caches)
        if self.batch_step.captured:  # a static buffer the next step overwrites: each row keeps its own copy
            scores = scores.clone()
        self.steps += 1
        self.row_steps += len(items)
        return {p.row.index: scores[p.row.index] for p in items}

    def stats(self) -> dict[str, float]:
        """Rows now, steps run and their mean occupancy (0-1), prefills run."""
        occupancy = self.row_steps / (self.steps * self.width) if self.steps else 0.0
        return {"width": self.width, "active": self.active, "steps": self.steps, "occupancy": occupancy,
                "prefills": self.prefills}
