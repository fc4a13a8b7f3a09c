"""Runtime API on the tone engine: loading, detection errors, requests, voices, memory admission."""

import contextlib
import threading
import time
from dataclasses import replace

import pytest
import torch

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Capabilities, Reference, SynthesisRequest
from mizuoto.errors import AudioError, InvalidRequest, MemoryBudgetError, ModelLoadError
from mizuoto.runtime.memory import plan_model
from mizuoto.testing.toy import CHUNK_NOTES, NOTE_SECONDS, ToneEngine, ToneModel, write_model
from mizuoto.testing.waits import held_elsewhere


def _audio(chunks):
    chunks = list(chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    return torch.cat([c.samples for c in chunks])


@pytest.fixture
def rt():
    with Runtime(engines=[ToneEngine], plugins=False) as runtime:
        yield runtime


def test_load_list_and_synthesize_every_mode(rt, tone_dir):
    name = rt.load(tone_dir)
    assert name == "tone" and rt.load(tone_dir) == "tone-2"
    info = rt.info(name)
    assert (info.engine, info.device, info.state, info.strategy) == ("tone", "cpu", "device", "resident")
    assert [m.name for m in rt.models()] == ["tone", "tone-2"] and list(rt.plan()) == ["tone", "tone-2"]
    assert [v.id for v in rt.voices(name)] == ["low", "high"]
    ref = (torch.sin(torch.arange(16000) * 2 * torch.pi * 200 / 16000), 16000)
    for fields in (dict(voice="low"), dict(voice=Reference(ref, "hello")), dict(voice=Reference(ref)),
                   dict(voice="high", instruct="speak low")):
        audio = _audio(rt.synthesize(name, "hello world", seed=3, **fields))
        assert audio.numel() == 10 * 960 and audio.abs().max() < 1
    vc = _audio(rt.synthesize(name, voice="low", source_audio=ref))
    assert vc.numel() == round(1 / 0.06) * 960
    rt.unload("tone-2")
    assert [m.name for m in rt.models()] == ["tone"]


def test_seed_determinism_and_streaming(rt, tone_dir):
    name = rt.load(tone_dir)
    a = _audio(rt.synthesize(name, "deterministic", voice="low", seed=7))
    b = _audio(rt.synthesize(name, "deterministic", voice="low", seed=7))
    c = _audio(rt.synthesize(name, "deterministic", voice="low", seed=8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    chunks = list(rt.synthesize(name, "deterministic", voice="low", seed=7, stream=True))
    assert len(chunks) == 4  # 13 notes, 4 per chunk
    assert torch.allclose(_audio(chunks), a, atol=1e-5)
    streamed_in = _audio(rt.synthesize(name, iter(["determ", "inistic"]), voice="low", seed=7, stream=True))
    assert torch.allclose(streamed_in, a, atol=1e-5)


def test_voice_cache(rt, tone_dir):
    name = rt.load(tone_dir)
    ref = (torch.sin(torch.arange(8000) * 2 * torch.pi * 300 / 16000), 16000)
    voice = rt.add_voice(name, "mine", ref, "some text")
    assert (voice.id, voice.kind) == ("mine", "cached")
    assert [v.id for v in rt.voices(name)][-1] == "mine"
    cached = _audio(rt.synthesize(name, "abc", voice="mine", seed=1))
    direct = _audio(rt.synthesize(name, "abc", voice=Reference(ref, "some text"), seed=1))
    assert torch.equal(cached, direct)
    with pytest.raises(InvalidRequest, match="voice id"):
        rt.add_voice(name, "", ref)


def test_load_errors(rt, tone_dir, tmp_path):
    with pytest.raises(InvalidRequest, match="not a memory size: 'lots'"):
        Runtime(vram="lots")
    with pytest.raises(ModelLoadError, match="model directory not found: .*nowhere"):
        rt.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no engine recognises .*empty \(checked: tone: no\)"):
        rt.load(tmp_path / "empty")
    with pytest.raises(InvalidRequest, match="unknown engine 'cosy'; registered engines: tone"):
        rt.load(tone_dir, engine="cosy")
    with pytest.raises(ModelLoadError, match="engine 'tone' does not recognise"):
        rt.load(tmp_path / "empty", engine="tone")
    with pytest.raises(InvalidRequest, match="unknown option 'colour'"):
        rt.load(tone_dir, colour="red")
    (tone_dir / "tone.pt").write_bytes(b"corrupt")
    with pytest.raises(ModelLoadError, match="cannot load tone model"):
        rt.load(tone_dir)
    assert rt.models() == []


class _Echo(ToneEngine):
    name = "echo"


class _Crashing(ToneEngine):
    name = "crash"

    def detect(self, model_dir):
        raise OSError("detect bug")


class _Buggy(ToneEngine):
    name = "buggy"

    def load(self, model_dir, options):
        raise KeyError("weights")


def test_ambiguous_and_buggy_engines(tone_dir):
    with Runtime(engines=[ToneEngine, _Echo, _Crashing], plugins=False) as rt:
        with pytest.raises(ModelLoadError, match=r"recognised by several engines \(echo, tone\); choose one"):
            rt.load(tone_dir)
        assert rt.load(tone_dir, engine="echo") == "tone"
        assert rt.info("tone").engine == "echo"
        assert "crash (detect raised OSError: detect bug)" in rt.registry.detect_report(tone_dir)[1]
    with Runtime(engines=[_Buggy], plugins=False) as rt:
        with pytest.raises(ModelLoadError, match="engine 'buggy' failed to load .*: KeyError: 'weights'"):
            rt.load(tone_dir)


class _PresetOnly(ToneModel):
    @property
    def capabilities(self):
        return Capabilities(modes={"preset"}, sample_rate=self.rate)


class _PresetOnlyEngine(ToneEngine):
    name = "preset-only"

    def load(self, model_dir, options):
        model = super().load(model_dir, options)
        model.__class__ = _PresetOnly
        return model


def test_request_errors(rt, tone_dir):
    name = rt.load(tone_dir)
    with pytest.raises(InvalidRequest, match="text is empty"):
        rt.synthesize(name, "", voice="low")
    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'; this model has: high, low"):
        rt.synthesize(name, "hi", voice="nobody")
    with pytest.raises(InvalidRequest, match="no model 'other' is loaded; loaded: tone"):
        rt.synthesize("other", "hi", voice="low")
    with pytest.raises(InvalidRequest, match="bad request field"):
        rt.synthesize(name, "hi", voice="low", volume=11)
    with pytest.raises(InvalidRequest, match="either a SynthesisRequest or fields"):
        rt.synthesize(name, SynthesisRequest("hi", voice="low"), seed=1)
    with pytest.raises(AudioError, match="audio file not found"):
        rt.synthesize(name, "hi", voice=Reference("missing.wav", "x"))
    with Runtime(engines=[_PresetOnlyEngine], plugins=False) as other:
        m = other.load(tone_dir)
        with pytest.raises(InvalidRequest, match="does not support mode 'instruct'; it supports: preset"):
            other.synthesize(m, "hi", voice="low", instruct="sing")
        with pytest.raises(InvalidRequest, match="cannot stream audio out"):
            other.synthesize(m, "hi", voice="low", stream=True)
        with pytest.raises(InvalidRequest, match="cannot cache voices"):
            other.add_voice(m, "x", (torch.zeros(10), 16000))


def _peaks(tone_dir):
    with Runtime(engines=[ToneEngine], plugins=False) as rt:
        name = rt.load(tone_dir)
        return rt.plan(name).peak, rt.plan(name, stream=True).peak


def _call_peak(rt, name, request, stage, **sizes):
    """The peak of `request`'s plan while one `stage` call on inputs of these sizes runs (as Model.room makes it)."""
    plan = rt.memory.plan_for(rt._get(name), request)
    working = rt.model(name).stage(stage).call_working(**sizes)
    stages = [replace(s, working=working) if s.name == stage else s for s in plan.stages]
    return plan_model(name, stages, plan.budget, plan.device, plan.stream).peak


def test_memory_admission_on_cpu(tone_dir, tmp_path):
    peak, stream_peak = _peaks(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=peak - 1, engines=[ToneEngine], plugins=False) as rt:
        assert rt.plan(rt.load(tone_dir)).strategy == "turns"
    with Runtime(ram=1024, engines=[ToneEngine], plugins=False) as rt:
        with pytest.raises(MemoryBudgetError, match="does not fit 1.00 KiB on cpu: listen"):
            rt.load(tone_dir)
        assert rt.models() == []
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False) as rt:
        first = rt.load(tone_dir)
        second = rt.load(other)
        assert [m.name for m in rt.models()] == [second]  # on the CPU, eviction unloads
        with pytest.raises(InvalidRequest, match=f"model {first} was unloaded: evicted to make room for {second}"):
            rt.synthesize(first, "hi", voice="low")
        _audio(rt.synthesize(second, "hi", voice="low"))


def test_one_request_at_a_time_per_model(rt, tone_dir):
    name = rt.load(tone_dir)
    first = rt.synthesize(name, "a long enough text", voice="low", seed=1, stream=True)
    next(first)
    second = rt.synthesize(name, "hi", voice="low", seed=1)
    with pytest.raises(InvalidRequest, match="still open in this thread"):
        next(second)
    with pytest.raises(InvalidRequest, match="running a request"):
        rt.unload(name)
    done = threading.Event()
    results = {}

    def other_thread():
        results["audio"] = _audio(rt.synthesize(name, "hi", voice="low", seed=1))
        done.set()

    t = threading.Thread(target=other_thread)
    t.start()
    assert not done.wait(0.3)  # waits for the open stream
    first.close()
    t.join(10)
    assert done.is_set()
    assert torch.equal(results["audio"], _audio(rt.synthesize(name, "hi", voice="low", seed=1)))


def test_concurrent_requests_match_sequential(rt, tone_dir):
    name = rt.load(tone_dir)
    texts = [f"request number {i}" for i in range(6)]
    want = [_audio(rt.synthesize(name, t, voice="high", seed=i, stream=i % 2 == 0)) for i, t in enumerate(texts)]
    got = [None] * len(texts)

    def work(i):
        got[i] = _audio(rt.synthesize(name, texts[i], voice="high", seed=i, stream=i % 2 == 0))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_rehearse_plans_for_another_device_and_moves_nothing(rt, tone_dir):
    rt.load(tone_dir, device="cpu")
    rt.load(tone_dir, device="cpu")
    before = [(m.name, m.device, m.state) for m in rt.models()]
    r = rt.rehearse("cuda", vram="3MiB", ram="1GiB")  # no GPU needed: a vram budget is given
    assert (r.device, r.budget, r.active, r.offloaded) == ("cuda", 3 << 20, ("tone-2",), ("tone",))
    assert [a.model for a in r.admissions] == ["tone", "tone-2"] and r.admissions[0].evictions == ()
    assert [(e.model, e.action) for e in r.admissions[1].evictions] == [("tone", "offload")]
    first, second = (a.plan for a in r.admissions)
    assert first.device == second.device == "cuda"
    assert r.in_use == second.peak + first.fixed  # an offloaded model's fixed modules stay on the device
    assert [(m.name, m.device, m.state) for m in rt.models()] == before
    on_cpu = rt.rehearse("cpu", stream=True, ram="1MiB")
    assert [a.plan for a in on_cpu.admissions] == [None, None] and on_cpu.active == ()
    assert "does not fit 1.00 MiB on cpu" in on_cpu.admissions[0].refused
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="no cuda device on this machine"):
            rt.rehearse("cuda")


# the same KV rows; the slow one's render calls (a note at least) make its admitted peak larger
_LONG = dict(text="a" * 200, speed=0.25)
_SHORT = dict(text="a" * 200, speed=1.0)


@pytest.mark.parametrize("first, second", [(_LONG, _LONG), (_LONG, _SHORT), (_SHORT, _LONG)],
                         ids=["long+long", "long+short", "short+long"])
def test_a_batched_model_admits_a_joining_request_only_while_its_working_memory_fits(tmp_path, first, second):
    """Two streams at once on a model of batch width 2: both run when each one's peak fits beside the
    other's sequence-stage memory, the second waits for the first when either does not (a short
    joiner beside a long stream included: checking the joiner alone let it in)."""
    import threading

    from mizuoto.runtime.engine import SynthesisRequest

    tone_dir = write_model(tmp_path / "wide", hidden=8192)  # its notes, not its listening, make the peak

    requests = [SynthesisRequest(**r, mode="preset", voice="low", seed=0, stream=True) for r in (first, second)]
    with Runtime(engines=[ToneEngine], plugins=False) as rt:
        name = rt.load(tone_dir)
        peaks = [rt.memory.plan_for(rt._get(name), r).peak for r in requests]
        rows = [rt.model(name).stage("notes").working_memory(r) for r in requests]
        together = max(peaks[0] + rows[1], peaks[1] + rows[0])
        assert max(rt.plan(name).peak, rt.plan(name, stream=True).peak, *peaks) <= together - 1
        if (first, second) == (_LONG, _SHORT):  # the joiner alone fits beside the running one: not enough
            assert peaks[1] + rows[0] <= together - 1
        # a render call (a chunk of notes) reserves more than the one note each was admitted with
        calls = [_call_peak(rt, name, r, "render", notes=CHUNK_NOTES, samples=int(NOTE_SECONDS * 16000 / r.speed))
                 for r in requests]
        growth = max(c - p for c, p in zip(calls, peaks))
        assert 0 < growth < min(rows)
    for budget, joins in ((together + growth, True), (together - 1, False)):
        with Runtime(ram=budget, engines=[ToneEngine], plugins=False) as rt:
            name = rt.load(tone_dir)
            rt.model(name).batch_width = 2
            running = rt.synthesize(name, requests[0])
            next(running)  # holds the model
            got = threading.Event()

            def join():
                for _ in rt.synthesize(name, requests[1]):
                    got.set()

            t = threading.Thread(target=join)
            t.start()
            assert got.wait(0.5 if not joins else 10) is joins, f"budget {budget}"
            assert rt.info(name).running == (2 if joins else 1)
            list(running)
            t.join(10)
            assert got.is_set() and rt.info(name).running == 0


def test_listing_models_while_another_thread_unloads_one(rt, tone_dir, monkeypatch):
    """models() describes the models loaded when it was called, even if one goes while it runs."""
    first, second = rt.load(tone_dir), rt.load(tone_dir)
    pool = rt.memory.pool(rt.info(first).device)
    inside, unloaded = threading.Event(), threading.Event()
    state = pool.state

    def slow_state(name):  # the listing is between its first and its second model
        if name == first and not inside.is_set():
            inside.set()
            assert unloaded.wait(10)
        return state(name)
    monkeypatch.setattr(pool, "state", slow_state)
    unloader = threading.Thread(target=lambda: (inside.wait(10), rt.unload(second), unloaded.set()))
    unloader.start()
    listed = [m.name for m in rt.models()]
    unloader.join(10)
    assert listed == [first, second] and [m.name for m in rt.models()] == [first]


# ---- leases: the request context the runtime pins models for -------------------------------------

def test_a_pinned_model_is_never_evicted_and_a_waiting_load_goes_when_the_lease_is_released(tone_dir, tmp_path):
    from mizuoto.runtime.lease import Lease

    peak, _ = _peaks(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False) as rt:
        first = rt.load(tone_dir)
        lease = Lease()
        assert rt.pin(first, lease) and rt.pins(first) == 1 and not rt.pin("nothing", Lease())
        with pytest.raises(MemoryBudgetError, match=f"held by {first}"):
            rt.load(other)  # no wait given: refused at once, and the pinned model stays
        assert [m.name for m in rt.models()] == [first]
        loaded: list = []
        loader = threading.Thread(target=lambda: loaded.append(rt.load(other, wait=30)))
        loader.start()
        time.sleep(0.3)
        assert loader.is_alive() and [m.name for m in rt.models()][0] == first  # it waits for the lease
        _audio(rt.synthesize(first, "hi", voice="low", lease=lease))  # the pinned model serves its request
        loader.join(10)  # the request's end released the lease: the load evicted the first model
        assert not loader.is_alive() and [m.name for m in rt.models()] == loaded and rt.pins(first) == 0


def test_a_load_with_a_lease_is_pinned_as_it_is_admitted_and_its_cancel_ends_a_wait_for_room(tone_dir, tmp_path):
    from mizuoto.errors import RequestCancelled
    from mizuoto.runtime.lease import Lease
    from mizuoto.testing.waits import cancel_during

    peak, _ = _peaks(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False) as rt:
        mine = Lease()
        first = rt.load(tone_dir, lease=mine)
        assert rt.pins(first) == 1 and mine.model == first
        waiting = Lease()
        error, took = cancel_during(lambda: rt.load(other, wait=30, lease=waiting), waiting, settle=0.3)
        assert isinstance(error, RequestCancelled) and "waiting for memory held by other models" in str(error)
        assert took < 1.0
        assert [m.name for m in rt.models()] == [first]  # never evicted, and the cancelled load left nothing
        mine.release()
        assert rt.pins(first) == 0


def test_a_deadline_ends_a_wait_for_the_models_turn(rt, tone_dir):
    from mizuoto.errors import DeadlineExceeded
    from mizuoto.runtime.lease import Lease

    name = rt.load(tone_dir)

    def long_one():  # a streamed request that has begun speaking holds the model's turn until it is closed
        chunks = rt.synthesize(name, "a long enough text", voice="low", seed=1, stream=True)
        next(chunks)
        return contextlib.closing(chunks)
    with held_elsewhere(long_one):
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="waiting for its turn"):
            next(rt.synthesize(name, "hi", voice="low", lease=Lease(0.3)))
        assert time.monotonic() - start < 1.3
    assert rt.pins(name) == 0


def test_close_cancels_open_requests_and_joins_every_thread_it_started(tone_dir):
    from mizuoto.errors import RequestCancelled

    before = {t.ident for t in threading.enumerate()}
    rt = Runtime(engines=[ToneEngine], plugins=False)
    name = rt.load(tone_dir)
    _audio(rt.synthesize(name, "hi", voice="low"))
    stream = rt.synthesize(name, "a long enough text", voice="low", seed=1, stream=True)
    next(stream)
    assert any(t.name == f"mizuoto-{name}-compute" for t in threading.enumerate())
    rt.close()
    with pytest.raises(RequestCancelled):
        next(stream)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before, "close() left a thread running"


def test_a_model_still_loading_cannot_be_pinned(tone_dir, tmp_path):
    """A load waiting for room may still fail (its lease cancelled): a request must not pin it meanwhile,
    or the failed load would take the pinned model away under that request."""
    from mizuoto.runtime.lease import Lease
    from mizuoto.testing.waits import cancel_during

    peak, _ = _peaks(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False) as rt:
        first = rt.load(tone_dir, lease=Lease())  # pinned for good: the second load waits for room
        loading, pinned = Lease(), []

        def load():
            rt.load(other, name="other", wait=30, lease=loading)

        def waiting() -> bool:
            if "other" in [m.name for m in rt.models()]:
                pinned.append(rt.pin("other", Lease()))
                with pytest.raises(InvalidRequest, match="still loading"):  # nor may a request use it
                    next(rt.synthesize("other", "abc", voice="low"))
                return True
            return False
        cancel_during(load, loading, waiting)
        assert pinned == [False] and [m.name for m in rt.models()] == [first]


def test_one_lock_decides_pins_admission_and_each_models_turns(rt, tone_dir):
    """The lease authority: a model's holders, line and batch budget wait on the Runtime's own condition."""
    name = rt.load(tone_dir)
    assert rt._get(name).scheduler._cond is rt._changed


def _short_and_long(tone_dir):
    """The tone model's peak, a short request's plan peak, and a long request's peak during its render call."""
    peak, _ = _peaks(tone_dir)
    with Runtime(engines=[ToneEngine], plugins=False) as probe:
        name = probe.load(tone_dir)
        small = probe.memory.plan_for(probe._get(name), SynthesisRequest("ab", voice="low")).peak
        long_need = _call_peak(probe, name, SynthesisRequest("ab" * 300, voice="low", speed=0.25), "render",
                               notes=600, samples=int(NOTE_SECONDS * 16000 / 0.25))
    return peak, small, long_need


def test_two_requests_each_waiting_for_the_others_room_do_not_deadlock(tone_dir, tmp_path):
    """Request A holds model X and waits for room held by Y; B holds Y and would wait for X's room: each would
    wait for the other for good (no deadline). B gives way at once with a MemoryBudgetError, and A then runs."""
    peak, small, long_need = _short_and_long(tone_dir)
    assert long_need > peak >= small
    other = write_model(tmp_path / "other")
    # both models fit beside each other's short request, a long one only alone
    with Runtime(ram=long_need + small // 2, engines=[ToneEngine], plugins=False) as rt:
        x = rt.load(tone_dir, name="x")
        list(rt.synthesize(x, "ab", voice="low"))  # x now holds a short request's room only
        y = rt.load(other, name="y")
        list(rt.synthesize(y, "ab", voice="low"))
        assert {m.name for m in rt.models()} == {"x", "y"}
        from mizuoto.runtime.lease import Lease

        second = Lease(5.0)  # B's request, admitted to y already (as a server's job is before it runs)
        assert rt.pin(y, second)
        first: list = []
        a = threading.Thread(target=lambda: first.append(list(rt.synthesize(x, "ab" * 300, voice="low", speed=0.25))))
        a.start()
        end = time.monotonic() + 10
        while not rt.memory._room_waits and time.monotonic() < end:  # A pins x and waits for y's room
            time.sleep(0.01)
        assert rt.memory._room_waits
        started = time.monotonic()
        with pytest.raises(MemoryBudgetError, match="gives way"):
            list(rt.synthesize(y, "ab" * 300, voice="low", speed=0.25, lease=second))
        assert time.monotonic() - started < 1.0
        a.join(30)
        assert not a.is_alive() and first and first[0], "A did not run once B gave way"


def test_a_wait_for_memory_another_models_lease_holds_looks_again_only_when_memory_is_let_go(
        tone_dir, tmp_path, monkeypatch):
    """A long request on x needs, for its render call, room a lease pinning y holds: it waits on x's own loop (x
    runs one request at a time: its steps run there), tries again only when memory is let go (it looked every
    50 ms before), and the lease's release lets it run."""
    from mizuoto.runtime.lease import Lease

    _, small, long_need = _short_and_long(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=long_need + small // 2, engines=[ToneEngine], plugins=False) as rt:
        x = rt.load(tone_dir, name="x")
        list(rt.synthesize(x, "ab", voice="low"))
        y = rt.load(other, name="y")
        list(rt.synthesize(y, "ab", voice="low"))
        holding = Lease()
        assert rt.pin(y, holding)
        tries, original = [], rt.memory.try_admit

        def counted(loaded, plan, *args, **kwargs):
            if loaded.name == x and kwargs.get("waitable"):
                tries.append(threading.current_thread().name)
            return original(loaded, plan, *args, **kwargs)
        monkeypatch.setattr(rt.memory, "try_admit", counted)
        done: list = []
        a = threading.Thread(target=lambda: done.append(list(rt.synthesize(x, "ab" * 300, voice="low", speed=0.25))))
        a.start()
        end = time.monotonic() + 10
        while not rt.memory._room_waits and time.monotonic() < end:
            time.sleep(0.01)
        waiting = len(tries)
        time.sleep(0.5)
        assert a.is_alive() and not done and len(tries) == waiting, tries  # nothing was let go: no new try
        holding.release()
        a.join(30)
        assert not a.is_alive() and done and done[0]
        assert set(tries) == {"mizuoto-x-compute"}  # on x's loop, not in the request's thread


def test_a_load_failing_after_its_admission_gives_its_room_back(tone_dir, tmp_path, monkeypatch):
    """Admitted, then its modules fail to move: the model goes and so does its room in the pool (a room left
    behind was evicted later under a name no longer loaded: KeyError)."""
    from mizuoto.runtime.scheduler import Scheduler

    peak, _ = _peaks(tone_dir)
    other = write_model(tmp_path / "other")
    sync = Scheduler.sync

    def failing(self, lease=None):
        raise RuntimeError("the modules could not be moved")
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False) as rt:
        monkeypatch.setattr(Scheduler, "sync", failing)
        with pytest.raises(RuntimeError, match="could not be moved"):
            rt.load(tone_dir)
        assert rt.models() == [] and rt.memory.pool("cpu").order() == []
        monkeypatch.setattr(Scheduler, "sync", sync)
        first = rt.load(tone_dir)
        second = rt.load(other)  # evicts the first: the only room held is its
        assert [m.name for m in rt.models()] == [second] and first != second


def test_a_model_still_loading_cannot_be_unloaded(tone_dir, tmp_path):
    """A load waiting for room owns its model until it returns: unload refuses it (it closed the model under the
    load, which then closed it again)."""
    from mizuoto.errors import ModelBusy
    from mizuoto.runtime.lease import Lease
    from mizuoto.testing.waits import cancel_during

    peak, _ = _peaks(tone_dir)
    other = write_model(tmp_path / "other")
    with Runtime(ram=peak + peak // 2, engines=[ToneEngine], plugins=False) as rt:
        first = rt.load(tone_dir, lease=Lease())  # pinned for good: the second load waits for room
        loading, refused = Lease(), []

        def waiting() -> bool:
            if "other" in [m.name for m in rt.models()]:
                with pytest.raises(ModelBusy, match="still loading") as e:
                    rt.unload("other")
                refused.append(e.value)
                return True
            return False
        cancel_during(lambda: rt.load(other, name="other", wait=30, lease=loading), loading, waiting)
        assert refused and [m.name for m in rt.models()] == [first]


def test_two_first_users_of_a_device_share_one_pool(rt, monkeypatch):
    """The pool of a device is made once, under the lock: a second user arriving while the first makes it gets
    the same pool (each made its own, and their admissions went to different pools)."""
    from mizuoto.runtime.admission import MemoryManager

    made, entered, go = MemoryManager._new_pool, threading.Event(), threading.Event()

    def slow(device, vram, ram):
        if not entered.is_set():
            entered.set()
            assert go.wait(10)
        return made(device, vram, ram)
    monkeypatch.setattr(MemoryManager, "_new_pool", staticmethod(slow))
    pools: dict[str, object] = {}
    first = threading.Thread(target=lambda: pools.setdefault("first", rt.memory.pool("cpu")))
    second = threading.Thread(target=lambda: pools.setdefault("second", rt.memory.pool("cpu")))
    first.start()
    assert entered.wait(10)
    second.start()
    second.join(1)  # it waits for the first (it would have made its own by now)
    go.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert pools["first"] is pools["second"] is rt.memory.pool("cpu")
