"""A bounded load test on the shared server (max 8 concurrent): 16 mixed requests at once, then 50 cancelled streams."""

import base64
import json
import re
import threading

import httpx
import numpy as np
import pytest

PIPER_TEXT = "Load testing the server."
# (model, text, stream_format) for the 16 requests: both engines, whole files, chunked audio and SSE.
MIX = [("tone", "abcdefgh", None), ("piper", PIPER_TEXT, None), ("slow", "abcdefgh", "audio"),
       ("piper", PIPER_TEXT, "sse"), ("tone", "abcdefghijkl", "sse"), ("slow", "abcd", None),
       ("piper", PIPER_TEXT, "audio"), ("tone", "abcdefghijklmnop", "audio")] * 2


def _cancelled(client) -> int:
    return int(re.search(r"^mizuoto_requests_cancelled_total (\d+)$", client.get("/metrics").text, re.M).group(1))


def _seconds(r, model, stream) -> float:
    rate = int(r.headers["x-sample-rate"])
    if stream == "sse":
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done"
        pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])[44:]  # wav: the header rides first
    else:
        pcm = r.content[44:]  # WAV header, then PCM16 (whole wav files are PCM16 too)
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
    if model == "piper":
        assert np.sqrt(np.mean(samples ** 2)) > 0.01, "silent piper audio"
    return len(samples) / rate


def _request(url, model, text, stream, out, barrier):
    body = {"model": model, "input": text, "response_format": "wav"}
    if stream:
        body["stream_format"] = stream
    with httpx.Client(base_url=url, timeout=60) as c:
        barrier.wait()
        out.append((model, text, stream, c.post("/v1/audio/speech", json=body)))


def _round(url) -> list:
    out, barrier = [], threading.Barrier(len(MIX))
    threads = [threading.Thread(target=_request, args=(url, *m, out, barrier)) for m in MIX]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_sixteen_concurrent_mixed(server, client, h):
    """All 16 succeed or get 503 + Retry-After; successes carry the full audio; memory and jobs return to baseline.

    A first round warms the allocator and onnxruntime, so the baseline is taken after it. Resident
    memory is read after malloc_trim; from round to round it still moves by up to ~75 MiB on this
    mix (piper's decoder activations in per-thread malloc arenas), without a trend, hence the bound.
    """
    assert {r.status_code for *_, r in _round(server.url)} <= {200, 503}
    h.wait_idle(client)
    planned, rss = h.planned_memory(client), h.resident_bytes()
    out = _round(server.url)
    assert len(out) == 16
    ok = 0
    for model, text, stream, r in out:
        assert r.status_code in (200, 503), (model, stream, r.status_code, r.text[:200])
        if r.status_code == 503:
            assert r.headers["retry-after"] and "limit" in r.json()["error"]["message"]
            continue
        ok += 1
        seconds = _seconds(r, model, stream)
        if model == "piper":
            assert len(text) / 25 < seconds < len(text) / 6, (stream, seconds)
        else:
            assert seconds == pytest.approx(h.tone_seconds(text)), (model, stream)
    assert ok >= 8
    h.wait_idle(client)
    assert h.planned_memory(client) == planned
    assert h.resident_bytes() - rss < 128 << 20


def test_fifty_cancelled_streams_leave_no_growth(server, client, h):
    """Streams dropped after their first piece are cancelled; no job, slot or memory is left behind."""
    def one():
        with client.stream("POST", "/v1/audio/speech", json={"model": "tone", "input": "abcd" * 100, "voice": "low",
                                                             "stream_format": "audio"}) as r:
            assert r.status_code == 200
            next(r.iter_raw())

    for _ in range(5):  # warm-up
        one()
    h.wait_idle(client)
    before, planned, rss = _cancelled(client), h.planned_memory(client), h.resident_bytes()
    for _ in range(50):
        one()
    h.wait_idle(client)
    assert _cancelled(client) - before == 50
    assert h.planned_memory(client) == planned
    assert h.resident_bytes() - rss < 32 << 20
    assert client.post("/v1/audio/speech", json={"model": "tone", "input": "ab"}).status_code == 200
