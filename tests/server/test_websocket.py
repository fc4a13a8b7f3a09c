"""WebSocket /v1/audio/speech/stream: text in pieces, audio out as produced, errors as messages."""

import json

import numpy as np
import pytest
from websockets.sync.client import connect

from mizuoto.errors import MizuotoError
from mizuoto.testing.cosyvoice_cases import first_speaking_seed


def _ws(server):
    return connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10)


def _session(server, start, pieces):
    """Run a session; returns (session.created, audio frames, final message)."""
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.start", **start}))
        created = json.loads(ws.recv(timeout=30))
        for piece in pieces:
            ws.send(json.dumps({"type": "input_text.append", "text": piece}))
        ws.send(json.dumps({"type": "input_text.done"}))
        frames = []
        while True:
            msg = ws.recv(timeout=30)
            if isinstance(msg, bytes):
                frames.append(msg)
            else:
                return created, frames, json.loads(msg)


@pytest.mark.parametrize("model", ["tone", "piper", "cosy"])
def test_text_in_audio_out(server, h, cosy_expected, model):
    """Pieces of text become PCM16 frames; the done message accounts for every sample.

    CosyVoice 2 takes the pieces as upstream's streamed text (a seeded clone of the fixture clip),
    so its audio must be what the engine gives for the same pieces. Streamed text sets the LM no
    minimum length, and the random-weight LM may stop within its first hop: one chunk can be all.
    """
    text = ["Streaming text ", "arrives in pieces. ", "Audio goes ", "out as it is made."]
    start = {"model": model}
    if model == "cosy":
        text += [" It keeps coming, ", "piece after piece, ", "until the speaker ", "has said it all."]
        # a seed for which the random LM speaks (it may draw a special token upstream rejects too)
        seed, expected = first_speaking_seed(lambda s: cosy_expected(tuple(text), s, stream=True), 5)
        start.update(ref_audio=h.clip_base64(), ref_text=h.ref_text, seed=seed)
    created, frames, done = _session(server, start, text)
    if model == "cosy" and isinstance(expected, MizuotoError):  # no seed speaks: upstream's stop, as a message
        assert done["type"] == "error" and "special token" in done["error"]["message"], done
        return
    assert created["type"] == "session.created" and created["stream_in"] is True
    assert done["type"] == "speech.audio.done" and done["chunks"] == len(frames) >= (1 if model == "cosy" else 2)
    samples = np.frombuffer(b"".join(frames), dtype="<i2")
    assert len(samples) / created["sample_rate"] == pytest.approx(done["seconds"])
    if model == "tone":
        assert done["seconds"] == pytest.approx(h.tone_seconds("".join(text)))
    else:  # not silence; a random-weight vocoder's loudness depends on the tree's weights
        assert np.sqrt(np.mean((samples / 32768) ** 2)) > (0.01 if model == "piper" else 0)
    if model == "cosy":
        assert b"".join(frames) == expected


@pytest.mark.parametrize("first, words", [
    ({"type": "input_text.append", "text": "hi"}, "session.start"),
    ({"type": "session.start", "model": "nope"}, "does not exist"),
    ({"type": "session.start", "model": "tone", "speed": 0}, "speed"),
    ({"type": "session.start", "model": "tone", "input": "no"}, "input_text.append"),
    ({"type": "session.start", "model": "tone", "stream_format": "sse"}, "no stream_format"),
    ({"type": "session.start", "model": "tone", "response_format": "wav"}, "'wav' is not supported"),
    (b"\x00binary", "binary frames"),
])
def test_bad_session(server, first, words):
    """A bad first message is answered with an error message (a 4xx body) and the socket closes with 1008."""
    from websockets.exceptions import ConnectionClosed

    with _ws(server) as ws:
        ws.send(first if isinstance(first, bytes) else json.dumps(first))
        error = json.loads(ws.recv(timeout=10))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert error["type"] == "error" and words in error["error"]["message"] and 400 <= error["error"]["code"] < 500
    assert ws.close_code == 1008


def test_bad_message_mid_session(server, h, client):
    """An unknown message mid-stream ends the session with an error and cancels its job."""
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.start", "model": "tone"}))
        json.loads(ws.recv(timeout=10))
        ws.send(json.dumps({"type": "input_text.append", "text": "abc"}))
        ws.send(json.dumps({"type": "bogus"}))
        msg = ws.recv(timeout=10)
        while isinstance(msg, bytes):
            msg = ws.recv(timeout=10)
    assert json.loads(msg)["type"] == "error" and "bogus" in json.loads(msg)["error"]["message"]
    h.wait_idle(client)


def test_client_leaves_mid_session(server, h, client):
    """A client that disconnects while text is still coming frees its job."""
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.start", "model": "slow"}))
        json.loads(ws.recv(timeout=10))
        ws.send(json.dumps({"type": "input_text.append", "text": "abcd" * 10}))
        ws.recv(timeout=10)
    h.wait_idle(client)


def test_a_text_feed_ends_its_wait_for_more_text_with_its_jobs_lease():
    """A session that sends no more text holds its job only until its lease (the job's) ends (cancel or deadline)."""
    from mizuoto.runtime.lease import Lease
    from mizuoto.server.jobs import Cancelled
    from mizuoto.server.jobs import TextFeed
    from mizuoto.testing.waits import cancel_during

    lease = Lease()
    feed = TextFeed(lease)
    feed.put("a piece")
    pieces = iter(feed)
    assert next(pieces) == "a piece"
    error, took = cancel_during(lambda: next(pieces), lease)
    assert isinstance(error, Cancelled) and took < 1.0


@pytest.mark.parametrize("cut", [lambda n: [n + 1], lambda n: [n // 2, n - n // 2 + 1]], ids=["one-piece", "in-all"])
def test_a_sessions_text_past_the_length_limit_ends_it_with_an_error(server, h, client, cut):
    """The limit holds for the whole text however it is cut: the piece that passes it ends the session (1008)."""
    from websockets.exceptions import ConnectionClosed

    limit = server.server.state.config.max_input_chars
    pieces = cut(limit)  # past the limit by one character in all
    with _ws(server) as ws:
        ws.send(json.dumps({"type": "session.start", "model": "tone"}))
        json.loads(ws.recv(timeout=10))
        for n in pieces:
            ws.send(json.dumps({"type": "input_text.append", "text": "a" * n}))
        msg = ws.recv(timeout=30)
        while isinstance(msg, bytes):  # audio of the first pieces may come before the error
            msg = ws.recv(timeout=30)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    error = json.loads(msg)["error"]
    assert error["code"] == 400 and error["param"] == "text", error
    assert f"has {sum(pieces)} characters; the limit is {limit}" in error["message"], error
    assert ws.close_code == 1008
    h.wait_idle(client)
