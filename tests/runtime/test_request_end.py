"""Where a request ends: what it holds is released when its last work on the model has ended, never by a
thread that gave up waiting; each wait of a request ends within a second of its cancel; a closed Runtime
refuses loads and leaves no thread. Interleavings are forced with events, not sleeps."""

import threading
import time

import pytest

from mizuoto.errors import MemoryBudgetError, ModelBusy, ModelLoadError, RequestCancelled
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.lease import Lease
from mizuoto.testing.toy import ToneEngine, write_model
from mizuoto.testing.waits import cancel_during


def _until(ready, timeout: float = 10.0) -> bool:
    """Whether ready() holds within `timeout` s (polled: the thing awaited runs on another thread)."""
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class _Gate:
    """Wraps a model method: the call signals `entered` and waits for `go` (at most 20 s) before running."""

    def __init__(self, obj, attr: str):
        self.entered, self.go, self.calls = threading.Event(), threading.Event(), 0
        original = getattr(obj, attr)

        def gated(*args, **kwargs):
            self.calls += 1
            self.entered.set()
            assert self.go.wait(20), "the test never opened the gate"
            return original(*args, **kwargs)
        setattr(obj, attr, gated)


def _peak(tone_dir) -> int:
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as probe:
        return probe.plan(probe.load(tone_dir)).peak


def test_a_cancelled_request_holds_its_model_until_its_running_compute_ends(tone_dir, tmp_path):
    peak = _peak(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False, voices=False) as rt:
        name = rt.load(tone_dir)
        gate = _Gate(rt.model(name), "_render")
        lease = Lease()
        error, took = cancel_during(lambda: list(rt.synthesize(name, "abc", voice="low", lease=lease)), lease,
                                    gate.entered.is_set, settle=0.0)
        assert isinstance(error, RequestCancelled) and took < 1.0  # the waiting thread left at once
        try:
            # ... but its render still runs on the model's compute thread: the model is still the request's
            assert rt.pins(name) == 1 and rt.info(name).running == 1 and not lease.released
            assert [r.status for r in rt.requests()] == ["ending"]  # its caller left; its work has not ended
            with pytest.raises(ModelBusy):
                rt.unload(name)
            with pytest.raises(MemoryBudgetError, match=f"held by {name}"):
                rt.load(other)  # evicting it would hand its memory out under the running call
            queued: list = []
            second = threading.Thread(target=lambda: queued.append(len(list(
                rt.synthesize(name, "abc", voice="low", seed=0)))))
            second.start()
            assert not _until(lambda: bool(queued), 0.3)  # the next request waits for the model's turn
        finally:
            gate.go.set()
        second.join(10)
        assert queued == [1] and gate.calls == 2
        assert _until(lambda: rt.pins(name) == 0 and rt.info(name).running == 0) and lease.released
        assert [(r.status, r.reason) for r in rt.requests(finished=True)] == [
            ("finished", "cancelled by the test"), ("finished", "done")]
        rt.unload(name)


def test_a_request_shows_its_status_and_the_stage_it_runs(tone_dir):
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as rt:
        name = rt.load(tone_dir)
        model = rt.model(name)
        entered, go, original = threading.Event(), threading.Event(), model._notes

        def notes(*args):
            entered.set()
            assert go.wait(20)
            yield from original(*args)
        model._notes = notes
        first = threading.Thread(target=lambda: list(rt.synthesize(name, "abc", voice="low")))
        first.start()
        try:
            assert entered.wait(10)
            second = threading.Thread(target=lambda: list(rt.synthesize(name, "abc", voice="low")))
            second.start()
            assert _until(lambda: len(rt.requests()) == 2)
            assert [(r.status, r.stage) for r in rt.requests(name)] == [("running", "notes"), ("waiting", None)]
        finally:
            go.set()
        first.join(10)
        second.join(10)
        assert rt.requests() == [] and [r.reason for r in rt.requests(finished=True)] == ["done", "done"]


class _GatedTone(ToneEngine):
    """The tone engine whose load waits at a gate (class-level: the runtime makes the engine itself)."""

    gate: "_LoadGate"

    def load(self, model_dir, options):
        model = super().load(model_dir, options)
        self.gate.entered.set()
        assert self.gate.go.wait(20), "the test never opened the gate"
        original = model.close

        def close():
            self.gate.closed.append(model)
            original()
        model.close = close
        return model


class _LoadGate:
    def __init__(self):
        self.entered, self.go, self.closed = threading.Event(), threading.Event(), []


def _alive() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.is_alive()}


def test_a_load_whose_request_is_cancelled_returns_at_once_and_what_it_loads_is_closed(tone_dir):
    before = _alive()
    _GatedTone.gate = gate = _LoadGate()
    rt = Runtime(engines=[_GatedTone], plugins=False, voices=False)
    lease = Lease()
    try:
        error, took = cancel_during(lambda: rt.load(tone_dir, lease=lease), lease, gate.entered.is_set, settle=0.0)
        assert isinstance(error, RequestCancelled) and "while its model loaded" in str(error) and took < 1.0
        assert not lease.released  # the load is its work until it ends
        lease.release()
        assert rt.models() == []
    finally:
        gate.go.set()
    assert _until(lambda: len(gate.closed) == 1) and lease.released  # the loading thread closed its model
    rt.close()
    assert _alive() <= before, "close() left a thread running"


def test_a_closed_runtime_refuses_loads_and_a_load_running_at_close_is_closed(tone_dir):
    before = _alive()
    _GatedTone.gate = gate = _LoadGate()
    rt = Runtime(engines=[_GatedTone], plugins=False, voices=False)
    outcome: list = []

    def load():
        try:
            outcome.append(rt.load(tone_dir))
        except Exception as e:  # handed to the test
            outcome.append(e)
    loader = threading.Thread(target=load)
    loader.start()
    assert gate.entered.wait(10)
    closer = threading.Thread(target=rt.close)
    closer.start()
    assert _until(lambda: rt.closed)
    gate.go.set()  # the load ends after close() began: its model must not join the closed runtime
    closer.join(20)
    loader.join(20)
    assert not closer.is_alive() and not loader.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ModelLoadError) and "closed" in str(outcome[0])
    assert len(gate.closed) == 1 and rt.models() == []
    with pytest.raises(ModelLoadError, match="runtime was closed"):
        rt.load(tone_dir)
    assert _alive() <= before, "close() left a thread running"


def test_listing_and_planning_every_model_while_one_is_unloaded(tone_dir, tmp_path):
    """plan() of every model and models() copy the loaded set under the lock: an unload in between is
    the set as it was when called, never an error from the set changing under it."""
    other = write_model(tmp_path / "other")
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as rt:
        first, second = rt.load(tone_dir), rt.load(other)
        original = rt.memory.plan_for
        unloaded = []

        def plan_for(loaded, request, stream=False):  # the unload lands between two models' plans
            if not unloaded:
                rt.unload(second if loaded.name == first else first)
                unloaded.append(True)
            return original(loaded, request, stream)
        rt.memory.plan_for = plan_for
        plans = rt.plan()
        assert len(plans) == 2 and all(p.peak > 0 for p in plans.values())
        assert len(rt.models()) == 1


def test_requests_waiting_for_memory_keep_their_arrival_order(tone_dir, tmp_path):
    """A request waiting for room that other models' requests hold keeps its place in its model's line: a later
    request on the same model that would fit at once waits behind it (it used to re-queue at the back)."""
    from mizuoto.runtime.engine import SynthesisRequest

    long_request = SynthesisRequest("ab" * 300, voice="low")
    wide = write_model(tmp_path / "wide", hidden=1024)  # a long text's notes outweigh the planned listen stage
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as probe:
        name = probe.load(wide)
        small = probe.memory.plan_for(probe._get(name), SynthesisRequest("ab", voice="low")).peak
        long_peak = probe.memory.plan_for(probe._get(name), long_request).peak
        other = write_model(tmp_path / "other")
        beside = probe.memory.plan_for(probe._get(probe.load(other)), SynthesisRequest("ab", voice="low")).peak
    assert long_peak > small
    # both models fit with short requests; x's long one only once y's is gone
    with Runtime(ram=long_peak + beside - 1, engines=[ToneEngine], plugins=False, voices=False) as rt:
        x = rt.load(wide, name="x")
        list(rt.synthesize(x, "ab", voice="low"))
        y = rt.load(other, name="y")
        list(rt.synthesize(y, "ab", voice="low"))
        held = Lease()  # a request admitted to y holds its room: x's long request waits for it
        assert rt.pin(y, held) and {m.name for m in rt.models()} == {"x", "y"}
        order: list = []
        first = threading.Thread(target=lambda: order.append(("long", len(list(rt.synthesize(x, long_request))))))
        first.start()
        assert _until(lambda: bool(rt.memory._room_waits))
        second = threading.Thread(target=lambda: order.append(("short", len(list(rt.synthesize(x, "ab", voice="low"))))))
        second.start()
        line = rt._get(x).scheduler
        assert _until(lambda: line.waiting == 2 or bool(order))
        assert order == [] and line.running == 0  # the short one waits behind the long one's place
        held.release()
        first.join(30)
        second.join(30)
        assert [kind for kind, _ in order] == ["long", "short"]
        assert line.waiting == 0 and line.running == 0 and line.requests() == []
        assert [r.reason for r in line.requests(finished=True)][-2:] == ["done", "done"]


class _SubmittingTone(ToneEngine):
    """A tone model that runs two requests at once and submits each render to its compute thread, its room
    reserved in the request's thread first (as a batched engine does); renders wait at the class's gate."""

    entered, go = threading.Event(), threading.Event()

    def load(self, model_dir, options):
        model = super().load(model_dir, options)
        model.batch_width = 2
        render, gate = model._render, type(self)

        def gated(*args):
            gate.entered.set()
            assert gate.go.wait(20), "the test never opened the gate"
            return render(*args)

        def submitted(notes, f0, speed, phase):
            with model.room("render", notes=len(notes), samples=int(0.05 * model.rate / speed)):
                return model.submit(lambda: gated(notes, f0, speed, phase), kind="render")
        model._render = submitted
        return model


def test_a_cancelled_requests_call_reservation_stays_until_the_call_ends(tone_dir):
    """A call's memory reserved in the request's thread (Model.room) is released when the call has ended on the
    compute loop, not when the request's thread stops waiting for it (it was released at once)."""
    with Runtime(engines=[_SubmittingTone], plugins=False, voices=False) as rt:
        _SubmittingTone.entered, _SubmittingTone.go = threading.Event(), threading.Event()
        name = rt.load(tone_dir)
        gate = _SubmittingTone
        lease = Lease()
        try:
            error, took = cancel_during(lambda: list(rt.synthesize(name, "abc", voice="low", lease=lease)), lease,
                                        gate.entered.is_set, settle=0.0)
            assert isinstance(error, RequestCancelled) and took < 1.0
            assert "render" in rt.memory._calls.get(lease, {}), "the running call's reservation was released"
            assert rt.pins(name) == 1
        finally:
            gate.go.set()
        assert _until(lambda: lease not in rt.memory._calls and rt.pins(name) == 0 and lease.released)
