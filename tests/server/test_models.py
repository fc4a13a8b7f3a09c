"""Model management over HTTP: load/unload, and a memory budget that forces eviction (and reload on use)."""

import httpx
import numpy as np
import pytest

from mizuoto.server.state import ServerConfig


@pytest.fixture
def budget_server(tmp_path, h):
    """Two tone models in the catalogue (root tmp_path) and a host budget that holds only one of them."""
    a, b = h.write_model(tmp_path / "a"), h.write_model(tmp_path / "b", hidden=32)
    with h.make_runtime() as rt:
        peak = max(rt.plan(rt.load(d, device="cpu")).peak for d in (a, b))
    config = ServerConfig(load_options={"device": "cpu"}, model_roots=(tmp_path,))
    s = h.start_server({"a": a}, config, ram=int(peak * 1.5))
    with httpx.Client(base_url=s.url, timeout=30, headers=h.admin) as c:
        yield c, b
    s.stop()


def _loaded(c):
    return {m["id"]: m["loaded"] for m in c.get("/v1/models").json()["data"]}


def test_eviction_and_reload(budget_server, h):
    """Loading b evicts a (reported), a still answers by loading again (evicting b), and audio stays right."""
    c, b_dir = budget_server
    assert _loaded(c) == {"a": True}
    r = c.post("/v1/models/load", json={"model": "b", "path": str(b_dir)})
    assert r.status_code == 200, r.text
    assert r.json()["evicted"] == ["a"] and r.json()["loaded"] is True
    assert _loaded(c) == {"a": False, "b": True}
    r = c.post("/v1/audio/speech", json={"model": "a", "input": "abc", "voice": "low"})
    assert r.status_code == 200, r.text
    audio, rate = h.read_audio(r.content)
    assert len(audio) / rate == pytest.approx(h.tone_seconds("abc"))
    assert _loaded(c) == {"a": True, "b": False}
    planned = h.planned_memory(c)
    assert len(planned) == 1 and all(v > 0 for v in planned.values())


def test_unload_and_load_by_name(budget_server):
    """Unload frees the model; load by name brings it back from the catalogue; errors are 4xx naming the model."""
    c, _ = budget_server
    assert c.post("/v1/models/unload", json={"model": "a"}).status_code == 200
    assert _loaded(c) == {"a": False}
    assert c.get("/ready").status_code == 503
    r = c.post("/v1/models/unload", json={"model": "a"})
    assert r.status_code == 409 and r.json()["error"]["param"] == "model"
    assert c.post("/v1/models/load", json={"model": "a"}).status_code == 200
    assert c.get("/ready").status_code == 200
    assert c.post("/v1/models/load", json={"model": "a"}).status_code == 409
    assert c.post("/v1/models/unload", json={"model": "zzz"}).status_code == 404
    assert c.post("/v1/models/load", json={"model": "zzz"}).status_code == 404


def test_load_outside_roots_refused(budget_server, tmp_path_factory, h):
    """Only catalogue directories and those under --model-root may be loaded over HTTP."""
    c, _ = budget_server
    elsewhere = h.write_model(tmp_path_factory.mktemp("elsewhere") / "m")
    r = c.post("/v1/models/load", json={"model": "m", "path": str(elsewhere)})
    assert r.status_code == 403 and r.json()["error"]["param"] == "path"
    r = c.post("/v1/models/load", json={"model": "m", "path": "/definitely/not/here"})
    assert r.status_code == 403


def test_load_name_with_newline_refused(budget_server):
    """A name with a trailing newline is a 400: loaded, it went into a response header and dropped the connection."""
    c, b_dir = budget_server
    r = c.post("/v1/models/load", json={"model": "b\n", "path": str(b_dir)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert _loaded(c) == {"a": True}


def test_model_too_big_for_budget(tmp_path, h):
    """A model that cannot fit the budget is refused with 507 and a plan explanation; the server keeps serving."""
    a = h.write_model(tmp_path / "a")
    s = h.start_server({}, ServerConfig(load_options={"device": "cpu"}, model_roots=(tmp_path,)), ram=1024)
    try:
        with httpx.Client(base_url=s.url, timeout=30, headers=h.admin) as c:
            r = c.post("/v1/models/load", json={"model": "a", "path": str(a)})
            assert r.status_code == 507 and "does not fit" in r.json()["error"]["message"]
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_real_engines_evict_each_other(served_dirs, client, h, cosy_expected):
    """Piper and a fixture CosyVoice 2 under a host budget of the bigger one's plan: they cannot share it.

    Admitting the bigger model at its any-request plan fills the budget, so whatever else is loaded
    is evicted, whatever the models' sizes. Each request loads its model and speaks right after the
    reload (CosyVoice byte for byte); the load endpoint reports whom it evicted; unload empties.
    """
    peaks = {name: value for labels, value in h.planned_memory(client).items()  # from the shared server
             for name in ("piper", "cosy") if f'model="{name}"' in labels}
    small, big = sorted(peaks, key=peaks.get)
    text, seed = "Evicted and back again.", 2
    bodies = {"piper": {"model": "piper", "input": text},
              "cosy": {"model": "cosy", "input": text, "seed": seed, "ref_audio": h.clip_base64(),
                       "ref_text": h.ref_text}}

    def speak(c, model):
        r = c.post("/v1/audio/speech", json=bodies[model])
        assert r.status_code == 200, r.text
        if model == "cosy":
            assert r.content[44:] == cosy_expected(text, seed)
        else:
            audio, rate = h.read_audio(r.content)
            assert np.sqrt(np.mean(audio ** 2)) > 0.01 and len(text) / 25 < len(audio) / rate < len(text) / 6

    s = h.start_server({small: served_dirs[small], big: served_dirs[big]}, ServerConfig(load_options={"device": "cpu"}),
                       ram=peaks[big])
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=h.admin) as c:
            assert _loaded(c) == {small: False, big: True}  # loading big at startup evicted small
            speak(c, small)
            assert _loaded(c) == {small: True, big: False}
            assert list(h.planned_memory(c)) == [f'mizuoto_memory_planned_bytes{{device="cpu",model="{small}"}}']
            r = c.post("/v1/models/load", json={"model": big})
            assert r.status_code == 200 and r.json()["evicted"] == [small], r.text
            speak(c, big)
            assert _loaded(c) == {small: False, big: True}
            assert c.post("/v1/models/unload", json={"model": big}).status_code == 200
            assert _loaded(c) == {small: False, big: False} and c.get("/ready").status_code == 503
    finally:
        s.stop()


def test_model_paths_are_for_the_admin_only(budget_server):
    """GET /v1/models names where each model lies on the server only to a client with the admin key."""
    c, _ = budget_server
    assert all(m["path"] for m in c.get("/v1/models").json()["data"])  # this client has the admin key
    anonymous = c.get("/v1/models", headers={"Authorization": ""}).json()["data"]
    assert anonymous and all("path" not in m for m in anonymous)
    wrong = c.get("/v1/models", headers={"Authorization": "Bearer not-the-key"}).json()["data"]
    assert all("path" not in m for m in wrong)


def test_unloading_a_model_that_runs_a_request_is_a_409_and_the_request_completes(tmp_path, h):
    """The runtime's ModelBusy is the documented 409 naming `model`; the running request is not disturbed."""
    slow = h.write_slow_model(tmp_path / "slow", delay=0.5)  # each chunk of audio takes half a second
    text = "a long enough text, spoken slowly"
    s = h.start_server({"slow": slow})
    try:
        with httpx.Client(base_url=s.url, timeout=30, headers=h.admin) as c:
            body = {"model": "slow", "input": text, "voice": "low", "stream_format": "audio", "response_format": "pcm"}
            with c.stream("POST", "/v1/audio/speech", json=body) as speaking:
                pieces = speaking.iter_bytes()
                audio = next(pieces)  # the request is under way: its model is pinned until it ends
                r = c.post("/v1/models/unload", json={"model": "slow"})
                audio += b"".join(pieces)
                rate = int(speaking.headers["x-sample-rate"])
            assert r.status_code == 409 and r.json()["error"]["param"] == "model", r.text
            assert "is running a request" in r.json()["error"]["message"]
            assert speaking.status_code == 200 and len(audio) / 2 / rate == pytest.approx(h.tone_seconds(text))
            assert c.post("/v1/models/unload", json={"model": "slow"}).status_code == 200
    finally:
        s.stop()
