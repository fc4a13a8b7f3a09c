"""Hostile clients, third round (issue 50): nothing a client sends runs on the event loop unbounded.

Each attack runs against a real server on 127.0.0.1 while GET /health is asked one request after
another; /health must answer within 1 s (p99) throughout, and the attack must be refused. Every
attack is bounded: a few MiB sent once, over loopback. Before these fixes each one held the loop for
seconds: a big JSON body or WebSocket message was parsed whole on it (json.loads holds the GIL),
and h11 parsed each chunk of a chunked body in Python.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import websockets.sync.client
from websockets.exceptions import ConnectionClosed

from mizuoto.server.protocol import FREE_CHUNKS, MAX_FRAGMENTS
from mizuoto.server.state import ServerConfig

GOOD = {"model": "tone", "input": "hello there", "voice": "low"}
P99 = 1.0  # seconds: /health under every attack (the bound)


@pytest.fixture(scope="module")
def server(h, tmp_path_factory):
    """A server without an API key (no key is needed to attack it), two job slots."""
    root = tmp_path_factory.mktemp("loop")
    s = h.start_server({"tone": h.write_model(root / "tone")}, ServerConfig(max_concurrent=2))
    yield s
    s.stop()


def _post_raw(server, head: bytes, body: bytes, timeout: float = 60.0) -> bytes:
    """Send a raw request (the body in one go, whatever the server does meanwhile); what comes back before the
    server closes or `timeout`."""
    with socket.create_connection((server.host, server.port)) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(head + body)
        except OSError:  # refused and closed before it was all sent
            pass
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
                if b"\r\n\r\n" in reply and b"connection: close" not in reply.lower():
                    break  # a kept-alive answer (the old server's): it is all here once its body is
        except OSError:
            pass
    return reply


def _json_of(reply: bytes) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():  # the first chunk holds the JSON
        body = body.split(b"\r\n", 2)[1]
    return json.loads(body)


@pytest.mark.parametrize("kind", ["values", "names"])
def test_a_big_json_body_is_refused_before_it_is_parsed(server, h, kind):
    """Finding 1: 8 MiB of `[0,0,...]` in an option, or a million unknown option names, was parsed (and the names
    echoed) on the event loop; the body's JSON values are counted first, and the 400 is short."""
    if kind == "values":
        options = b'{"transpose": [' + b"0," * (4 << 20) + b"0]}"
    else:
        options = b"{" + b",".join(b'"o%d":0' % i for i in range(800_000)) + b"}"
    body = json.dumps(GOOD).encode()[:-1] + b', "options": ' + options + b"}"

    def attack() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=120.0) as c:
            return c.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})

    seconds, r = h.health_during(server.url, attack)
    assert r.status_code == 400 and len(r.content) < 1024, (r.status_code, r.content[:300], len(r.content))
    assert (p99 := h.p99(seconds)) < P99, (p99, len(seconds))


def test_a_speech_body_is_limited_to_what_a_speech_request_holds(server):
    """Finding 1: the speech body's limit is its texts, options and a reference clip (about 11 MiB by default),
    not the 32 MiB of a voice upload; a body within it is read and checked as before."""
    from mizuoto.server.bodies import speech_body_bytes

    limit = speech_body_bytes(ServerConfig().max_input_chars)
    assert limit < 12 << 20
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        big = json.dumps({**GOOD, "ref_audio": "A" * (limit + 1)})
        r = c.post("/v1/audio/speech", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and str(limit) in r.json()["error"]["message"], r.text[:300]
        within = json.dumps({**GOOD, "ref_audio": "!" * (limit - (1 << 20))})  # not base64: a 400, read whole
        r = c.post("/v1/audio/speech", content=within, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ref_audio", r.text[:300]
        assert c.post("/v1/audio/speech", json=GOOD).status_code == 200


def test_a_body_in_one_byte_chunks_is_refused_and_costs_the_loop_nothing(server, h):
    """Finding 2: a million one-byte chunks (6 MB on the wire) were parsed one by one in Python on the loop; now
    the request is refused (400, connection closed) once its chunks pass FREE_CHUNKS and average under 256 bytes."""
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    body = b"1\r\n \r\n" * 1_000_000 + b"0\r\n\r\n"
    seconds, reply = h.health_during(server.url, lambda: _post_raw(server, head, body))
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply[:300]
    assert "chunks" in _json_of(reply)["error"]["message"]
    assert (p99 := h.p99(seconds)) < P99, (p99, len(seconds))


def test_a_chunked_body_in_reasonable_pieces_is_served(server, h):
    """The chunk bound never meets a client that streams its body: a 10 s reference clip in 300-byte pieces
    (1,400 chunks), and a small body in one-byte pieces (fewer than FREE_CHUNKS)."""
    clone = json.dumps({"model": "tone", "input": "hello", "ref_audio": h.wav_base64(10.0)}).encode()
    small = json.dumps({**GOOD, "input": "a " * 400}).encode()
    assert len(clone) // 300 > FREE_CHUNKS > len(small)
    for body, size in ((clone, 300), (small, 1)):
        def pieces(body: bytes = body, size: int = size):
            for i in range(0, len(body), size):
                yield body[i:i + size]
        with httpx.Client(base_url=server.url, timeout=60.0) as c:
            r = c.post("/v1/audio/speech", content=pieces(), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]


def test_transfer_encoding_beside_content_length_is_refused_and_the_connection_closed(server):
    """Finding 7: with both, a proxy framing by Content-Length and the server by chunks see different requests
    (RFC 9112 6.3): the request is a 400 and the connection closes, so a smuggled second request is never read."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % (5 + len(smuggled)))
    reply = _post_raw(server, head, b"0\r\n\r\n" + smuggled, timeout=10.0)
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1") == 1, reply[:500]
    assert b"connection: close" in reply.lower() and "Content-Length" in _json_of(reply)["error"]["message"]


def test_headers_past_16_kib_are_refused_without_waiting_for_their_end(server):
    """h11 bounded the request line and headers to 16 KiB; httptools does not, so the protocol does: a header
    that never ends is a 400 and a closed connection at once, not at the header timeout."""
    start = time.monotonic()
    reply = _post_raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * (1 << 20), b"", timeout=10.0)
    assert reply.startswith(b"HTTP/1.1 400") and "16384" in _json_of(reply)["error"]["message"], reply[:300]
    assert time.monotonic() - start < 5.0


def _ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


@pytest.mark.parametrize("mib", [8, 15])
def test_a_websocket_message_cannot_inflate_on_the_loop(server, h, mib):
    """Finding 3: permessage-deflate made 20 KB on the wire 16 MiB of JSON parsed on the loop. Compression is not
    negotiated; a message past the speech body's size is refused by the protocol (1009), one within it by its
    count of JSON values before it is parsed."""
    message = "[" + "0," * (mib << 19) + "0]"

    def attack() -> tuple[str | None, bool, int | None, str | None]:
        with websockets.sync.client.connect(_ws_url(server), open_timeout=10, max_size=None,
                                            compression="deflate") as ws:
            extensions = ws.response.headers.get("Sec-WebSocket-Extensions")
            try:
                ws.send(message)
                reply = ws.recv(timeout=60)
            except ConnectionClosed as e:  # the close frame may be lost to a reset while the client still sends
                return extensions, True, e.rcvd.code if e.rcvd else None, None
            return extensions, False, None, reply

    seconds, (extensions, closed, code, reply) = h.health_during(server.url, attack)
    assert extensions is None  # no compression: what the server parses is what the client sent
    if mib == 15:
        assert closed and code in (1009, None), (code, reply)
    else:
        assert reply is not None and "more than" in json.loads(reply)["error"]["message"], (code, reply)
    assert (p99 := h.p99(seconds)) < P99, (p99, len(seconds))


def test_a_websocket_message_in_one_byte_frames_is_refused(server, h):
    """Each WebSocket frame is parsed in Python: a message in more than MAX_FRAGMENTS frames closes the socket
    (1009) within one read, instead of a million frames of one byte each holding the loop."""
    import os

    def frame(opcode: int, fin: bool) -> bytes:
        mask = os.urandom(4)
        return bytes([(0x80 if fin else 0) | opcode, 0x81]) + mask + bytes([ord("a") ^ mask[0]])

    def attack() -> tuple[int | None, float]:
        with websockets.sync.client.connect(_ws_url(server), open_timeout=10) as ws:
            frames = frame(1, False) + frame(0, False) * 300_000
            start = time.monotonic()
            try:
                ws.socket.sendall(frames)
            except OSError:
                pass
            try:
                ws.recv(timeout=60)
            except ConnectionClosed as e:
                return (e.rcvd.code if e.rcvd else None), time.monotonic() - start
            return None, time.monotonic() - start

    seconds, (code, took) = h.health_during(server.url, attack)
    assert code == 1009 and MAX_FRAGMENTS < 300_000, code
    assert (p99 := h.p99(seconds)) < P99, (p99, len(seconds), took)


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models", "/v1/audio/voices", "/",
                                  "/openapi.json"])
def test_head_is_answered_on_every_get_route(server, path):
    """Finding 10: monitors probe with HEAD: each GET route answers it as GET would, without the body."""
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        get, head = c.get(path), c.head(path)
    assert head.status_code == get.status_code == 200, (head.status_code, head.text)
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    if "content-length" in get.headers and path not in ("/metrics", "/ready"):  # those two change between asks
        assert head.headers["content-length"] == get.headers["content-length"]
