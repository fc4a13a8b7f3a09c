"""Hostile clients: no single client can crash the server, exhaust its memory or starve the others.

Every probe runs against a real server on 127.0.0.1, bounded in count and time. After each one the
server must be alive and healthy, and every error it sent is JSON with a 4xx/5xx naming the problem.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile
import torch
import websockets.sync.client

from mizuoto.runtime.engine import AudioChunk
from mizuoto.server.app import create_app
from mizuoto.server.launch import ServerThread
from mizuoto.server.state import ServerConfig
from mizuoto.testing.toy import ToneModel

API_KEY, ADMIN_KEY = "api-key-for-tests", "admin-key-for-tests"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GOOD = {"model": "tone", "input": "hello there", "voice": "low"}
TIMEOUT = 0.5  # the server's header and idle timeouts in this module
BODY_TIMEOUT = 4 * TIMEOUT  # the whole body's


class NanToneModel(ToneModel):
    """A tone model whose audio is NaN: what a diverging engine hands the server."""

    def synthesize(self, request):
        for chunk in super().synthesize(request):
            yield AudioChunk(torch.full_like(chunk.samples, float("nan")), chunk.sample_rate, chunk.index, chunk.final)


class StepToneModel(ToneModel):
    """A tone model whose whole-file request takes one `use()` step of 50 ms per character (like an LM)."""

    steps = 0

    def synthesize(self, request):
        text = request.text if isinstance(request.text, str) else ""
        for _ in text:
            with self.use("notes"):
                time.sleep(0.05)
            StepToneModel.steps += 1
        yield from super().synthesize(request)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, h, served_dirs):
    """A server with keys, short timeouts and two job slots, over tone, NaN, stepping and CosyVoice models."""
    root = tmp_path_factory.mktemp("hostile")
    rt = h.make_runtime()
    rt.registry.add(h.tone_engine("nan", NanToneModel, "tone engine whose audio is NaN"))
    rt.registry.add(h.tone_engine("steps", StepToneModel, "tone engine with one use() step per character"))
    models = {"tone": h.write_model(root / "tone"), "nan": h.write_tone_model(root / "nan", "nan"),
              "steps": h.write_tone_model(root / "steps", "steps"), "cosy": served_dirs["cosy"]}
    config = ServerConfig(max_concurrent=2, request_timeout=60.0, api_key=API_KEY, admin_key=ADMIN_KEY,
                          header_timeout=TIMEOUT, idle_timeout=TIMEOUT, body_timeout=BODY_TIMEOUT, drain_seconds=0.0)
    server = ServerThread(create_app(rt, config, models)).start()
    with httpx.Client(base_url=server.url, timeout=60.0, headers=USER) as client:
        baseline = h.resident_bytes()
        yield server, client
        # across every probe of the module (bombs included), resident memory stays near where it started
        grown = h.resident_bytes() - baseline
        assert grown < 256 << 20, f"resident memory grew by {grown >> 20} MiB over the hostile probes"
    server.stop()


def _healthy(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post("/v1/audio/speech", json=GOOD)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav", r.text


def _error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    error = r.json()["error"]
    for word in words:
        assert word in error["message"], error
    return error


def _wav(samples: np.ndarray, rate: int, subtype: str = "FLOAT", fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _clip(h) -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(io.BytesIO(base64.b64decode(h.clip_base64())), dtype="float32")
    return audio, rate


# ---- one request must not kill the process -------------------------------------------------------

FORMATS = ("wav", "pcm", "flac", "mp3", "opus")


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_or_non_finite_reference_is_a_400_for_every_format(hostile, h, fmt):
    _, client = hostile
    audio, rate = _clip(h)
    for bad, words in ((audio * 1e30, "peaks at"), (np.where(np.arange(audio.size) == 7, np.nan, audio), "non-finite")):
        for model in ("tone", "cosy"):
            body = {"model": model, "input": "hello", "ref_audio": _b64(_wav(bad.astype(np.float32), rate)),
                    "ref_text": h.ref_text, "response_format": fmt}
            assert _error(client.post("/v1/audio/speech", json=body), 400, words)["param"] == "ref_audio"
    _healthy(client)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_engine_that_emits_nan_is_a_500_never_an_encoder_crash(hostile, fmt):
    _, client = hostile
    body = {"model": "nan", "input": "hello", "voice": "low", "response_format": fmt}
    _error(client.post("/v1/audio/speech", json=body), 500, "non-finite")
    if fmt in ("wav", "pcm"):
        _error(client.post("/v1/audio/speech", json={**body, "stream_format": "audio"}), 500, "non-finite")
    _healthy(client)


# ---- memory bombs ---------------------------------------------------------------------------------

def _long_flac(seconds: int, rate: int = 48000) -> bytes:
    """A FLAC of `seconds` of stereo near-silence, written a second at a time (small on disk, huge decoded)."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, 2, format="FLAC", subtype="PCM_16") as f:
        block = np.full((rate, 2), 1e-3, np.float32)
        for _ in range(seconds):
            f.write(block)
    return buf.getvalue()


def test_files_that_decode_to_hours_or_absurd_rates_are_refused_from_their_header(hostile, h):
    server, client = hostile
    flac = _long_flac(600)
    assert len(flac) < 8 << 20  # ten minutes of stereo 48 kHz: a few MB compressed, 230 MB decoded
    probes = [(flac, "lasts"), (_wav(np.full(61 * 16000, 0.1, np.float32), 16000, "PCM_16"), "lasts"),
              (_wav(np.full(65535 * 2, 0.1, np.float32), 655350, "PCM_16"), "655350 Hz"),
              (_wav(np.full((16000, 16), 0.1, np.float32), 16000, "PCM_16"), "channels")]
    for data, words in probes:
        body = {**GOOD, "voice": None, "ref_audio": _b64(data), "ref_text": h.ref_text}
        _error(client.post("/v1/audio/speech", json={k: v for k, v in body.items() if v is not None}), 400, words)
        r = client.post("/v1/audio/voices", json={"id": "bomb", "audio": _b64(data), "text": "x"})
        _error(r, 400, words)
    _healthy(client)


def test_a_multipart_upload_of_many_tiny_parts_is_refused_before_parsing(hostile):
    _, client = hostile
    boundary = "b0undary"
    parts = "".join(f"--{boundary}\r\nContent-Disposition: form-data; name=\"f{i}\"\r\n\r\nx\r\n" for i in range(50_000))
    body = (parts + f"--{boundary}--\r\n").encode()
    r = client.post("/v1/audio/voices", content=body,
                    headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    _error(r, 400, "parts")
    _healthy(client)


# ---- capacity held without work ---------------------------------------------------------------------

def test_idle_websocket_sessions_hold_no_slot_and_are_closed(hostile):
    server, client = hostile
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with contextlib.ExitStack() as stack:
        sessions = []
        for _ in range(4):  # twice the server's job slots
            ws = stack.enter_context(websockets.sync.client.connect(url, additional_headers=USER, open_timeout=10))
            ws.send(json.dumps({"type": "session.start", "model": "tone", "voice": "low"}))
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
            sessions.append(ws)
        _healthy(client)  # the idle sessions took no job slot
        for ws in sessions:  # and each is ended by the idle timeout with a JSON error
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["code"] == 408, event


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends before closing `sock`; fails if it is still open after `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except socket.timeout:
        raise AssertionError(f"connection still open after {seconds} s") from None
    return got


def test_silent_and_half_sent_connections_are_closed(hostile):
    server, client = hostile
    host, port = server.host, server.port
    with socket.create_connection((host, port)) as silent, socket.create_connection((host, port)) as half:
        half.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(silent, 20 * TIMEOUT) == b""
        assert _closed_within(half, 20 * TIMEOUT) == b""
    with socket.create_connection((host, port)) as slow_body:
        slow_body.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"mo")
        reply = _closed_within(slow_body, 20 * TIMEOUT)
        assert reply.startswith(b"HTTP/1.1 408") and b"application/json" in reply and b"stalled" in reply, reply[:300]
    _healthy(client)


def test_a_second_request_half_sent_on_a_kept_alive_connection_is_closed(hostile):
    """The header timeout holds for every request of a connection, not only its first: after one whole request,
    half of a second one does not keep the connection open."""
    server, _ = hostile
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        reply = b""
        while b'"ok"' not in reply:
            reply += sock.recv(4096)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(sock, 20 * TIMEOUT) == b""


def test_a_body_trickled_below_the_idle_timeout_gets_a_408_at_the_body_timeout(hostile):
    """One byte every 0.6 idle timeouts never stalls, yet the whole body has a deadline of its own."""
    server, client = hostile
    with socket.create_connection((server.host, server.port)) as drip:
        drip.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
        started, reply = time.monotonic(), b""
        drip.settimeout(0.6 * TIMEOUT)
        while not reply and time.monotonic() - started < 10 * BODY_TIMEOUT:
            try:
                drip.sendall(b" ")
                reply = drip.recv(4096)
            except socket.timeout:
                continue
            except OSError:  # closed after its answer
                break
        assert reply.startswith(b"HTTP/1.1 408") and b"longer than" in reply, reply[:300]
        assert time.monotonic() - started < BODY_TIMEOUT + 2 * TIMEOUT
    _healthy(client)


def test_a_whole_file_request_stops_computing_when_its_client_leaves(hostile, h):
    server, client = hostile
    StepToneModel.steps = 0
    text = "x" * 200  # 200 steps of 50 ms: ten seconds of work
    with httpx.Client(base_url=server.url, timeout=0.5, headers=USER) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/audio/speech", json={"model": "steps", "input": text, "voice": "low"})
    end = time.monotonic() + 20
    while time.monotonic() < end and "mizuoto_requests_in_flight 0" not in client.get("/metrics").text:
        time.sleep(0.05)
    assert "mizuoto_requests_in_flight 0" in client.get("/metrics").text
    assert 0 < StepToneModel.steps < len(text) // 2, StepToneModel.steps
    _healthy(client)


def test_sequential_clients_never_meet_a_spurious_503(hostile):
    _, client = hostile
    statuses = [client.post("/v1/audio/speech", json=GOOD).status_code for _ in range(12)]
    assert statuses == [200] * 12


def test_a_normal_request_is_served_while_hostile_connections_are_open(hostile):
    server, client = hostile
    stop = threading.Event()

    def hold_connections():
        while not stop.is_set():
            with socket.create_connection((server.host, server.port)) as s:
                s.sendall(b"GET /v1/mod")
                stop.wait(TIMEOUT / 2)

    holders = [threading.Thread(target=hold_connections, daemon=True) for _ in range(8)]
    for t in holders:
        t.start()
    try:
        start = time.monotonic()
        r = client.post("/v1/audio/speech", json=GOOD)
        assert r.status_code == 200 and time.monotonic() - start < 30
    finally:
        stop.set()
        for t in holders:
            t.join(10)


# ---- untrusted strings ----------------------------------------------------------------------------------

def test_names_are_checked_where_they_enter_and_never_reach_headers_or_metrics(hostile):
    _, client = hostile
    forged = "tone\nmizuoto_forged_total 1"
    _error(client.post("/v1/audio/speech", json={**GOOD, "model": forged}), 400, "'model'")
    _error(client.post("/v1/models/load", json={"model": "a\r\nX-Evil: 1", "path": "/tmp"}, headers=ADMIN),
           400, "'model'")
    for i in range(40):  # unknown names do not grow the label set
        client.post("/v1/audio/speech", json={**GOOD, "model": f"nope-{i}"})
    metrics = client.get("/metrics").text
    assert "mizuoto_forged_total" not in metrics and "nope-" not in metrics
    for line in metrics.splitlines():
        assert line.startswith(("#", "mizuoto_", "process_", "python_")), line  # and the library's standard ones
    _healthy(client)


@pytest.mark.parametrize("body, status, words", [
    (b'{"model": "tone", "voice": "low", "input": "\\ud800 lone"}', 400, "not valid Unicode"),
    (b'{"model": "tone", "voice": "low", "input": "nul\\u0000here"}', 400, "NUL"),
    (b"[" * 200_000 + b"]" * 200_000, 400, "nested too deeply"),
    (b'{"model": "tone", "voice": "low\\u0007", "input": "hi"}', 400, "voice id"),
])
def test_malformed_strings_are_json_400s(hostile, body, status, words):
    _, client = hostile
    r = client.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    _error(r, status, words)
    _healthy(client)


def test_every_error_is_json_and_lists_no_names(hostile):
    _, client = hostile
    _error(client.get("/no/such/route"), 404)
    _error(client.put("/v1/audio/speech"), 405)
    message = _error(client.post("/v1/audio/speech", json={**GOOD, "voice": "nobody"}), 400)["message"]
    assert "low" not in message and "high" not in message  # the model's voices are not listed to any client
    message = _error(client.post("/v1/audio/speech", json={**GOOD, "model": "nobody"}), 404)["message"]
    assert "tone" not in message and "cosy" not in message


# ---- administration ----------------------------------------------------------------------------------------

def test_keys_guard_the_api_and_its_administration(hostile):
    server, client = hostile
    with httpx.Client(base_url=server.url, timeout=30.0) as anonymous:
        assert anonymous.get("/health").status_code == 200
        _error(anonymous.post("/v1/audio/speech", json=GOOD), 401, "API key")
        _error(anonymous.get("/v1/models"), 401)
    _error(client.post("/v1/models/unload", json={"model": "tone"}), 403, "admin key")
    _error(client.delete("/v1/audio/voices/anything"), 403, "admin key")
    assert client.post("/v1/models/unload", json={"model": "tone"}, headers=ADMIN).status_code == 200
    assert client.post("/v1/models/load", json={"model": "tone"}, headers=ADMIN).status_code == 200
    _healthy(client)


def test_administration_is_off_without_an_admin_key(h, tmp_path):
    app = create_app(h.make_runtime(), ServerConfig(), {"tone": h.write_model(tmp_path / "tone")})
    server = ServerThread(app).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as c:
            _error(c.post("/v1/models/unload", json={"model": "tone"}), 403, "--admin-key")
            assert c.post("/v1/audio/speech", json=GOOD).status_code == 200
    finally:
        server.stop()


def test_ready_answers_503_while_the_server_drains(h, tmp_path):
    import signal

    server = h.start_server({"tone": h.write_model(tmp_path / "tone")}, ServerConfig(drain_seconds=30.0))
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as c:
            assert c.get("/ready").status_code == 200
            server.server.handle_exit(signal.SIGTERM, None)
            r = c.get("/ready")
            assert r.status_code == 503 and r.json()["status"] == "shutting down"
            _error(c.post("/v1/audio/speech", json=GOOD), 503, "shutting down")
    finally:
        server.stop()


def test_a_request_whose_memory_exceeds_the_budget_is_refused_with_the_figure(hostile, h, served_dirs):
    """One unpunctuated segment: the flow's attention grows with the square of the speech the LM must at
    least make of it; when even that is past the budget the request is a 413 before it starts."""
    from mizuoto.runtime.engine import SynthesisRequest

    text = "a" * 3000
    with h.make_runtime() as probe:
        name = probe.load(served_dirs["cosy"])
        model_peak = probe.plan(name).peak
        request = SynthesisRequest(text, voice="any", mode="clone")  # the plan reads the text only
        least = probe.memory.plan_for(probe._get(name), request).peak
    assert least > 2 * model_peak
    server = h.start_server({"cosy": served_dirs["cosy"]}, ram=(model_peak + least) // 2)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0, headers=h.admin) as client:
            body = {"model": "cosy", "input": text, "ref_audio": h.clip_base64(), "ref_text": h.ref_text}
            error = _error(client.post("/v1/audio/speech", json=body), 413, "refused before it started", "flow")
            assert "MiB" in error["message"] or "GiB" in error["message"], error
            assert client.post("/v1/audio/speech", json={**body, "input": "a b c."}).status_code == 200
    finally:
        server.stop()


def test_a_websocket_session_dripping_text_gives_its_slot_back(hostile):
    """Text appended a little at a time, each below the idle timeout, ends at the body timeout with a 408,
    and the job slot it took with its first text is free again."""
    server, client = hostile
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with websockets.sync.client.connect(url, additional_headers=USER, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.start", "model": "tone", "voice": "low"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        end, event = time.monotonic() + 20 * BODY_TIMEOUT, None
        while event is None and time.monotonic() < end:
            ws.send(json.dumps({"type": "input_text.append", "text": " a"}))
            try:
                while not isinstance(message := ws.recv(timeout=TIMEOUT / 2), str):
                    pass  # audio of the text so far
                event = json.loads(message)
            except TimeoutError:
                continue
        assert event is not None and event["type"] == "error" and event["error"]["code"] == 408, event
        assert "took longer" in event["error"]["message"]
    end = time.monotonic() + 10
    while "mizuoto_requests_in_flight 0" not in client.get("/metrics").text and time.monotonic() < end:
        time.sleep(0.05)
    assert "mizuoto_requests_in_flight 0" in client.get("/metrics").text  # the slot is free again
    _healthy(client)


def test_a_request_that_is_not_valid_http_gets_the_json_error_body(hostile):
    """A malformed Content-Length is refused before any route, with the JSON error body every error has."""
    server, client = hostile
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: }mC\r\n\r\n")
        reply = _closed_within(sock, 20 * TIMEOUT)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, reply[:300]
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["message"].startswith("invalid HTTP request"), error
    _healthy(client)
