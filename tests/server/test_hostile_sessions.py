"""WebSocket sessions under load and failure (issue 50): close codes that say what happened, and a client that
drops the socket frees its job slot at once.

Real servers on 127.0.0.1; the 'gate' models hold their requests until the test opens the gate (an event, no
sleeps); every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import websockets.sync.client
from websockets.exceptions import ConnectionClosed

from mizuoto.server.state import ServerConfig
from mizuoto.testing.toy import ToneModel


class LingerToneModel(ToneModel):
    """A tone model that works for 10 s (one 20 ms use() step at a time, as an LM decodes) before any audio."""

    def synthesize(self, request):
        if not isinstance(request.text, str):
            for _ in request.text:  # the whole streamed text first
                pass
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            with self.use("notes"):  # a cancelled request stops here
                time.sleep(0.02)
        yield from ()


def _url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def _session_end(server, model: str, text: str) -> tuple[dict, int | None]:
    """(the error event, the close code) of a session that speaks `text` on `model` and fails."""
    with websockets.sync.client.connect(_url(server), open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.start", "model": model, "voice": "low"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        ws.send(json.dumps({"type": "input_text.append", "text": text}))
        ws.send(json.dumps({"type": "input_text.done"}))
        while not isinstance(message := ws.recv(timeout=30), str):
            pass  # audio before the failure
        event = json.loads(message)
        try:
            ws.recv(timeout=10)
        except ConnectionClosed as e:
            return event, e.rcvd.code if e.rcvd else None
    raise AssertionError(f"the session was not closed after {event}")


@pytest.fixture
def gated(h, tmp_path):
    """A server of one job slot and no queue, over a gate model and a slow tone model; the gate opens at the end."""
    gate = h.new_gate()
    models = {"gate": h.write_gate_model(tmp_path / "gate"), "slow": h.write_slow_model(tmp_path / "slow", 0.0)}
    server = h.start_server(models, ServerConfig(max_concurrent=1, max_queued=0, request_timeout=60.0))
    try:
        yield server, gate
    finally:
        gate.open.set()
        server.stop()


def test_a_session_refused_for_load_closes_with_1013_try_again_later(gated):
    """Finding 8: every slot and queue place taken is a 503: the session closes with 1013 (Try Again Later),
    not 1011 (internal error), which stays for the server's own failures."""
    server, gate = gated
    held = threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/audio/speech", timeout=60.0,
                                                      json={"model": "gate", "input": "hold", "voice": "low"}))
    held.start()
    try:
        assert gate.entered.acquire(timeout=30), "the holding request never started"
        event, code = _session_end(server, "slow", "hello")
        assert event["error"]["code"] == 503 and code == 1013, (event, code)
    finally:
        gate.open.set()
        held.join(30)
    from mizuoto.server.websocket import close_code

    assert [close_code(s) for s in (400, 408, 500, 503, 504, 507)] == [1008, 1008, 1011, 1013, 4504, 4507]


def test_a_session_past_its_deadline_closes_with_4504(h, tmp_path):
    """Finding 8: a session ended by --request-timeout (504) closes with 4504, documented, not 1011."""
    gate = h.new_gate()
    server = h.start_server({"gate": h.write_gate_model(tmp_path / "gate")}, ServerConfig(request_timeout=1.0))
    try:
        event, code = _session_end(server, "gate", "hello")
        assert event["error"]["code"] == 504 and code == 4504, (event, code)
    finally:
        gate.open.set()
        server.stop()


def _in_flight(client: httpx.Client) -> int:
    return client.get("/ready").json()["in_flight"]


@pytest.mark.parametrize("stream_in", [True, False])
def test_a_dropped_websocket_frees_its_slot_at_once(h, tmp_path, stream_in):
    """Finding 9: a client that drops its socket while the engine works (no audio yet) was noticed only at the next
    send, holding the slot for as long as the engine took (10 s here); now its job is cancelled at once and the
    slot is free within the engine's next step. Both session paths: text streamed in, and text read whole first."""
    rt = h.make_runtime()
    rt.registry.add(h.tone_engine("linger", LingerToneModel, "tone engine that works 10 s before its audio"))
    from mizuoto.server.app import create_app
    from mizuoto.server.launch import ServerThread

    server = ServerThread(create_app(rt, ServerConfig(), {"linger": h.write_tone_model(tmp_path / "m", "linger")}))
    server.start()
    try:
        model = rt.model("linger")
        if not stream_in:  # the session reads its whole text before the job starts
            import dataclasses

            model.capabilities = dataclasses.replace(model.capabilities, stream_in=False)
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            with websockets.sync.client.connect(_url(server), open_timeout=10, close_timeout=1) as ws:
                ws.send(json.dumps({"type": "session.start", "model": "linger", "voice": "low"}))
                assert json.loads(ws.recv(timeout=10))["stream_in"] is stream_in
                ws.send(json.dumps({"type": "input_text.append", "text": "hello"}))
                ws.send(json.dumps({"type": "input_text.done"}))
                h.until(lambda: _in_flight(client) == 1, "the session's job to start", 10.0)
                ws.socket.shutdown(socket.SHUT_RDWR)  # the client vanishes: no close frame
                dropped = time.monotonic()
                h.until(lambda: _in_flight(client) == 0, "the dropped session's slot to be free", 5.0)
                freed = time.monotonic() - dropped
        assert freed < 1.0, freed
    finally:
        server.stop()
