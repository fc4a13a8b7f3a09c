"""The bad-input table: each case is a 4xx with a JSON error naming the problem, and the server keeps serving."""

import base64
import io
import time

import numpy as np
import pytest
import soundfile


def _wav(rate: int, seconds: float = 2.0) -> str:
    buf = io.BytesIO()
    t = np.arange(int(rate * seconds)) / rate
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 150 * t)).astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


GOOD = {"model": "tone", "input": "hello", "voice": "low"}
# (case id, raw body or JSON changes, status, field named, words the message must contain)
CASES = [
    ("bad-json", b'{"model": "tone", "input": ', 400, None, "not valid JSON"),
    ("not-an-object", b'["tone"]', 400, None, "JSON object"),
    ("missing-input", {"input": None}, 400, "input", "'input' is required"),
    ("empty-input", {"input": "   "}, 400, "input", "empty"),
    ("input-100k", {"input": "a" * 100_000}, 400, "input", "limit is"),
    ("input-not-string", {"input": 42}, 400, "input", "must be a string"),
    ("missing-model", {"model": None}, 400, "model", "'model' is required"),
    ("unknown-model", {"model": "no-such-model"}, 404, "model", "does not exist"),
    ("unknown-voice", {"voice": "nobody"}, 400, "voice", "unknown voice"),
    ("corrupt-base64", {"voice": None, "ref_audio": "%%%not base64%%%"}, 400, "ref_audio", "base64"),
    ("non-audio", {"voice": None, "ref_audio": base64.b64encode(b"just some text, no audio").decode()},
     400, "ref_audio", "not a readable audio file"),
    ("8khz-reference", {"voice": None, "ref_audio": _wav(8000)}, 400, "ref_audio", "8000 Hz"),
    ("too-short-reference", {"voice": None, "ref_audio": _wav(16000, 0.1)}, 400, "ref_audio", "lasts"),
    ("speed-0", {"speed": 0}, 400, "speed", "speed must be"),
    ("speed-100", {"speed": 100}, 400, "speed", "speed must be"),
    ("speed-string", {"speed": "fast"}, 400, "speed", "speed must be"),
    ("unsupported-format", {"response_format": "ogg"}, 400, "response_format", "not supported"),
    # found by the fuzz (test_fuzz.py): a list or an object as the format was a 500 (unhashable)
    ("format-list", {"response_format": ["wav"]}, 400, "response_format", "not supported"),
    ("format-object", {"response_format": {}}, 400, "response_format", "not supported"),
    # re's '$' let a trailing newline through: such a name reached response headers (a dropped connection)
    ("model-trailing-newline", {"model": "tone\n"}, 400, "model", "must be 1-128"),
    ("unstreamable-format", {"response_format": "flac", "stream_format": "audio"}, 400, "response_format",
     "cannot be streamed"),
    ("bad-stream-format", {"stream_format": "chunks"}, 400, "stream_format", "'audio' or 'sse'"),
    ("unknown-field", {"temperature": 0.5}, 400, "temperature", "unknown field"),
    ("type-field", {"type": "session.start"}, 400, "type", "unknown field"),  # a WebSocket message's, not HTTP's
    ("bad-seed", {"seed": -1}, 400, "seed", "non-negative"),
    ("mode-not-supported", {"model": "piper", "voice": None, "ref_audio": _wav(16000)}, 400, "ref_audio",
     "does not support mode"),
    ("cosy-no-voice", {"model": "cosy", "voice": None}, 400, "voice", "give ref_audio"),
    ("cosy-unknown-voice", {"model": "cosy", "voice": "nobody"}, 400, "voice", "unknown voice"),
    ("cosy-speed-while-streaming", {"model": "cosy", "voice": None, "ref_audio": _wav(16000), "ref_text": "a clip",
                                    "speed": 1.5, "stream_format": "audio"}, 400, "speed", "without streaming"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(client, case):
    """A clear 4xx for each bad request; then a good request still succeeds."""
    _, change, status, field, words = case
    if isinstance(change, bytes):
        r = client.post("/v1/audio/speech", content=change, headers={"content-type": "application/json"})
    else:
        body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
        r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert error["param"] == field
    assert error["code"] == status
    assert client.post("/v1/audio/speech", json=GOOD).status_code == 200
    assert client.get("/health").status_code == 200


def test_body_too_large(client):
    """A body over the size limit is refused with 413 before it is read whole."""
    r = client.post("/v1/audio/speech", content=b"x" * (33 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert client.post("/v1/audio/speech", json=GOOD).status_code == 200


def test_unknown_route_and_method(client):
    """Routes that do not exist or wrong methods are 404/405, not 500."""
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/audio/speech").status_code == 405


@pytest.mark.parametrize("body", [b'{"\\ud800": 1, "model": "tone", "input": "hi"}',
                                  b'{"model": "tone", "input": "hi", "voice": "\\udc00x"}'])
def test_a_lone_surrogate_anywhere_is_a_400(client, body):
    """A lone surrogate in a key or a value is a 400 with the JSON error body (its message escapes it), not a 500."""
    r = client.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "Unicode" in r.json()["error"]["message"] and r.json()["error"]["code"] == 400


def test_a_client_closing_mid_body_is_not_a_server_error(server, client):
    """A client that closes while sending its body is counted as 499 (client closed request), never as a 500."""
    import socket

    from prometheus_client.parser import text_string_to_metric_families

    def counted(status: int) -> float:
        return sum(s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples
                   if s.name == "mizuoto_requests_total" and s.labels == {"route": "speech", "model": "",
                                                                           "status": str(status)})

    before = counted(499), counted(500)
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"mo")
    end = time.monotonic() + 10
    while counted(499) == before[0] and time.monotonic() < end:
        time.sleep(0.05)
    assert (counted(499), counted(500)) == (before[0] + 1, before[1])


def test_null_is_absent_for_every_optional_field(client):
    """speed and response_format take null as their default, as every other optional field does."""
    r = client.post("/v1/audio/speech", json={**GOOD, "speed": None, "response_format": None, "seed": None})
    assert r.status_code == 200 and r.headers["content-type"].startswith("audio/wav"), r.text
