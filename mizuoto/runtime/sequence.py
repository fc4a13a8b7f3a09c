"""A sequence stage's token loop, written once by the engine and run by the runtime, alone or batched.

Engine contract v2 for LMs: the engine declares what its sequence stage computes (`Sequence`: the
decoder, the head over its normed hidden states, the sampler, how many rows a request takes) and
writes its token loop as a function of the steps it is given, `loop(steps) -> Iterator[int]`;
`Model.decode(stage, loop)` runs it. The engine never chooses how: the runtime gives the loop

- `AloneSteps` when the request runs by itself (a model that runs one request at a time, or a
  model outside a runtime): each pass over the sequence's own cache, all its rows in one, on the
  thread that runs the request, one stage call (`Model.use`) per token; upstream's numerics
  (`runtime.decode.DecodeSteps`: eager, or CUDA graphs and the on-device sampler on CUDA);
- `RowSteps` when the model batches: the sequence's rows in the model's continuous batch
  (`runtime.batching`), prefills alone, one-token steps at the batch's fixed width.

The steps' calling convention (`TokenSteps` in runtime.decode, over a whole sequence). The loop
is a generator: it yields token ids, and it runs a pass or waits for streamed input with
`yield from`, so that in a batch the loop is a coroutine the batch's own thread drives (no thread
of its own; between passes it runs there, beside the other rows' loops):

- `steps.attach(alone, row=None)` once, before the first pass: `alone()` makes the KV cache of the
  whole sequence run by itself (its rows as one batch), `row()` one row's cache in a batch
  (default: `alone`);
- `scores = yield from steps.scores(x)`: x (R, T, hidden) for the sequence's R rows; the head's
  scores for the last position (as `Sequence.head` gives them: `stacked` sequences get (R, V) in a
  batch too);
- `steps.draw(scores, decoded, generator)`: one token id with the sampler the runtime uses there;
- `steps.compute(fn)`: fn() where the passes run (building the next input);
- `item = yield from steps.next(source)`: the next item of an iterator the loop waits for (streamed
  text), None at its end; in a batch the request's own thread takes it from the source while the
  batch steps on without these rows.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from mizuoto.runtime.decode import DecodeSteps


@dataclass(frozen=True)
class Sequence:
    """What a sequence stage computes, declared on its `Stage` (`sequence=`).

    `decoder`: a `mizuoto.nn.lm.Decoder` (None: the loop runs its own passes and cannot batch);
    `head(hidden)`: scores at the last position of normed hidden states (R, T, hidden) of a whole
    sequence; `row_head`: the same for a batch's rows ((V,) at batch 1, (B, V) else; default `head`);
    `sampler`: what `steps.draw` draws with (its fast on-device form on CUDA); `rows`: rows a
    request takes (classifier-free guidance: 2); `stacked`: a pass's scores are (R, V) in a batch
    as alone; `cuda_graphs`: the load option (requested; the runtime says why when it cannot);
    `pack`: the batch may pack the decoder's layers when it is made (`nn.lm.packed_linear`);
    `context(device)`: numerics around the stage's passes when alone (e.g. CUDA autocast).
    """

    decoder: Any = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    row_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    sampler: Any = None
    rows: int = 1
    stacked: bool = False
    cuda_graphs: bool = False
    pack: bool = True
    context: Callable[[torch.device], Any] | None = None
    what: str = "the LM"

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"a sequence takes at least one row, not {self.rows!r}")
        if self.decoder is not None and self.head is None:
            raise ValueError("a sequence with a decoder needs its head")

    @property
    def batches(self) -> bool:
        """Whether its requests can share a continuous batch (it has a decoder the runtime runs)."""
        return self.decoder is not None


@dataclass(frozen=True)
class Forward:
    """What a row loop yields for a pass: one input per row of the sequence (the batch answers a list)."""

    rows: tuple[Any, ...]
    inputs: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Next:
    """What a row loop yields to wait for streamed input: the request's thread answers `next(source, None)`."""

    source: Iterator[Any]


class AloneSteps:
    """A sequence run by itself: each pass over its own cache, all its rows at once (upstream's numerics)."""

    def __init__(self, sequence: Sequence | None) -> None:
        self.sequence = sequence
        self._steps: DecodeSteps | None = None

    def attach(self, alone: Callable[[], Any], row: Callable[[], Any] | None = None) -> "AloneSteps":
        """Decode over the cache `alone()` makes (`row` is for a batch's rows)."""
        s = self.sequence
        if s is None or s.decoder is None:
            raise ValueError("this sequence declares no decoder to run passes over")
        self._steps = DecodeSteps(s.decoder, alone(), s.head, s.sampler, cuda_graphs=s.cuda_graphs, what=s.what)
        return self

    def scores(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        """The head's scores for the last position of x (R, T, hidden), computed here (`yield from`: nothing yielded)."""
        return self._attached().scores(x)
        yield  # a generator, as in a batch

    def draw(self, scores: torch.Tensor, decoded: Seq[int], generator: torch.Generator | None) -> int:
        """One token id (upstream's sampler off CUDA)."""
        return self._attached().draw(scores, decoded, generator)

    def compute(self, fn: Callable[[], Any]) -> Any:
        """fn() here: the passes run on this thread."""
        return fn()

    def next(self, source: Iterator[Any]) -> Generator[Any, Any, Any]:
        """The next item of `source` (None at its end), waited for here: nothing else runs meanwhile."""
        return next(source, None)
        yield  # a generator, as in a batch

    def _attached(self) -> DecodeSteps:
        if self._steps is None:
            raise ValueError("attach the sequence's cache before its first pass")
        return self._steps


class RowSteps:
    """A sequence as rows of the model's continuous batch (`runtime.batch_rows.Row`s, one per row it takes)."""

    def __init__(self, rows: tuple[Any, ...], sequence: Sequence) -> None:
        self.rows, self.sequence = rows, sequence

    def attach(self, alone: Callable[[], Any], row: Callable[[], Any] | None = None) -> "RowSteps":
        """Each row decodes over a cache of its own (`row()`, else `alone()`)."""
        make = row if row is not None else alone
        for r in self.rows:
            r.attach(make())
        return self

    def scores(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        """The sequence's rows' inputs for one pass each (they share it); the batch's answer as `AloneSteps` gives it."""
        if len(self.rows) == 1 and not self.sequence.stacked:
            (scores,) = yield Forward(self.rows, (x,))
            return scores
        results = yield Forward(self.rows, tuple(x[i:i + 1] for i in range(len(self.rows))))
        return torch.stack([r.reshape(-1) for r in results])

    def draw(self, scores: torch.Tensor, decoded: Seq[int], generator: torch.Generator | None) -> int:
        """One token id with the batch's sampler."""
        return self.rows[0].draw(scores, decoded, generator)

    def compute(self, fn: Callable[[], Any]) -> Any:
        """fn() on the batch loop's thread (where a row's loop runs)."""
        return self.rows[0].compute(fn)

    def next(self, source: Iterator[Any]) -> Generator[Any, Any, Any]:
        """The next item of `source` (None at its end), taken by the request's thread; the batch steps on meanwhile."""
        return (yield Next(source))
