"""Engine-declared request options over HTTP: the body's `options`, their checks, GET /v1/models and the document.

The tone engine declares `transpose` (semitones); nothing in the server names it.
"""

import numpy as np


def _pitch(h, body: bytes) -> float:
    """The dominant frequency of a tone response, in Hz."""
    audio, rate = h.read_audio(body)
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    return float(np.argmax(spectrum) * rate / len(audio))


def test_an_option_changes_the_audio_as_the_engine_declares(client, h):
    body = {"model": "tone", "input": "aaaa", "voice": "low", "seed": 1}
    plain = client.post("/v1/audio/speech", json=body)
    octave = client.post("/v1/audio/speech", json={**body, "options": {"transpose": 12}})
    assert plain.status_code == octave.status_code == 200
    assert abs(_pitch(h, octave.content) / _pitch(h, plain.content) - 2.0) < 0.1


def test_bad_options_are_400s_naming_the_field(client):
    base = {"model": "tone", "input": "aaaa", "voice": "low"}
    for options, words in (({"transpose": 99}, "transpose"), ({"pitch": 1}, "no option 'pitch'"),
                           ({"transpose": "up"}, "transpose"), ([1, 2], "options")):
        r = client.post("/v1/audio/speech", json={**base, "options": options})
        assert r.status_code == 400, (options, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["param"] == "options", (options, error)


def test_a_model_lists_its_options(client):
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert {"name": "transpose", "type": "integer", "default": 0, "minimum": -12, "maximum": 12,
            "description": "shift every note by this many semitones"} in models["tone"]["options"]
    assert models["piper"].get("options") == []


def test_the_document_describes_each_engines_options(client):
    doc = client.get("/openapi.json").json()
    body = doc["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in body:
        body = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    variants = {v["title"]: v for v in body["properties"]["options"]["anyOf"]}
    assert variants["tone options"]["properties"]["transpose"]["maximum"] == 12
    assert variants["tone options"]["additionalProperties"] is False


def test_a_websocket_session_takes_options(server):
    """`options` in session.start reach the engine; a bad one is refused before the session starts."""
    import json

    from websockets.sync.client import connect

    def session(start: dict) -> list:
        url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        with connect(url, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "session.start", "model": "tone", "voice": "low", "seed": 1, **start}))
            out = [json.loads(ws.recv(timeout=30))]
            if out[0]["type"] != "session.created":
                return out
            ws.send(json.dumps({"type": "input_text.append", "text": "aaaa"}))
            ws.send(json.dumps({"type": "input_text.done"}))
            while True:
                msg = ws.recv(timeout=30)
                out.append(msg if isinstance(msg, bytes) else json.loads(msg))
                if not isinstance(msg, bytes):
                    return out

    plain, octave = session({}), session({"options": {"transpose": 12}})
    assert plain[-1]["type"] == octave[-1]["type"] == "speech.audio.done"
    assert b"".join(m for m in plain if isinstance(m, bytes)) != b"".join(m for m in octave if isinstance(m, bytes))
    refused = session({"options": {"transpose": 99}})
    assert refused[-1]["type"] == "error" and "transpose" in refused[-1]["error"]["message"], refused
