"""What a server says back to a hostile client (issue 50): errors never show where a model lies, quote at most a
short prefix of a bad value, and a reference clip too long for the engines is refused from its header."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile

from mizuoto.server import audio
from mizuoto.server.state import ServerConfig

USER_KEY = "user-key-of-input-tests"
USER = {"Authorization": f"Bearer {USER_KEY}"}


@pytest.fixture(scope="module")
def keyed(h, tmp_path_factory):
    """A server with an API key over two tone models of different weights (a voice of one is foreign to the other)."""
    root = tmp_path_factory.mktemp("input")
    models = {"a": h.write_model(root / "a", seed=0), "b": h.write_model(root / "b", seed=1)}
    with pytest.MonkeyPatch.context() as env:  # a store of its own: the voices it caches stay out of other servers'
        env.setenv("MIZUOTO_VOICE_STORE", str(root / "voices"))
        server = h.start_server(models, ServerConfig(api_key=USER_KEY))
    yield server, models
    server.stop()


def _message(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()["error"]["message"]


def test_errors_never_show_where_a_model_lies(keyed, h):
    """Finding 6: a voice cached on another model named that model's directory, and a runtime error may name one;
    GET /v1/models shows `path` to the admin key only, and so no error shows a server path to any key."""
    server, models = keyed
    dirs = [str(d) for d in models.values()] + [str(d.resolve()) for d in models.values()]
    with httpx.Client(base_url=server.url, timeout=60.0, headers=USER) as c:
        r = c.post("/v1/audio/voices", json={"id": "alice", "model": "a", "audio": h.wav_base64()})
        assert r.status_code == 201, r.text
        message = _message(c.post("/v1/audio/speech", json={"model": "b", "input": "hi", "voice": "alice"}), 400)
        assert "was made for model a" in message and not any(d in message for d in dirs), message
        # a model whose directory went away while it was unloaded: the runtime's error names the directory
        assert c.post("/v1/models/unload", json={"model": "a"}, headers=h.admin).status_code == 200
        models["a"].rename(models["a"].with_name("a-moved"))
        try:
            r = c.post("/v1/audio/speech", json={"model": "a", "input": "hi", "voice": "low"})
            message = _message(r, 400)
            assert "<server path>" in message and not any(d in message for d in dirs), message
        finally:
            models["a"].with_name("a-moved").rename(models["a"])
        assert c.post("/v1/models/load", json={"model": "a"}, headers=h.admin).status_code == 200


@pytest.mark.parametrize("what", ["response_format", "voice-id", "option", "field-name", "speed"])
def test_an_error_quotes_a_short_prefix_of_a_bad_value(keyed, what):
    """Finding 9: a 400 echoed the bad value whole (a 1 MiB response_format gave a 1 MiB answer, a 10 MB voice id a
    10 MB one); now at most a prefix of 40 characters and the value's length."""
    server, _ = keyed
    big = "x" * (1 << 20)
    speech = {"model": "a", "input": "hi", "voice": "low"}
    path, body = {
        "response_format": ("/v1/audio/speech", {**speech, "response_format": big}),
        "voice-id": ("/v1/audio/voices", {"id": "v" * 10_000_000, "audio": "AAAA"}),
        "option": ("/v1/audio/speech", {**speech, "options": {"transpose": big}}),
        "field-name": ("/v1/audio/speech", {**speech, big: 1}),
        "speed": ("/v1/audio/speech", {**speech, "speed": big}),
    }[what]
    with httpx.Client(base_url=server.url, timeout=60.0, headers=USER) as c:
        r = c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400 and len(r.content) < 1024, (r.status_code, len(r.content), r.content[:300])


def _flac(seconds: float, rate: int) -> bytes:
    """A FLAC of `seconds` of a quiet tone at `rate`: a few hundred KB, tens of MB decoded."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, 1, format="FLAC", subtype="PCM_16") as f:
        block = (0.01 * np.sin(np.arange(rate) * 0.05)).astype(np.float32)
        for _ in range(int(seconds)):
            f.write(block)
    return buf.getvalue()


def test_a_reference_clip_longer_than_the_engines_read_is_refused_before_decoding(keyed, monkeypatch):
    """Finding 9: a 60 s, 192 kHz ref_audio passed the 60 s check, was decoded whole (+182 MB) and then refused by
    the engine's 30 s limit; 30 s is now the server's limit, read from the header: no sample is decoded."""
    server, _ = keyed
    decoded = []
    original = audio._decode_mono
    monkeypatch.setattr(audio, "_decode_mono", lambda *a: decoded.append(1) or original(*a))
    clip = _flac(60, 192000)
    assert len(clip) < 4 << 20
    body = {"model": "a", "input": "hi", "ref_audio": base64.b64encode(clip).decode()}
    with httpx.Client(base_url=server.url, timeout=60.0, headers=USER) as c:
        r = c.post("/v1/audio/speech", json=body)
        assert "lasts 60.00 s" in _message(r, 400) and r.json()["error"]["param"] == "ref_audio"
        assert decoded == []
        body["ref_audio"] = base64.b64encode(_flac(2, 48000)).decode()
        assert c.post("/v1/audio/speech", json=body).status_code == 200 and decoded == [1]
