"""The continuous batch of a decoder LM (runtime.batching), on a small random Qwen decoder.

A row's scores must be bit-identical whatever shares its steps; rows leave, get cancelled and
fail without leaking their place; a request's token loop runs on the batch's thread, none of its own.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from mizuoto.errors import MizuotoError, RequestCancelled
from mizuoto.nn.lm.kv_cache import DynamicKVCache
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder
from mizuoto.runtime.batching import DecodeBatcher
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.sequence import RowSteps, Sequence
from mizuoto.testing.waits import cancel_during

WIDTH = 4
CFG = DecoderConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97)


@pytest.fixture
def decoder():
    torch.manual_seed(0)
    dec = Decoder(CFG).eval()
    for p in dec.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return dec


def _head(decoder):
    def head(hidden: torch.Tensor) -> torch.Tensor:
        return decoder.logits(hidden[:, -1]).log_softmax(-1).squeeze(0)
    return head


def _steps(rows, stacked: bool = False) -> RowSteps:
    """The steps an engine's loop gets for its row(s) in a batch (Model.decode makes them so)."""
    return RowSteps(rows if isinstance(rows, tuple) else (rows,), Sequence(stacked=stacked))


def _greedy(decoder, prompt_len: int, steps: int, seed: int, record: list, feed_at: int | None = None,
            threads: list | None = None):
    """A token loop in the shape of an engine's `generate(steps=...)`: prefill, then one token at a time."""
    def produce(row):
        g = torch.Generator().manual_seed(seed)
        rows = _steps(row).attach(DynamicKVCache)
        x = torch.randn(1, prompt_len, CFG.hidden_size, generator=g)
        for i in range(steps):
            scores = yield from rows.scores(x)
            if threads is not None:
                threads.append(threading.current_thread().name)
            record.append(scores.clone())
            token = int(scores.argmax())
            yield token
            x = decoder.embed_tokens.weight[token].reshape(1, 1, -1)
            if feed_at == i:  # a streamed-text piece: several positions at once, mid-sequence
                x = torch.cat([x, torch.randn(1, 3, CFG.hidden_size, generator=g)], dim=1)
    return produce


def _run_together(batcher, produces, rows: int | list[int] = 1) -> list[list[int]]:
    """Each token loop in its own thread, started together; `rows`: each one's row count (one for all, or a list)."""
    out: list = [None] * len(produces)
    barrier = threading.Barrier(len(produces))
    counts = rows if isinstance(rows, list) else [rows] * len(produces)

    def run(i):
        barrier.wait()
        out[i] = list(batcher.run(produces[i], rows=counts[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(produces))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@torch.inference_mode()
def test_a_rows_scores_do_not_depend_on_its_company(decoder):
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        alone: list = []
        _run_together(batcher, [_greedy(decoder, 5, 12, seed=1, record=alone, feed_at=4)])
        for company in (1, 2, WIDTH - 1):
            mine: list = []
            produces = [_greedy(decoder, 3 + j, 6 + 3 * j, seed=10 + j, record=[]) for j in range(company)]
            _run_together(batcher, [*produces, _greedy(decoder, 5, 12, seed=1, record=mine, feed_at=4)])
            assert len(mine) == len(alone)
            for i, (a, b) in enumerate(zip(alone, mine)):
                assert torch.equal(a, b), f"step {i} differs beside {company} other rows"
        stats = batcher.stats()
        assert stats["active"] == 0 and stats["steps"] > 0 and stats["prefills"] > 0
        assert batcher.packed == 7 * CFG.num_hidden_layers  # on the CPU the rows ran over packed layers
    finally:
        batcher.close()


@torch.inference_mode()
def test_the_width_is_fixed_because_other_widths_give_other_bits(decoder):
    """Why the batch never shrinks to its occupied rows: the same row computed at other widths differs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, CFG.hidden_size, generator=g)
    scores = {}
    for width in (1, 2, 3, WIDTH):
        batch = torch.cat([x, torch.randn(width - 1, 1, CFG.hidden_size, generator=g)])
        caches = [DynamicKVCache() for _ in range(width)]
        scores[width] = decoder.step_rows(batch, caches)[0]
    assert any(not torch.equal(scores[WIDTH], scores[w]) for w in (1, 2, 3))
    # and at the fixed width, what sits in the other rows does not matter
    other = torch.cat([x, torch.zeros(WIDTH - 1, 1, CFG.hidden_size)])
    assert torch.equal(decoder.step_rows(other, [DynamicKVCache()] + [None] * (WIDTH - 1))[0], scores[WIDTH])


def _threads() -> int:
    """Threads running for the batch's requests (none: their loops run on the batch's thread)."""
    return sum(t.name.startswith("mizuoto-lm-row") for t in threading.enumerate())


@torch.inference_mode()
def test_a_requests_token_loop_runs_on_the_batchs_thread_and_starts_no_thread(decoder):
    """No producer thread: the loop between passes runs on the batch loop, the request's thread only reads."""
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        batcher.call(lambda: None)  # the loop runs
        before = {t.ident for t in threading.enumerate()}
        ran: list = []
        tokens = list(batcher.run(_greedy(decoder, 4, 6, seed=1, record=[], threads=ran)))
        assert len(tokens) == 6 and set(ran) == {f"mizuoto-{batcher.name}-batch"}
        assert {t.ident for t in threading.enumerate()} <= before, "a request started a thread"
    finally:
        batcher.close()


def _settle(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end
        time.sleep(0.01)


@torch.inference_mode()
def test_a_sequence_whose_room_others_hold_waits_aside_while_the_batch_steps_on(decoder):
    """A sequence whose start raises RoomLater (its LM call's room is held by others; Model.decode reserves there) is
    put aside with its row kept: another sequence runs to its end meanwhile, and at the next wake the first starts
    from scratch and gives the tokens it gives alone."""
    from mizuoto.runtime.executor import RoomLater

    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    free, starts = threading.Event(), []
    alone = list(batcher.run(_greedy(decoder, 4, 5, seed=3, record=[])))

    def reserved(row):
        starts.append(1)
        if not free.is_set():
            raise RoomLater("held by others")
        return (yield from _greedy(decoder, 4, 5, seed=3, record=[])(row))
    out: list = []
    waiter = threading.Thread(target=lambda: out.append(list(batcher.run(reserved, Lease(30)))))
    try:
        waiter.start()
        _settle(lambda: starts == [1])
        assert len(list(batcher.run(_greedy(decoder, 4, 5, seed=4, record=[])))) == 5  # the batch steps on
        assert out == [] and starts == [1] and batcher.active == 1  # aside, its row kept, not retried on a timer
        free.set()
        batcher.wake()
        waiter.join(30)
        assert out == [alone] and len(starts) == 2
        _settle(lambda: batcher.active == 0)
    finally:
        free.set()
        batcher.close()


@torch.inference_mode()
def test_closing_a_stream_frees_its_row_and_thread(decoder):
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        for _ in range(3 * WIDTH):  # more than the width: a leaked row would block the next join
            tokens = batcher.run(_greedy(decoder, 4, 50, seed=2, record=[]))
            next(tokens), next(tokens)
            tokens.close()
        _settle(lambda: batcher.active == 0 and _threads() == 0)
    finally:
        batcher.close()


@torch.inference_mode()
def test_a_failing_loop_reaches_its_consumer_and_a_cancel_stops_a_wait(decoder):
    batcher = DecodeBatcher(decoder, _head(decoder), 2, contextlib.nullcontext, sampler=None)
    try:
        def broken(row):
            yield from _steps(row).attach(DynamicKVCache).scores(torch.randn(1, 2, CFG.hidden_size))
            raise ValueError("the engine's loop failed")

        with pytest.raises(ValueError, match="loop failed"):
            list(batcher.run(broken))
        holders = [batcher.run(_greedy(decoder, 4, 500, seed=s, record=[])) for s in (1, 2)]
        for h in holders:
            next(h)
        cancelled = Lease()
        cancelled.cancel()
        with pytest.raises(RequestCancelled, match="waiting for a place"):
            next(batcher.run(_greedy(decoder, 4, 5, seed=3, record=[]), cancelled))
        for h in holders:
            h.close()
        _settle(lambda: batcher.active == 0)
    finally:
        batcher.close()


def test_a_batch_is_at_least_two_wide(decoder):
    with pytest.raises(ValueError, match="at least 2"):
        DecodeBatcher(decoder, _head(decoder), 1, contextlib.nullcontext, sampler=None)


@torch.inference_mode()
def test_closing_the_batcher_cancels_waiting_rows(decoder):
    entered = threading.Event()

    @contextlib.contextmanager
    def slow_gate():
        entered.set()
        time.sleep(0.2)
        yield

    batcher = DecodeBatcher(decoder, _head(decoder), 2, slow_gate, sampler=None)
    tokens = batcher.run(_greedy(decoder, 4, 50, seed=1, record=[]))
    errors: list = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RequestCancelled, list, tokens)))
    t.start()
    assert entered.wait(10)
    batcher.close()
    t.join(10)
    assert not t.is_alive() and errors


def test_rows_attend_to_their_own_cache_only(decoder):
    """step_rows with one row equals the decoder's own one-position forward over that row's cache."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randn(1, 6, CFG.hidden_size, generator=g)
    x = torch.randn(1, 1, CFG.hidden_size, generator=g)
    with torch.inference_mode():
        a, b = DynamicKVCache(), DynamicKVCache()
        decoder(prompt, a)
        decoder(prompt, b)
        want = decoder(x, a)
        got = decoder.step_rows(torch.cat([torch.zeros(1, 1, CFG.hidden_size), x]), [None, b])[1:]
    assert b.length == a.length == 7
    assert torch.allclose(got, want, atol=1e-5)


@torch.inference_mode()
def test_calls_run_on_the_loop_thread_between_steps(decoder):
    batcher = DecodeBatcher(decoder, _head(decoder), 2, contextlib.nullcontext, sampler=None)
    try:
        assert batcher.call(lambda: threading.current_thread().name) == f"mizuoto-{batcher.name}-batch"
        tokens = batcher.run(_greedy(decoder, 4, 30, seed=1, record=[]))
        next(tokens)
        before = batcher.stats()["steps"]
        for _ in range(1000):  # calls alternate with the running row's steps: they never starve it
            batcher.call(lambda: time.sleep(0.001))
            if batcher.stats()["steps"] > before:
                break
        assert batcher.stats()["steps"] > before
        assert batcher.call(lambda: batcher.call(lambda: "nested")) == "nested"  # a call inside a call runs at once
        with pytest.raises(MizuotoError, match="own thread"):  # its tokens would wait for the loop: refused
            batcher.call(lambda: next(iter(batcher.run(_greedy(decoder, 4, 3, seed=1, record=[])))))
        with pytest.raises(ZeroDivisionError):
            batcher.call(lambda: 1 / 0)
        assert len(list(tokens)) == 29
    finally:
        batcher.close()
    with pytest.raises(RequestCancelled, match="closed"):
        batcher.call(lambda: None)


def _hold_step(batcher, rows_wanted: int):
    """Make the loop stop inside its next pass over `rows_wanted` rows (after it took their inputs)
    until the test releases it: (entered, release) events."""
    entered, release = threading.Event(), threading.Event()
    original = batcher._step

    def step(items):
        if len(items) == rows_wanted and not entered.is_set():
            entered.set()
            assert release.wait(30), "the test never released the pass"
        return original(items)
    batcher._step = step
    return entered, release


@torch.inference_mode()
def test_a_consumer_leaving_while_its_row_is_in_a_step_fails_only_that_row(decoder):
    """The loop copies a pass's inputs when it takes them: a consumer closing mid-pass cannot fail the others."""
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        alone = _run_together(batcher, [_greedy(decoder, 4, 20, seed=7, record=[])])[0]
        entered, release = _hold_step(batcher, 2)
        leaving = batcher.run(_greedy(decoder, 4, 500, seed=8, record=[]))
        staying = batcher.run(_greedy(decoder, 4, 20, seed=7, record=[]))
        next(leaving)
        got = [next(staying)]
        assert entered.wait(30), "no step took both rows"
        leaving.close()  # at once: a message to the loop, which closes its loop once the pass has answered
        assert any(line.left for line in batcher._lines) and batcher.active == 2
        release.set()  # the pass goes on over the input it took from the row that left
        got += list(staying)
        assert got == alone
        _settle(lambda: batcher.active == 0 and _threads() == 0)
    finally:
        batcher.close()


@torch.inference_mode()
def test_an_error_in_the_loop_itself_reaches_every_waiter_and_the_loop_goes_on(decoder, monkeypatch):
    """A failure outside a forward pass (here: picking the work) answers each waiting row and call within
    a second with an error naming it; the next request is served."""
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        batcher.call(lambda: None)  # the loop runs
        original = batcher._work
        armed = threading.Event()

        def work():
            if armed.is_set() and any(r is not None and r.state == "pending" for r in batcher.rows):
                armed.clear()
                raise RuntimeError("a bug in the loop")
            return original()
        monkeypatch.setattr(batcher, "_work", work)
        outcomes: list = []

        def request():
            try:
                outcomes.append(list(batcher.run(_greedy(decoder, 4, 30, seed=3, record=[]))))
            except MizuotoError as e:
                outcomes.append(e)
        armed.set()
        threads = [threading.Thread(target=request) for _ in range(2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a waiter hangs"
        failed = [o for o in outcomes if isinstance(o, MizuotoError)]
        assert failed and all("batch loop failed" in str(o) and "a bug in the loop" in str(o) for o in failed)
        assert time.monotonic() - start < 5
        assert len(list(batcher.run(_greedy(decoder, 4, 12, seed=4, record=[])))) == 12  # served again
        assert batcher.call(lambda: "still here") == "still here"
    finally:
        batcher.close()


@torch.inference_mode()
def test_close_joins_the_loop_it_started(decoder):
    before = {t.ident for t in threading.enumerate()}
    batcher = DecodeBatcher(decoder, _head(decoder), 2, contextlib.nullcontext, sampler=None)
    assert len(list(batcher.run(_greedy(decoder, 4, 5, seed=1, record=[])))) == 5
    batcher.close()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before, "close() left a thread running"


@torch.inference_mode()
def test_a_cancel_ends_the_wait_for_the_next_token_and_for_a_rows_step_within_a_second(decoder):
    """The request waiting for its next token takes its lease: a cancel (here while the loop is held inside
    a step) ends it within a second, and the loop ends its sequence once the pass has answered."""
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        _run_together(batcher, [_greedy(decoder, 4, 3, seed=1, record=[])])  # the loop runs
        entered, release = _hold_step(batcher, 1)
        lease = Lease()
        tokens = batcher.run(_greedy(decoder, 4, 50, seed=2, record=[]), lease)
        error, took = cancel_during(lambda: list(tokens), lease, entered.is_set, settle=0.0, timeout=30)
        assert isinstance(error, RequestCancelled) and "by the test" in str(error) and took < 1.0
        release.set()
        _settle(lambda: batcher.active == 0 and _threads() == 0)
        assert len(list(batcher.run(_greedy(decoder, 4, 5, seed=3, record=[])))) == 5  # served again
    finally:
        batcher.close()


@torch.inference_mode()
def test_a_requests_first_audio_runs_before_steps_and_earlier_calls(decoder):
    """The loop's policy: prefills, then urgent calls (a request's first audio), then calls and steps in turn."""
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    order: list[str] = []
    original = batcher._step

    def step(items):
        order.append("step")
        return original(items)
    batcher._step = step
    entered, release = threading.Event(), threading.Event()
    try:
        tokens = batcher.run(_greedy(decoder, 4, 30, seed=1, record=[]))
        next(tokens)
        holder = threading.Thread(target=lambda: batcher.call(lambda: (order.append("held"), entered.set(),
                                                                       release.wait(30))))
        holder.start()
        assert entered.wait(30)
        later = threading.Thread(target=lambda: batcher.call(lambda: order.append("later"), kind="chunk"))
        later.start()
        _settle(lambda: len(batcher._calls) == 1)
        first = threading.Thread(target=lambda: batcher.call(lambda: order.append("first"), kind="chunk", urgent=True))
        first.start()
        _settle(lambda: len(batcher._calls) == 2 and any(r is not None and r.state == "pending" for r in batcher.rows))
        release.set()
        for t in (holder, later, first):
            t.join(30)
        seq = order[order.index("held"):]  # the row stepped before the call was held
        assert seq[:4] == ["held", "first", "step", "later"], seq[:6]
        assert len(list(tokens)) == 29
        t = batcher.timings()
        assert t["chunk"] > 0 and t["call"] > 0 and any(k.startswith("step ") for k in t) and t["prefill"] > 0
    finally:
        release.set()
        batcher.close()


def _pair(decoder, steps: int, seed: int, record: list):
    """A sequence on two rows at once (classifier-free guidance's shape): both fed, then both read, each step."""
    def produce(rows):
        assert isinstance(rows, tuple) and len(rows) == 2
        g = torch.Generator().manual_seed(seed)
        pair = _steps(rows, stacked=True).attach(DynamicKVCache)
        x = torch.randn(2, 4, CFG.hidden_size, generator=g)
        for _ in range(steps):
            scores = yield from pair.scores(x)  # both rows' inputs in one pass
            record.append(scores.clone())
            token = int((scores[0] - scores[1]).argmax())
            yield token
            x = decoder.embed_tokens.weight[token].reshape(1, 1, -1).expand(2, 1, -1)
    return produce


@torch.inference_mode()
def test_a_sequence_of_two_rows_shares_steps_and_is_batch_invariant(decoder):
    """A pair joins only when two rows are free (never holding one while waiting), its rows share passes,
    and its scores do not depend on the rows beside it; more rows than the width is an error."""
    batcher = DecodeBatcher(decoder, _head(decoder), WIDTH, contextlib.nullcontext, sampler=None)
    try:
        alone: list = []
        _run_together(batcher, [_pair(decoder, 8, seed=5, record=alone)], rows=2)
        steps, rows = batcher.steps, batcher.row_steps
        assert rows > steps and batcher.stats()["active"] == 0  # its two rows went through steps together
        mine: list = []
        pairs = [_pair(decoder, 6, seed=7, record=[]), _pair(decoder, 10, seed=8, record=[])]
        _run_together(batcher, [*pairs, _pair(decoder, 8, seed=5, record=mine),
                                _greedy(decoder, 3, 5, seed=9, record=[])], rows=[2, 2, 2, 1])
        assert len(mine) == len(alone)
        for i, (a, b) in enumerate(zip(alone, mine)):
            assert torch.equal(a, b), f"step {i} of the pair differs beside other rows"
        assert batcher.stats()["active"] == 0
        with pytest.raises(ValueError, match="rows"):
            next(iter(batcher.run(_pair(decoder, 1, seed=1, record=[]), rows=WIDTH + 1)))
    finally:
        batcher.close()


@torch.inference_mode()
def test_streamed_text_is_taken_by_the_requests_thread_and_leaving_meanwhile_frees_the_row_at_once(decoder):
    """The caller's text source runs in the request's thread (never on the batch's: it may block): a sequence
    waiting for text holds no pass, and a request leaving then frees its row at once, with no thread left."""
    batcher = DecodeBatcher(decoder, _head(decoder), 2, contextlib.nullcontext, sampler=None)
    readers: list = []

    def text():
        for _ in range(3):
            readers.append(threading.current_thread().name)
            yield torch.randn(1, 3, CFG.hidden_size)

    def produce(row):
        rows, pieces = _steps(row).attach(DynamicKVCache), text()
        while (piece := (yield from rows.next(pieces))) is not None:
            yield int((yield from rows.scores(piece)).argmax())
    try:
        assert len(list(batcher.run(produce))) == 3 and set(readers) == {threading.current_thread().name}
        tokens = batcher.run(produce)
        next(tokens)
        _settle(lambda: any(line.state == "text" for line in batcher._lines))  # it waits for its next piece
        started = time.monotonic()
        tokens.close()
        _settle(lambda: batcher.active == 0, 1.0)  # its place is free for another
        assert time.monotonic() - started < 1.0
        assert len(list(batcher.run(_greedy(decoder, 4, 3, seed=1, record=[])))) == 3
        assert _threads() == 0
    finally:
        batcher.close()


@torch.inference_mode()
def test_packing_is_decided_when_the_batch_is_made_not_by_its_first_pass(decoder):
    """The decoder a batch packs is packed when the batch is made (at the model's load): a first batched
    request no longer changes what any other use of the decoder computes afterwards."""
    x = torch.randn(1, 5, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    batcher = DecodeBatcher(decoder, _head(decoder), 2, contextlib.nullcontext, sampler=None)
    try:
        assert batcher.packed == 7 * CFG.num_hidden_layers and not batcher.alive  # before any pass or thread
        before = decoder(x, DynamicKVCache())
        assert len(list(batcher.run(_greedy(decoder, 4, 3, seed=1, record=[])))) == 3
        assert torch.equal(decoder(x, DynamicKVCache()), before)
    finally:
        batcher.close()
