"""ServerState's loads: an admin load holds the load lock only to claim its name, so requests for other models
(and their loads) are not held up behind it, and a request for the model being loaded waits with its lease."""

import json
import threading
import time

from mizuoto.errors import RequestCancelled
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.lease import Lease
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.testing.toy import CONFIG, ToneEngine, write_model
from mizuoto.testing.waits import cancel_during


class _SlowLoad(ToneEngine):
    """The tone engine whose load of a directory named 'slow' waits for the class's gate."""

    entered, go = threading.Event(), threading.Event()

    def load(self, model_dir, options):
        if model_dir.name == "slow":
            type(self).entered.set()
            assert type(self).go.wait(20), "the test never opened the gate"
        return super().load(model_dir, options)


def test_an_admin_load_does_not_hold_up_other_models_and_a_request_for_it_waits_with_its_lease(tmp_path):
    fast, slow = write_model(tmp_path / "fast"), write_model(tmp_path / "slow")
    _SlowLoad.entered, _SlowLoad.go = threading.Event(), threading.Event()
    with Runtime(engines=[_SlowLoad], plugins=False, voices=False) as rt:
        state = ServerState(rt, ServerConfig(load_options={"device": "cpu"}), {"fast": fast})
        admin = threading.Thread(target=lambda: state.load("slow", slow))
        admin.start()
        try:
            assert _SlowLoad.entered.wait(10)
            started = time.monotonic()
            state.ensure_loaded("fast", Lease(30))  # another model loads meanwhile
            assert time.monotonic() - started < 5.0 and "fast" in state.loaded()
            waiting = Lease()
            error, took = cancel_during(lambda: state.ensure_loaded("slow", waiting), waiting, settle=0.1)
            assert isinstance(error, RequestCancelled) and "loads for another request" in str(error) and took < 1.0
        finally:
            _SlowLoad.go.set()
            admin.join(20)
        assert not admin.is_alive() and set(state.loaded()) == {"fast", "slow"}
        assert json.loads((slow / CONFIG).read_text())["engine"] == "tone"


def test_listing_models_while_one_is_evicted_shows_it_unloaded_instead_of_failing(tmp_path):
    """GET /v1/models' body from one listing: a model that goes between the listing and its details is shown as
    not loaded (it answered 400 when the details of a model gone were asked for)."""
    from mizuoto.server.app import model_list

    a, b = write_model(tmp_path / "a"), write_model(tmp_path / "b")
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as rt:
        state = ServerState(rt, ServerConfig(load_options={"device": "cpu"}), {"a": a, "b": b})
        state.ensure_loaded("a")
        state.ensure_loaded("b")
        original = rt.voices

        def voices(name):  # the eviction lands between the listing and a model's details
            if name == "a" and "a" in state.loaded():
                rt.unload("a")
            return original(name)
        rt.voices = voices
        listed = {m["id"]: m["loaded"] for m in model_list(state, admin=False)["data"]}
        assert listed == {"a": False, "b": True}


def test_a_sessions_load_takes_a_slot_and_its_lease_and_a_loaded_model_takes_neither(tmp_path):
    """WebSocket, Wyoming and Ray load a model before a session's first request: under a job slot (503 when none is
    free, queued as a job) and the session's lease (its cancel ends the wait); the slot and the pin go with the load,
    the lease lives on for the session's job; a model loaded already takes neither."""
    from mizuoto.server.errors import ApiError

    a = write_model(tmp_path / "a")
    with Runtime(engines=[ToneEngine], plugins=False, voices=False) as rt:
        state = ServerState(rt, ServerConfig(load_options={"device": "cpu"}, max_concurrent=1, max_queued=1), {"a": a})
        assert state.limiter.try_acquire()  # a running job holds the only slot
        waiting = Lease()
        error, took = cancel_during(lambda: state.load_for_session("a", waiting), waiting,
                                    lambda: state.limiter.queued == 1, settle=0.1)
        assert isinstance(error, RequestCancelled) and "slot" in str(error) and took < 1.0
        # the load's slot and place in the queue went back; the session's lease is its job's next, not released here
        assert state.loaded() == [] and state.limiter.queued == 0 and state.limiter.active == 1
        assert not waiting.released
        assert state.limiter.enter() is not None  # the queue's one place is taken now ...
        try:
            state.load_for_session("a", Lease())
        except ApiError as e:  # ... so a session's load is refused as a request would be
            assert e.status == 503
        else:
            raise AssertionError("a session's load went past a full server")
        state.limiter.release()  # the running job ends: the queued ticket gets the slot, then leaves too
        state.limiter.release()
        state.load_for_session("a", Lease(30))
        assert state.loaded() == ["a"] and rt.pins("a") == 0 and state.limiter.active == 0
        state.limiter.try_acquire()
        state.load_for_session("a", Lease(30))  # loaded already: no slot needed
        state.limiter.release()
