"""A stage call's own working memory (Stage.call_memory, Model.room): reserved when its inputs are known.

A request is admitted with the least it needs; each call that needs more reserves it first, through
the same admission (evicting idle models, waiting for room others hold), and gives it back after.
"""

import threading
import time
from dataclasses import replace

import pytest

from mizuoto.errors import InvalidRequest, MemoryBudgetError, RequestCancelled, RequestTooLarge
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Stage, SynthesisRequest
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.memory import plan_model
from mizuoto.runtime.options import LoadOptions
from mizuoto.runtime.scheduler import Scheduler
from mizuoto.testing.toy import NOTE_SECONDS, ToneEngine, write_model
from mizuoto.testing.waits import cancel_during

LONG = SynthesisRequest("ab" * 1500, voice="low", seed=0)  # one render call of 3000 notes
SHORT = SynthesisRequest("ab", voice="low", seed=0)


def _figures(rt, name, request):
    """(admitted peak, peak during the request's one render call)."""
    plan = rt.memory.plan_for(rt._get(name), request)
    samples = int(NOTE_SECONDS * 16000 / request.speed)
    notes = sum(not c.isspace() for c in request.text)
    working = rt.model(name).stage("render").call_working(notes=notes, samples=samples)
    stages = [replace(s, working=working) if s.name == "render" else s for s in plan.stages]
    return plan.peak, plan_model(name, stages, plan.budget, plan.device, plan.stream).peak


def test_a_stage_declares_its_calls_memory_and_a_bad_figure_is_refused():
    stage = Stage("render", "frames", {}, call_memory=lambda notes: 4 * notes)
    assert stage.call_working(notes=3) == 12
    with pytest.raises(InvalidRequest, match="declares no per-call working memory"):
        Stage("render", "frames", {}).call_working(notes=3)
    with pytest.raises(InvalidRequest, match="non-negative int"):
        Stage("render", "frames", {}, call_memory=lambda notes: -1).call_working(notes=3)


def test_a_request_is_admitted_with_the_least_it_needs_and_its_call_reserves_the_rest(tone_dir):
    with Runtime(engines=[ToneEngine], plugins=False) as rt:
        name = rt.load(tone_dir)
        admitted, during = _figures(rt, name, LONG)
        assert during > admitted == rt.memory.plan_for(rt._get(name), SHORT).peak
        seen = []
        place = rt._get(name).scheduler.place

        def watching(stage, lease=None):  # what the pool holds for the model while each call runs
            seen.append((stage, rt.memory.pool("cpu").used()[0]))
            return place(stage, lease)
        rt._get(name).scheduler.place = watching
        list(rt.synthesize(name, LONG))
        assert ("render", during) in seen and ("notes", admitted) in seen
        assert rt.memory.pool("cpu").used()[0] == admitted  # given back after the call


def test_a_call_evicts_an_idle_model_to_make_its_room(tone_dir, tmp_path):
    with Runtime(engines=[ToneEngine], plugins=False) as probe:
        admitted, during = _figures(probe, probe.load(tone_dir), LONG)
    assert during > admitted + admitted // 2
    with Runtime(ram=during + admitted // 2, engines=[ToneEngine], plugins=False) as rt:
        x = rt.load(tone_dir, name="x")
        y = rt.load(write_model(tmp_path / "other"), name="y")
        assert {m.name for m in rt.models()} == {"x", "y"}  # both admitted: two short plans fit
        assert list(rt.synthesize(x, LONG))
        assert rt.evictions == 1 and [m.name for m in rt.models()] == ["x"]


def test_a_call_the_budget_can_never_hold_fails_that_request_with_the_figures(tone_dir):
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    call = model.stage("render").call_working(notes=3000, samples=960)  # beyond the budget by itself
    with Runtime(ram=call - 1, engines=[ToneEngine], plugins=False) as rt:
        name = rt.load(tone_dir)
        chunks = rt.synthesize(name, LONG)  # admitted: it may speak fewer notes than its text has
        with pytest.raises(RequestTooLarge, match=r"refused at its render call \(notes 3000, samples 960\):"
                                                  r" model tone does not fit"):
            next(chunks)
        assert rt.pins(name) == 0 and rt.memory.pool("cpu").used()[0] == rt.plan(name).peak
        assert list(rt.synthesize(name, SHORT))  # the model serves the next request


def _holding(sched, lease, reserve, peak, entered, release):
    with sched.hold(lease, reserve=reserve, peak=peak, budget=10):
        entered.release()
        release.wait(10)


def test_a_growing_call_waits_for_the_other_requests_room_and_gives_way_when_all_wait(tone_dir):
    """Width 2, budget 10: A (reserve 4) grows to 7 beside B's 4: waits until B leaves. When B also
    waits to grow beside A, neither can make room for the other: the one that would wait gives way."""
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    model.batch_width = 2
    sched = Scheduler(model, "cpu")
    a, b = Lease(5.0), Lease(5.0)
    entered, releases = threading.Semaphore(0), [threading.Event(), threading.Event()]
    holders = [threading.Thread(target=_holding, args=(sched, lease, 4, 4, entered, release))
               for lease, release in zip((a, b), releases)]
    for t in holders:
        t.start()
        assert entered.acquire(timeout=10)
    grown = threading.Event()
    grower = threading.Thread(target=lambda: (sched.resize(a, 7, budget=10), grown.set()))
    grower.start()
    assert not grown.wait(0.3) and sched._requests[a].growing  # 7 beside 4 > 10
    with pytest.raises(MemoryBudgetError, match="gives way"):
        sched.resize(b, 7, budget=10)  # both would wait for the other
    sched.resize(b, 4)  # back to its admission: nothing changes for A
    assert not grown.is_set()
    releases[1].set()  # B leaves (its hold ends): A fits alone
    holders[1].join(10)
    assert grown.wait(10) and sched.together() == 7
    releases[0].set()
    grower.join(10), holders[0].join(10)
    assert sched.running == 0 and sched.requests() == []


def test_a_growing_call_on_the_compute_loop_is_put_aside_and_gives_way_when_all_others_wait(tone_dir):
    """Without `wait` (a call on a batch loop, which never waits): A growing to 7 beside B's 4 raises RoomLater and
    stays marked as growing while its call is aside; B then growing too gives way at once (MemoryBudgetError)."""
    from mizuoto.runtime.executor import RoomLater

    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    model.batch_width = 2
    sched = Scheduler(model, "cpu")
    a, b = Lease(5.0), Lease(5.0)
    entered, release = threading.Semaphore(0), threading.Event()
    holders = [threading.Thread(target=_holding, args=(sched, lease, 4, 4, entered, release)) for lease in (a, b)]
    for t in holders:
        t.start()
        assert entered.acquire(timeout=10)
    with pytest.raises(RoomLater):
        sched.resize(a, 7, budget=10, wait=False)
    assert sched._requests[a].growing and sched._requests[a].peak == 4
    with pytest.raises(MemoryBudgetError, match="gives way"):
        sched.resize(b, 7, budget=10, wait=False)
    assert not sched._requests[b].growing
    release.set()
    for t in holders:
        t.join(10)
    sched.close()


def test_a_growing_call_ends_with_its_lease(tone_dir):
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    model.batch_width = 2
    sched = Scheduler(model, "cpu")
    a, b = Lease(), Lease()
    entered, release = threading.Semaphore(0), threading.Event()
    holders = [threading.Thread(target=_holding, args=(sched, lease, 4, 4, entered, release)) for lease in (a, b)]
    for t in holders:
        t.start()
        assert entered.acquire(timeout=10)
    error, took = cancel_during(lambda: sched.resize(a, 7, budget=10), a, lambda: sched._requests[a].growing)
    assert isinstance(error, RequestCancelled) and took < 1.0
    request = sched._requests[a]
    assert not request.growing and (request.peak, request.reserve) == (4, 4)
    release.set()
    for t in holders:
        t.join(10)


def test_a_reservation_inside_one_it_fits_in_adds_nothing_and_two_stages_reserve_together(tone_dir):
    """A chunk call reserves its nested stages' calls as it starts, then each nested call enters its own: the inner
    one is covered and never waits; reservations of two stages at once count both."""
    with Runtime(engines=[ToneEngine], plugins=False) as rt:
        name = rt.load(tone_dir)
        loaded = rt._get(name)
        lease = Lease()
        lease.plan = rt.memory.plan_for(loaded, SHORT)
        rt._pin(name, lease)
        used = lambda: rt.memory.pool("cpu").used()[0]  # noqa: E731
        with loaded.scheduler.hold(lease, peak=lease.plan.peak):
            rt.memory.try_admit(loaded, lease.plan, lease=lease)
            admitted = used()
            big = 4 << 20
            with rt.memory.reserve(loaded, "render", lease, big, {"notes": 1}):
                grown = used()
                assert grown > admitted
                with rt.memory.reserve(loaded, "render", lease, big // 2, {"notes": 1}):
                    assert used() == grown and rt.memory._calls[lease] == {"render": big}
                assert used() == grown
                with rt.memory.reserve(loaded, "listen", lease, 2 * big, {"seconds": 1}):
                    assert rt.memory._calls[lease] == {"render": big, "listen": 2 * big} and used() > grown
                assert used() == grown and rt.memory._calls[lease] == {"render": big}
            assert used() == admitted and lease not in rt.memory._calls
        lease.release()


def test_giving_a_calls_room_back_never_evicts_a_model(tone_dir, tmp_path, monkeypatch):
    """After its call the request's plan shrinks back: re-admitting it moves or closes no other model (that ran on
    the thread where the call's work ended, a compute loop, closing another model's loop from there)."""
    from mizuoto.runtime.memory import Pool

    other = write_model(tmp_path / "other")
    with Runtime(engines=[ToneEngine], plugins=False) as rt:
        name, idle = rt.load(tone_dir), rt.load(other)
        admits: list = []
        admit = Pool.admit

        def recording(self, who, need, fixed=0, host=0, reserve=0, busy=()):
            admits.append((who, set(busy)))
            return admit(self, who, need, fixed, host, reserve, busy)
        monkeypatch.setattr(Pool, "admit", recording)
        list(rt.synthesize(name, LONG))
        mine = [busy for who, busy in admits if who == name]
        assert len(mine) >= 3  # the turn, the render call's room, its release
        assert idle not in mine[0] and idle in mine[-1], "the release could evict the idle model"
        assert {m.name for m in rt.models()} == {name, idle}


def test_a_batched_calls_room_held_by_another_model_waits_aside_while_the_batch_loop_goes_on(tone_dir, tmp_path):
    """Toy LM at width 2 beside the tone model, whose lease pins it: a request's render call needs room only the
    tone model's eviction would give. The call waits aside on the batch loop (it never waits there), which
    meanwhile runs other work; when the lease lets go the call runs (the tone model evicted) and the request ends."""
    from mizuoto.testing.toy_lm import ToyLMEngine
    from mizuoto.testing.toy_lm import write_model as write_lm

    big = 64 << 20
    request = SynthesisRequest("Hello there.", voice="low", seed=1)
    with Runtime(engines=[ToneEngine, ToyLMEngine], plugins=False, voices=False) as probe:
        x = probe.load(write_lm(tmp_path / "toylm"), compute={"batch": 2})
        plan = probe.memory.plan_for(probe._get(x), request)
        stages = [replace(s, working=big) if s.name == "render" else s for s in plan.stages]
        with_call = plan_model(x, stages, plan.budget, plan.device, plan.stream).peak
        beside = probe.plan(probe.load(tone_dir)).peak
    assert plan.peak + beside <= with_call < with_call + beside
    with Runtime(ram=with_call, engines=[ToneEngine, ToyLMEngine], plugins=False, voices=False) as rt:
        y = rt.load(tone_dir)
        x = rt.load(tmp_path / "toylm", compute={"batch": 2})
        model = rt.model(x)
        model.stages = tuple(replace(s, call_memory=lambda notes, samples: big) if s.name == "render" else s
                             for s in model.stages)
        holding = Lease()
        assert rt.pin(y, holding)
        done: list = []
        t = threading.Thread(target=lambda: done.append(list(rt.synthesize(x, request))))
        t.start()
        loop = rt._get(x).scheduler.executor
        end = time.monotonic() + 30
        while not loop._aside and time.monotonic() < end:
            time.sleep(0.01)
        assert loop._aside and not done  # its render call waits aside, unanswered
        assert loop.call(lambda: threading.current_thread().name, Lease(5.0)) == loop._thread.name  # loop goes on
        assert [m.name for m in rt.models()] == [y, x]
        holding.release()
        t.join(30)
        assert not t.is_alive() and done and done[0]
        assert [m.name for m in rt.models()] == [x]  # the tone model was evicted for the call
