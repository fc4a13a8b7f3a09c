"""GET/POST/DELETE /v1/audio/voices: register a voice once by reference audio, speak with its id, delete it."""

import base64

import pytest


def test_register_use_delete_json(client, h):
    """JSON upload (base64), listed, usable as `voice` and as `ref_audio`, then deleted."""
    r = client.post("/v1/audio/voices", json={"id": "alice", "audio": h.wav_base64(freq=150), "text": "a reference"})
    assert r.status_code == 201, r.text
    assert r.json()["seconds"] == pytest.approx(2.0)
    try:
        listed = {(v["id"], v["kind"]) for v in client.get("/v1/audio/voices").json()["data"]}
        assert ("alice", "uploaded") in listed and ("low", "preset") in listed
        for body in ({"voice": "alice"}, {"ref_audio": "alice"}):
            r = client.post("/v1/audio/speech", json={"model": "tone", "input": "abc", **body})
            assert r.status_code == 200, r.text
            audio, rate = h.read_audio(r.content)
            assert len(audio) / rate == pytest.approx(h.tone_seconds("abc"))
        assert client.post("/v1/audio/voices", json={"id": "alice", "audio": h.wav_base64()}).status_code == 409
    finally:
        assert client.delete("/v1/audio/voices/alice").status_code == 200
    assert client.delete("/v1/audio/voices/alice").status_code == 404
    r = client.post("/v1/audio/speech", json={"model": "tone", "input": "abc", "voice": "alice"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice"


def test_cosy_speaks_with_registered_voice(client, h, cosy_expected):
    """A fixture clip uploaded once (as curl -F file=@clip.wav) clones with CosyVoice by id, as if sent inline."""
    text, seed = "A registered voice speaks.", 11
    r = client.post("/v1/audio/voices", data={"id": "clip", "text": h.ref_text},
                    files={"file": ("clip.wav", base64.b64decode(h.clip_base64()), "audio/wav")})
    assert r.status_code == 201, r.text
    try:
        for body in ({"voice": "clip"}, {"ref_audio": "clip"}):
            r = client.post("/v1/audio/speech", json={"model": "cosy", "input": text, "seed": seed, **body})
            assert r.status_code == 200, r.text
            assert r.content[44:] == cosy_expected(text, seed)
    finally:
        assert client.delete("/v1/audio/voices/clip").status_code == 200


def test_register_multipart(client, h):
    """A form upload (as curl -F file=@ref.wav) works the same."""
    wav = base64.b64decode(h.wav_base64())
    r = client.post("/v1/audio/voices", data={"id": "bob", "text": "hello"},
                    files={"file": ("ref.wav", wav, "audio/wav")})
    assert r.status_code == 201, r.text
    assert client.post("/v1/audio/speech", json={"model": "tone", "input": "ab", "voice": "bob"}).status_code == 200
    assert client.delete("/v1/audio/voices/bob").status_code == 200


@pytest.mark.parametrize("body, field", [
    ({"id": "x"}, "audio"),
    ({"id": "x", "audio": "###"}, "audio"),
    ({"id": "x", "audio": base64.b64encode(b"%PDF-1.4 not audio").decode()}, "audio"),
    ({"id": "bad id!", "audio": "AAAA"}, "id"),
    ({"audio": "AAAA"}, "id"),
    ({"id": "low", "audio": None}, "id"),
    ({"id": "alice\n", "audio": None}, "id"),  # re's '$' let it through, into a folder name of the voice store
    ({"id": "x", "audio": None, "model": 0}, "model"),  # a falsy non-string model was read as no model
])
def test_register_refused(client, h, body, field):
    """Missing, corrupt or non-audio uploads and bad or taken ids are refused, naming the field."""
    if "audio" in body and body["audio"] is None:
        body = {**body, "audio": h.wav_base64()}
    r = client.post("/v1/audio/voices", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == field


def test_upload_8khz_refused(client):
    """A narrow-band reference cannot become a voice."""
    import io

    import numpy as np
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.full(16000, 0.1, np.float32), 8000, format="WAV")
    r = client.post("/v1/audio/voices", data={"id": "narrow"}, files={"file": ("n.wav", buf.getvalue(), "audio/wav")})
    assert r.status_code == 400 and "8000 Hz" in r.json()["error"]["message"]


def test_voices_of_one_model(client):
    """?model= narrows the listing to that model (and the uploaded voices); an unknown model is 404."""
    data = client.get("/v1/audio/voices", params={"model": "piper"}).json()["data"]
    assert {v["model"] for v in data} <= {"piper", None} and any(v["model"] == "piper" for v in data)
    assert client.get("/v1/audio/voices", params={"model": "nope"}).status_code == 404


def test_voice_limits_over_http(client, h):
    """A voice lasts at most 30 s (CosyVoice's limit), and is kept at 48 kHz at most (the answer's sample_rate)."""
    import io

    import numpy as np
    import soundfile

    def wav(seconds: float, rate: int, channels: int) -> bytes:
        t = np.arange(int(seconds * rate)) / rate
        buf = io.BytesIO()
        soundfile.write(buf, np.repeat(0.2 * np.sin(2 * np.pi * 150 * t)[:, None], channels, 1), rate, format="WAV")
        return buf.getvalue()

    r = client.post("/v1/audio/voices", data={"id": "long"}, files={"file": ("l.wav", wav(31, 16000, 1), "audio/wav")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    assert "between 0.5 and 30 s" in r.json()["error"]["message"]
    r = client.post("/v1/audio/voices", data={"id": "hires"}, files={"file": ("h.wav", wav(1, 96000, 2), "audio/wav")})
    assert r.status_code == 201 and r.json()["sample_rate"] == 48000 and r.json()["seconds"] == 1.0, r.text
    try:
        r = client.post("/v1/audio/speech", json={"model": "tone", "input": "ab", "voice": "hires"})
        assert r.status_code == 200, r.text
    finally:
        assert client.delete("/v1/audio/voices/hires").status_code == 200
