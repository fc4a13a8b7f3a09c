"""A model's compute thread (runtime.executor): calls in order, bounded by their lease, joined on close."""

import threading
import time
import types

import pytest

from mizuoto.errors import MizuotoError, RequestCancelled
from mizuoto.runtime import executor as module
from mizuoto.runtime.executor import Executor, RoomLater
from mizuoto.runtime.lease import Lease, within
from mizuoto.testing.waits import cancel_during


def _names() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def test_calls_run_on_one_thread_in_order_and_raise_where_they_were_made():
    ex = Executor("m")
    try:
        seen = [ex.call(lambda i=i: (i, threading.current_thread().name)) for i in range(3)]
        assert seen == [(0, "mizuoto-m-compute"), (1, "mizuoto-m-compute"), (2, "mizuoto-m-compute")]
        assert ex.call(lambda: ex.call(lambda: "nested")) == "nested"
        with pytest.raises(ZeroDivisionError):
            ex.call(lambda: 1 / 0)
    finally:
        ex.close()


def test_a_cancel_takes_a_queued_call_out_of_line_within_a_second():
    ex = Executor("m")
    entered, release, ran = threading.Event(), threading.Event(), []
    holder = threading.Thread(target=lambda: ex.call(lambda: (entered.set(), release.wait(30))))
    holder.start()
    try:
        assert entered.wait(10)
        lease = Lease()
        error, took = cancel_during(lambda: ex.call(lambda: ran.append("ran"), lease), lease)
        assert isinstance(error, RequestCancelled) and "waiting for its compute call" in str(error) and took < 1.0
    finally:
        release.set()
        holder.join(10)
    assert ex.call(lambda: "next") == "next" and ran == []  # the cancelled call never ran
    ex.close()


def test_a_call_whose_room_others_hold_waits_aside_until_a_wake_and_a_cancel_takes_it_out():
    """A call raising RoomLater (its memory held by others: the loop never waits for room) is put aside unanswered,
    other calls run meanwhile, and it runs again at the next wake; a cancel takes one aside out within a second."""
    ex = Executor("m")
    free, tries, results = threading.Event(), [], []

    def needs_room():
        tries.append(1)
        if not free.is_set():
            raise RoomLater("held by others")
        return "ran"
    waiter = threading.Thread(target=lambda: results.append(ex.call(needs_room, Lease(30))))
    waiter.start()
    try:
        end = time.monotonic() + 10
        while not tries and time.monotonic() < end:
            time.sleep(0.01)
        assert ex.call(lambda: "other") == "other"  # the loop goes on meanwhile
        time.sleep(0.2)
        assert tries == [1] and results == [] and ex.pending() == 1  # aside: not tried again on a timer
        free.set()
        ex.wake()  # memory was let go somewhere
        waiter.join(10)
        assert results == ["ran"] and len(tries) == 2 and ex.pending() == 0
        free.clear()
        lease = Lease()
        error, took = cancel_during(lambda: ex.call(needs_room, lease), lease, lambda: ex.pending() == 1)
        assert isinstance(error, RequestCancelled) and took < 1.0 and ex.pending() == 0
    finally:
        free.set()
        ex.close()


def test_a_call_sees_its_own_lease_on_the_thread():
    ex = Executor("m")
    lease = Lease()
    try:
        assert ex.call(lambda: ex.running_lease() is lease, lease)
        assert ex.running_lease() is None  # asked from another thread
    finally:
        ex.close()


def test_a_failing_loop_answers_every_waiter_and_goes_on(monkeypatch):
    ex = Executor("m")
    ex.call(lambda: None)
    original, armed = ex._run, threading.Event()

    def run(kind, item):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("a bug in the loop")
        return original(kind, item)
    monkeypatch.setattr(ex, "_run", run)
    armed.set()
    with pytest.raises(MizuotoError, match="compute loop failed.*a bug in the loop"):
        ex.call(lambda: "lost")
    assert ex.call(lambda: "served") == "served" and ex.failures == 1
    ex.close()


def test_close_answers_what_waits_and_joins_the_thread():
    before = _names()
    ex = Executor("closing")
    entered, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: ex.call(lambda: (entered.set(), release.wait(30))))
    holder.start()
    assert entered.wait(10)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(pytest.raises(RequestCancelled, ex.call, lambda: 1)))
    waiter.start()
    time.sleep(0.1)
    closer = threading.Thread(target=ex.close)
    closer.start()
    waiter.join(5)
    assert outcome and "closed" in str(outcome[0].value)
    release.set()
    closer.join(10), holder.join(10)
    assert not ex.alive and _names() <= before
    with pytest.raises(RequestCancelled, match="closed"):
        ex.call(lambda: None)


def test_the_loop_counts_its_time_by_kind_nested_kinds_apart(monkeypatch):
    """`timings()`: each call under its kind, a call made inside another under its own kind only, idle apart."""
    now = [0.0]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def advance(s: float) -> None:
        now[0] += s

    ex = Executor("m")
    try:
        ex.call(lambda: (advance(2.0), ex.call(lambda: advance(5.0), kind="flow"), advance(1.0)), kind="chunk")
        ex.call(lambda: advance(0.5))
        t = ex.timings()
        assert t["chunk"] == 3.0 and t["flow"] == 5.0 and t["call"] == 0.5
        assert set(t) <= {"chunk", "flow", "call", "idle"}
        with ex.timing("elsewhere"):  # off the loop's thread: counted nowhere
            advance(7.0)
        assert "elsewhere" not in ex.timings()
    finally:
        ex.close()


def test_pending_counts_waiting_calls_and_the_running_one_and_a_cancelled_callers_started_call():
    """A caller whose lease ends stops waiting, but its started call runs on: pending says so until it ends."""
    ex = Executor("pending")
    started, release = threading.Event(), threading.Event()
    try:
        assert ex.pending() == 0
        lease = Lease(None)
        caller = threading.Thread(target=lambda: _swallow(lambda: ex.call(lambda: (started.set(), release.wait(5)),
                                                                            lease)))
        caller.start()
        assert started.wait(5)
        assert ex.pending() == 1
        lease.cancel("the client left")
        caller.join(5)
        assert not caller.is_alive(), "the cancelled caller stopped waiting"
        assert ex.pending() == 1, "its started call still runs"
        release.set()
        deadline = time.monotonic() + 5
        while ex.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.pending() == 0
    finally:
        release.set()
        ex.close()


def _swallow(fn):
    try:
        fn()
    except RequestCancelled:
        pass


def test_a_nested_calls_room_held_by_others_gives_way_instead_of_running_its_call_again(tone_dir):
    """On a batch loop only a call's own rooms, reserved before any of its work, may put it aside (it is run again
    from the start). A nested call asking for room after work of the outer call ran gives way (MemoryBudgetError):
    running the outer call again would repeat that work."""
    import contextlib

    import torch

    from mizuoto.errors import MemoryBudgetError
    from mizuoto.runtime.options import LoadOptions
    from mizuoto.testing.toy import ToneEngine

    class Placement:  # the runtime's placement, reduced to a room that others hold for "render"
        def place(self, stage, lease=None):
            return contextlib.nullcontext(torch.device("cpu"))

        @contextlib.contextmanager
        def reserve(self, stage, lease, working, sizes):
            if stage == "render":
                raise RoomLater("held by others")
            yield

        def schedule(self):
            pass

    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    ex = Executor("m")
    ex.placement, model.executor, model.batch_width = Placement(), ex, 2
    runs = []

    def outer(device):
        runs.append(threading.current_thread().name)
        return model.compute("render", lambda d: None, notes=1, samples=10)  # not declared in reserve=
    try:
        with pytest.raises(MemoryBudgetError, match="declare it in reserve="), within(Lease(10.0)):
            model.compute("notes", outer)  # (put aside, it would wait out its deadline)
        assert runs == ["mizuoto-m-compute"] and ex.pending() == 0  # run once, never put aside
    finally:
        ex.close()
