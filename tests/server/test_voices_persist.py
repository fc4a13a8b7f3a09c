"""Voices cached on a model through POST /v1/audio/voices survive a restart: same audio, no front end run again."""

import base64

import httpx
import pytest

from mizuoto.engines.cosyvoice.frontend import CosyVoiceFrontend
from mizuoto.testing.toy import ToneModel


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private $MIZUOTO_HOME for the servers of one test (read when each Runtime is made): voices in its voices/."""
    monkeypatch.delenv("MIZUOTO_VOICE_STORE", raising=False)
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _count(monkeypatch, cls, name: str) -> list:
    """Count calls of cls.name from now on."""
    calls, original = [], getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def _speak(url: str, model: str, voice: str, h, text: str = "abc d", seed: int = 5) -> bytes:
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": model, "input": text, "voice": voice, "seed": seed,
                                                    "response_format": "pcm"}, timeout=60.0)
    assert r.status_code == 200, r.text
    return r.content


def test_tone_voice_survives_restart(tmp_path, home, monkeypatch, h):
    """Added once with a model, listed and used after a restart with the same home; DELETE removes the files."""
    models = {"tone": h.write_model(tmp_path / "tone"), "slow": h.write_slow_model(tmp_path / "slow", 0.0)}
    s = h.start_server(models)
    try:
        r = httpx.post(f"{s.url}/v1/audio/voices", json={"id": "alice", "model": "tone", "text": "a reference",
                                                         "audio": h.wav_base64(freq=150)}, timeout=30.0)
        assert r.status_code == 201, r.text
        assert r.json()["kind"] == "cached" and r.json()["stored"] is True
        first = _speak(s.url, "tone", "alice", h)
        r = httpx.post(f"{s.url}/v1/audio/voices", json={"id": "alice", "model": "tone", "audio": h.wav_base64()})
        assert r.status_code == 409, r.text
    finally:
        s.stop()
    assert len(list((home / "voices").rglob("prompt.safetensors"))) == 1
    assert len(list((home / "voices").rglob("voice.json"))) == 1
    listens = _count(monkeypatch, ToneModel, "_listen")
    s = h.start_server(models)
    try:
        data = httpx.get(f"{s.url}/v1/audio/voices").json()["data"]
        assert {"id": "alice", "kind": "cached", "model": "tone", "stored": True} \
            .items() <= next(v for v in data if v["id"] == "alice").items()
        assert _speak(s.url, "tone", "alice", h) == first
        assert listens == []  # the prompt came from the store
        r = httpx.post(f"{s.url}/v1/audio/speech", json={"model": "slow", "input": "abc", "voice": "alice"})
        assert r.status_code == 400 and "was made for model tone" in r.json()["error"]["message"], r.text
        assert httpx.delete(f"{s.url}/v1/audio/voices/alice").status_code == 401
        r = httpx.delete(f"{s.url}/v1/audio/voices/alice", headers=h.admin)
        assert r.status_code == 200, r.text
        assert httpx.delete(f"{s.url}/v1/audio/voices/alice", headers=h.admin).status_code == 404
        assert "alice" not in [v["id"] for v in httpx.get(f"{s.url}/v1/audio/voices").json()["data"]]
        r = httpx.post(f"{s.url}/v1/audio/speech", json={"model": "tone", "input": "abc", "voice": "alice"})
        assert r.status_code == 400, r.text
    finally:
        s.stop()
    assert not list((home / "voices").rglob("voice.json"))


def test_stored_voice_of_an_unloaded_model_is_listed(tmp_path, home, h):
    """A server that has not loaded the voice's model yet still lists the voice, and loads it on use."""
    models = {"tone": h.write_model(tmp_path / "tone")}
    s = h.start_server(models)
    try:
        r = httpx.post(f"{s.url}/v1/audio/voices", json={"id": "bob", "model": "tone", "audio": h.wav_base64()})
        assert r.status_code == 201, r.text
    finally:
        s.stop()
    from mizuoto.server.app import create_app
    from mizuoto.server.launch import ServerThread
    from mizuoto.server.state import ServerConfig

    s = ServerThread(create_app(h.make_runtime(), ServerConfig(), models, preload=False)).start()
    try:
        [bob] = [v for v in httpx.get(f"{s.url}/v1/audio/voices").json()["data"] if v["id"] == "bob"]
        assert bob["loaded"] is False and bob["model"] == "tone"
        _speak(s.url, "tone", "bob", h)
    finally:
        s.stop()


def test_cache_refused_by_a_model_without_a_voice_cache(client, h):
    """Piper caches no voices: registering with model=piper is a 400 naming the model."""
    r = client.post("/v1/audio/voices", json={"id": "pv", "model": "piper", "audio": h.wav_base64()})
    assert r.status_code == 400 and "cannot cache voices" in r.json()["error"]["message"], r.text
    r = client.post("/v1/audio/voices", json={"id": "pv", "model": "nope", "audio": h.wav_base64()})
    assert r.status_code == 404, r.text


def test_cosyvoice_voice_survives_restart(served_dirs, home, monkeypatch, h, cosy_expected):
    """CosyVoice 2: the prompt is computed once; after a restart the voice speaks the inline clone's exact audio."""
    models = {"cosy": served_dirs["cosy"]}
    text, seed = "A stored voice speaks.", 7
    prompts = _count(monkeypatch, CosyVoiceFrontend, "voice_prompt")
    s = h.start_server(models)
    try:
        r = httpx.post(f"{s.url}/v1/audio/voices", data={"id": "clip", "text": h.ref_text, "model": "cosy"},
                       files={"file": ("clip.wav", base64.b64decode(h.clip_base64()), "audio/wav")}, timeout=60.0)
        assert r.status_code == 201, r.text
        assert len(prompts) == 1
        first = _speak(s.url, "cosy", "clip", h, text, seed)
        assert len(prompts) == 1  # the request used the cached prompt
    finally:
        s.stop()
    assert first == cosy_expected(text, seed)
    prompts.clear()
    s = h.start_server(models)
    try:
        assert "clip" in [v["id"] for v in httpx.get(f"{s.url}/v1/audio/voices?model=cosy").json()["data"]]
        assert _speak(s.url, "cosy", "clip", h, text, seed) == first
        assert prompts == []
    finally:
        s.stop()
