"""Scheduler: stage modules move as the plan says, for plain and streaming (generator) stages."""

import pytest
import torch

from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.errors import InvalidRequest
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.memory import Plan, measure, run_groups
from mizuoto.runtime.options import LoadOptions
from mizuoto.runtime.scheduler import Scheduler
from mizuoto.testing.toy import ToneEngine

PRESET = SynthesisRequest("abcdefghij", mode="preset", voice="low", seed=0)


def _setup(tone_dir, stream, pinned):
    """A scheduler over a fresh tone model and a plan pinning `pinned` (sizes do not matter here)."""
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    sizes = measure(model.stages, None, "cpu")
    plan = Plan("m", "cpu", 2**40, stream, sizes, pinned, run_groups(sizes, stream), 0)
    return model, Scheduler(model, "cpu"), plan


def _until(done, timeout=10.0):
    """Whether done() came true within `timeout` seconds (polled: for a state another thread reaches)."""
    import time

    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(done())


def _run(sched, request):
    lease = Lease()
    with sched.hold(lease):
        return list(sched.execute(request, lease))


def test_turns_move_each_stage_in_and_out(tone_dir):
    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    assert plan.strategy == "turns"
    sched.apply(plan)
    assert sched.trace == []
    ref = (torch.sin(torch.arange(4000) * 0.1), 16000)
    _run(sched, SynthesisRequest("abc", mode="cross_lingual", voice=Reference(ref), seed=0))
    assert sched.trace == [("listen", "device"), ("listen", "host"), ("notes", "device"),
                           ("notes", "host"), ("render", "device")]
    sched.trace.clear()
    _run(sched, PRESET)  # render is still in from the last request
    assert sched.trace == [("render", "host"), ("notes", "device"), ("notes", "host"), ("render", "device")]


def test_streaming_keeps_its_group_together(tone_dir):
    model, sched, plan = _setup(tone_dir, stream=True, pinned=("listen",))
    assert plan.groups == (("listen",), ("notes", "render"))
    sched.apply(plan)
    assert sched.trace == [("listen", "device")]
    chunks = _run(sched, SynthesisRequest("abcdefghij", mode="preset", voice="low", seed=0, stream=True))
    assert len(chunks) == 3
    # notes and render come in together once, then stay while the generator alternates between them
    assert sched.trace == [("listen", "device"), ("notes", "device"), ("render", "device")]
    sched.apply(Plan("m", "cpu", 2**40, False, plan.stages, ("render",), run_groups(plan.stages, False), 0))
    assert sched.trace[3:] == [("listen", "host"), ("notes", "host")]


def test_resident_plan_moves_once_and_offload_returns_all(tone_dir):
    model, sched, plan = _setup(tone_dir, stream=False, pinned=("listen", "notes", "render"))
    assert plan.strategy == "resident"
    sched.apply(plan)
    assert sched.trace == [("listen", "device"), ("notes", "device"), ("render", "device")]
    _run(sched, PRESET)
    _run(sched, PRESET)
    assert len(sched.trace) == 3
    sched.offload()
    assert sched.trace[3:] == [("listen", "host"), ("notes", "host"), ("render", "host")] and sched.plan is None
    with pytest.raises(InvalidRequest, match="no plan"):
        _run(sched, PRESET)


def test_results_do_not_depend_on_the_plan(tone_dir):
    outs = []
    for pinned in ((), ("notes",), ("listen", "notes", "render")):
        model, sched, plan = _setup(tone_dir, stream=False, pinned=pinned)
        sched.apply(plan)
        outs.append(_run(sched, PRESET)[0].samples)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_unbound_model_runs_where_it_is(tone_dir):
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    chunks = list(model.synthesize(PRESET))
    assert len(chunks) == 1 and chunks[0].final
    with model.use("notes") as device:
        assert device == torch.device("cpu")
    with pytest.raises(InvalidRequest, match="no stage 'lm'"):
        model.stage("lm")


def test_the_scheduler_is_the_placement_of_the_executor_it_gives_the_model(tone_dir):
    """Adopted by a scheduler, a model submits to the scheduler's executor, and its stage calls are placed
    by the plan there; once the scheduler closes, the model runs where its modules are again."""
    import threading

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    assert model.executor is sched.executor and sched.executor.placement is sched
    with pytest.raises(InvalidRequest, match="no plan"):
        with model.use("notes"):
            pass
    sched.apply(plan)
    assert model.submit(lambda: threading.current_thread().name, Lease(), "probe") == "mizuoto-model-compute"
    with model.use("render") as device:
        assert device == torch.device("cpu") and sched.trace[-1] == ("render", "device")
    sched.close()
    assert model.executor is None and model.submit(lambda: 7) == 7
    moves = len(sched.trace)
    with model.use("notes") as device:
        assert device == torch.device("cpu") and len(sched.trace) == moves


def test_a_batched_model_holds_up_to_its_width_and_a_budget_gates_joining(tone_dir):
    """batch_width 2: two requests hold the model at once, a third waits; a budget can hold a joiner back."""
    import threading

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    model.batch_width = 2
    sched.apply(plan)
    entered, release = threading.Semaphore(0), threading.Event()

    def holder(reserve, peak=None):
        with sched.hold(Lease(), reserve=reserve, peak=reserve if peak is None else peak, budget=10):
            entered.release()
            release.wait(10)

    threads = [threading.Thread(target=holder, args=(4,)) for _ in range(2)]
    threads[0].start()
    assert entered.acquire(timeout=10)
    threads[1].start()
    assert entered.acquire(timeout=10)  # the second joins the first (4 + 4 <= 10)
    assert sched.running == 2 and sched.together() == 8
    third = threading.Thread(target=holder, args=(1,))
    third.start()
    assert not entered.acquire(timeout=0.3)  # the width is taken
    release.set()
    assert entered.acquire(timeout=10)  # the third got its turn
    for t in (*threads, third):
        t.join(10)
    assert sched.running == 0 and sched.together() == 0
    release.clear()
    big = threading.Thread(target=holder, args=(4,))
    big.start()
    assert entered.acquire(timeout=10)
    late = threading.Thread(target=holder, args=(7,))  # 4 + 7 > 10: waits although a row is free
    late.start()
    assert not entered.acquire(timeout=0.3) and sched.running == 1
    release.set()
    big.join(10), late.join(10)
    assert entered.acquire(timeout=10) and sched.running == 0
    # a small joiner must also leave the running request room: 9 beside its 2 is 11 > 10, though 2 + 1 fits
    release.clear()
    wide = threading.Thread(target=holder, args=(1, 9))
    wide.start()
    assert entered.acquire(timeout=10)
    small = threading.Thread(target=holder, args=(2,))
    small.start()
    assert not entered.acquire(timeout=0.3) and sched.running == 1 and sched.together() == 9
    release.set()
    wide.join(10), small.join(10)
    assert entered.acquire(timeout=10) and sched.running == 0 and sched.together() == 0


def test_waiting_requests_enter_in_arrival_order_and_none_overtakes_a_large_one(tone_dir):
    """A large request waiting for room beside a small running one is not overtaken by a later small
    one that would fit: they enter first come first (budget 10, width 2)."""
    import threading
    import time

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    model.batch_width = 2
    sched.apply(plan)
    order, release = [], {n: threading.Event() for n in ("small", "large", "later")}

    def holder(name, peak, reserve):
        with sched.hold(Lease(), reserve=reserve, peak=peak, budget=10):
            order.append(name)
            release[name].wait(10)

    threads = {n: threading.Thread(target=holder, args=(n, *sizes))
               for n, sizes in (("small", (2, 2)), ("large", (9, 1)), ("later", (2, 2)))}
    threads["small"].start()
    assert _until(lambda: order)
    threads["large"].start()  # 9 beside the running 2 is 11 > 10: waits
    assert _until(lambda: sched.waiting == 1)
    threads["later"].start()  # would fit beside "small" (2 + 2), but "large" came first
    assert _until(lambda: sched.waiting == 2 or len(order) > 1)
    time.sleep(0.2)
    assert order == ["small"] and sched.running == 1
    release["small"].set()
    assert _until(lambda: len(order) >= 2)
    time.sleep(0.2)
    assert order == ["small", "large"] and sched.running == 1  # "later" does not fit beside "large"
    release["large"].set(), release["later"].set()
    for t in threads.values():
        t.join(10)
    assert order == ["small", "large", "later"] and sched.running == 0 and sched.waiting == 0


def test_each_stage_call_sees_its_own_requests_lease(tone_dir):
    """Two requests on a batched model: a stage call checks the lease it is given, whatever thread makes it."""
    import threading

    from mizuoto.errors import RequestCancelled

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    model.batch_width = 2
    sched.apply(plan)
    mine, theirs = Lease(), Lease()
    theirs.cancel("by the test")
    seen = []

    def other():
        try:
            with model.use("notes", theirs):
                pass
        except RequestCancelled as e:
            seen.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    with model.use("notes", mine):  # this request is not cancelled
        seen.append("ran")
    assert seen == ["the request was cancelled by the test before its notes stage call", "ran"]


def test_a_request_runs_on_the_models_executor_and_its_lease_stops_it(tone_dir):
    """An unbatched model's chunks are computed on its one executor thread; a cancel between chunks
    stops the request at its next stage call there, and the model serves the next one."""
    import threading

    from mizuoto.errors import RequestCancelled

    model, sched, plan = _setup(tone_dir, stream=True, pinned=())
    sched.apply(plan)
    threads = []
    original = model.synthesize

    def spy(request):
        for chunk in original(request):
            threads.append(threading.current_thread().name)
            yield chunk
    model.synthesize = spy
    streamed = SynthesisRequest("abcdefghij", mode="preset", voice="low", seed=0, stream=True)
    assert len(_run(sched, streamed)) == 3
    assert set(threads) == {"mizuoto-model-compute"}
    lease = Lease()
    with sched.hold(lease):
        chunks = sched.execute(streamed, lease)
        next(chunks)
        lease.cancel("by the test")
        with pytest.raises(RequestCancelled, match="by the test"):
            next(chunks)
    assert len(_run(sched, streamed)) == 3
    sched.close()
    assert not sched.executor.alive


def test_a_cancel_ends_the_wait_for_a_turn(tone_dir):
    """A request queued behind a long one does not wait it out once it is cancelled."""
    from mizuoto.errors import RequestCancelled
    from mizuoto.testing.waits import cancel_during, held_elsewhere

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    with held_elsewhere(lambda: sched.hold(Lease())):  # the long one
        lease = Lease()

        def queued():
            with sched.hold(lease):
                pass
        error, took = cancel_during(queued, lease, lambda: sched.waiting > 0, settle=0.0)
        assert isinstance(error, RequestCancelled) and "waiting for its turn" in str(error) and took < 1.0
        assert sched.waiting == 0 and sched.running == 1
    assert sched.running == 0


def test_the_models_loop_admits_its_requests(tone_dir):
    """Admission is decided on the model's own loop thread (Scheduler.schedule), not in the requests' threads: a
    request's `admit` (its memory) runs there, and the request's thread only waits for the answer."""
    import threading

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    sched.apply(plan)
    where = []

    def admit(others):
        where.append((threading.current_thread().name, others))
        return True
    lease = Lease()
    with sched.hold(lease, peak=3, admit=admit):
        assert sched.running == 1 and sched.requests()[0].status == "running"
    assert where == [("mizuoto-model-compute", 0)]
    sched.close()


def test_a_failure_of_the_lines_own_bookkeeping_reaches_the_head_at_once(tone_dir, monkeypatch):
    """A bug in admission itself (not a refusal by `admit`) is answered to the head of the line by the loop, so its
    thread raises it at once instead of waiting out its deadline; the next request is admitted as usual."""
    import time

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    sched.apply(plan)
    fits = sched._fits

    def broken(request, width):
        raise RuntimeError("the line's bookkeeping broke")
    monkeypatch.setattr(sched, "_fits", broken)
    lease = Lease(30)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="bookkeeping broke"):
        with sched.hold(lease, peak=3):
            pass
    assert time.monotonic() - started < 5, "the head waited for its deadline"
    assert sched.requests() == [] and sched.running == 0
    monkeypatch.setattr(sched, "_fits", fits)
    with sched.hold(Lease(), peak=3):
        assert sched.running == 1
    sched.close()


def test_a_request_waiting_for_memory_keeps_the_head_and_is_tried_again_only_when_woken(tone_dir):
    """`admit` False: the request waits for memory at the head of the line (a later one does not overtake it),
    and the loop tries again when something lets go (`wake`), not on a timer."""
    import threading
    import time

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    sched.apply(plan)
    free, tries, order = threading.Event(), [], []

    def admit(others):
        tries.append(time.monotonic())
        return free.is_set()

    def first():
        with sched.hold(Lease(), admit=admit):
            order.append("first")

    def later():
        with sched.hold(Lease()):
            order.append("later")
    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert _until(lambda: sched.requests() and sched.requests()[0].status == "waiting for memory")
    threads.append(threading.Thread(target=later))
    threads[1].start()
    assert _until(lambda: sched.waiting == 2)
    time.sleep(0.3)
    assert order == [] and 1 <= len(tries) <= 2  # its first try, and at most one for the later arrival's wake
    free.set()
    sched.wake()  # what the runtime does when a request anywhere lets go
    for t in threads:
        t.join(10)
    assert order == ["first", "later"] and sched.waiting == 0 and sched.running == 0
    sched.close()


def test_a_request_leaving_while_the_loop_admits_it_is_let_go_by_the_loop(tone_dir):
    """Forced: the request's lease is cancelled while the loop is inside its `admit`. Its thread returns at once;
    the loop, once admit() answered (admitted), lets the request go; its lease is released only then (so what
    admit() pinned is released too), and the next request in line is admitted."""
    import threading

    from mizuoto.errors import RequestCancelled
    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    sched.apply(plan)
    inside, answer, released = threading.Event(), threading.Event(), []

    def admit(others):
        inside.set()
        answer.wait(10)
        return True
    lease = Lease()
    lease.on_release(lambda: released.append("released"))
    errors = []

    def leaving():
        try:
            with sched.hold(lease, admit=admit):
                errors.append("held")
        except RequestCancelled as e:
            errors.append(e)
        finally:
            lease.release()
    t = threading.Thread(target=leaving)
    t.start()
    assert inside.wait(10)
    lease.cancel("by the test")
    t.join(1.0)
    assert not t.is_alive() and isinstance(errors[0], RequestCancelled)
    assert released == []  # the loop is still admitting it: its lease's release waits for that
    answer.set()
    assert _until(lambda: released == ["released"])
    assert _until(lambda: sched.running == 0)
    assert sched.requests(finished=True)[-1].status == "finished"
    assert _run(sched, PRESET)  # the model serves the next request
    sched.close()


def test_closing_the_scheduler_refuses_its_line(tone_dir):
    """A request waiting in line when its model closes is refused (RequestCancelled, "closed") at once."""
    import threading

    from mizuoto.errors import RequestCancelled
    from mizuoto.testing.waits import held_elsewhere

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    sched.apply(plan)
    errors = []

    def waiter():
        try:
            with sched.hold(Lease()):
                errors.append("held")
        except RequestCancelled as e:
            errors.append(str(e))
    with held_elsewhere(lambda: sched.hold(Lease())):
        t = threading.Thread(target=waiter)
        t.start()
        assert _until(lambda: sched.waiting == 1)
        sched.close()
        t.join(1.0)
        assert not t.is_alive() and errors and "closed" in errors[0]
    with pytest.raises(RequestCancelled, match="closed"):
        with sched.hold(Lease()):
            pass


def test_a_cancel_ends_a_wait_to_move_a_batched_models_modules_during_a_stage_call(tone_dir):
    """On a batched model, moving modules waits for the stage call running now; the waiting request's lease ends
    that wait (it used to wait the whole call)."""
    from mizuoto.errors import RequestCancelled
    from mizuoto.testing.waits import cancel_during, held_elsewhere

    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    model.batch_width = 2
    sched.apply(plan)
    with held_elsewhere(lambda: sched.place("notes", Lease())):  # another request's stage call
        lease = Lease()
        error, took = cancel_during(lambda: sched.sync(lease), lease, settle=0.1)
        assert isinstance(error, RequestCancelled) and "waited to move" in str(error) and took < 1.0
    sched.sync(Lease())  # the moves wait no longer once the call has ended
    sched.close()
