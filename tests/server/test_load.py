"""A bounded load test on the shared server (8 running, 32 queued): 16 mixed requests at once, then 50 cancelled streams.

Both real engines take part: piper (its default voice) and CosyVoice (a fixture model cloning the
fixture clip, inline and by a registered voice id), beside the toy tone engines.
"""

import base64
import itertools
import json
import re
import threading

import httpx
import numpy as np
import pytest

PIPER_TEXT = "Load testing the server."
COSY_TEXT = "Many requests arrive at once."
# (model, text, stream_format) for the 16 requests: both engines, whole files, chunked audio and SSE.
MIX = [("cosy", COSY_TEXT, None), ("piper", PIPER_TEXT, None), ("slow", "abcdefgh", "audio"),
       ("piper", PIPER_TEXT, "sse"), ("cosy", COSY_TEXT, "sse"), ("tone", "abcdefghijkl", None),
       ("piper", PIPER_TEXT, "audio"), ("cosy", COSY_TEXT, "audio")] * 2
VOICE = "load-test"
# 50 cancelled streams, resident memory sampled after every 5. Measured 2026-12-01 on the 2-vCPU
# dev machine, three runs: least-squares slope 0.20, 0.35 and 0.37 MiB per 10 streams, from
# allocator steps of 0.7-1.7 MiB that come and go (no trend). A leak of 256 KiB per stream (less
# than one cancelled CosyVoice stream's audio), simulated in this test, measured 2.16: the bound is 2.
STREAMS, SAMPLE_EVERY = 50, 5
SLOPE_MIB_PER_10 = 2.0  # the fixture clip, registered for the second half of the cosy requests


def _cancelled(client) -> int:
    text = client.get("/metrics").text  # the client library writes 3 as 3.0
    return int(float(re.search(r"^mizuoto_requests_cancelled_total (\S+)$", text, re.M).group(1)))


def _pcm(r, stream) -> bytes:
    """The PCM16 samples of a wav response (whole file, chunked or SSE)."""
    if stream == "sse":
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        return b"".join(base64.b64decode(e["audio"]) for e in events[:-1])[44:]  # wav: the header rides first
    return r.content[44:]  # WAV header, then PCM16 (whole wav files are PCM16 too)


def _body(h, index, model, text, stream) -> dict:
    """A request of the mix; CosyVoice ones are seeded by their half of the mix, so their audio is known."""
    body = {"model": model, "input": text, "response_format": "wav"}
    if stream:
        body["stream_format"] = stream
    if model == "cosy":
        half = index // (len(MIX) // 2)
        body["seed"] = half
        body.update({"voice": VOICE} if half else {"ref_audio": h.clip_base64(), "ref_text": h.ref_text})
    return body


def _request(url, body, out, barrier):
    with httpx.Client(base_url=url, timeout=60) as c:
        barrier.wait()
        out.append((body, c.post("/v1/audio/speech", json=body)))


def _round(url, h) -> list:
    out, barrier = [], threading.Barrier(len(MIX))
    threads = [threading.Thread(target=_request, args=(url, _body(h, i, *m), out, barrier)) for i, m in enumerate(MIX)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.fixture
def registered(client, h):
    """The fixture clip as an uploaded voice, for the length of a test."""
    r = client.post("/v1/audio/voices", json={"id": VOICE, "audio": h.clip_base64(), "text": h.ref_text})
    assert r.status_code == 201, r.text
    yield VOICE
    assert client.delete(f"/v1/audio/voices/{VOICE}").status_code == 200


def _check(out, h, cosy_expected) -> dict:
    """Each answer is 200 with the full audio (the 8 past the running limit wait in the queue); successes per model."""
    assert len(out) == len(MIX)
    ok = {}
    for body, r in out:
        model, text, stream = body["model"], body["input"], body.get("stream_format")
        assert r.status_code == 200, (model, stream, r.status_code, r.text[:200])
        pcm = _pcm(r, stream)
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
        seconds = len(samples) / int(r.headers["x-sample-rate"])
        if model == "cosy":
            assert pcm == cosy_expected(text, body["seed"], stream is not None), (stream, body["seed"], seconds)
        elif model == "piper":
            assert np.sqrt(np.mean(samples ** 2)) > 0.01, "silent piper audio"
            assert len(text) / 25 < seconds < len(text) / 6, (stream, seconds)
        else:
            assert seconds == pytest.approx(h.tone_seconds(text)), (model, stream)
        ok[model] = ok.get(model, 0) + 1
    assert sum(ok.values()) == len(MIX), ok
    return ok


def test_sixteen_concurrent_mixed_in_a_fresh_process(tmp_path, h):
    """The 16-request rounds below, in a pytest process of its own.

    In the whole suite (3.2 GB resident by then) the second round once measured 67 MiB above the
    first (CI dry run, 2026-12-01); alone it grows 3-15 MiB. A fresh process measures this server only.
    """
    h.in_fresh_process(tmp_path, __file__, "test_sixteen_concurrent_mixed")


@pytest.mark.fresh_process
def test_sixteen_concurrent_mixed(server, client, h, cosy_expected, registered):
    """All 16 succeed (8 run, 8 wait in the queue) with the full audio; memory and jobs return to baseline.

    CosyVoice answers must equal the engine's own audio byte for byte (no crosstalk, nothing cut);
    piper's (unseedable) must be non-silent and of plausible length; the tone engines' exact.
    A first round warms the allocator and onnxruntime, so the baseline is taken after it. Resident
    memory is read after gc and malloc_trim. The server tunes glibc's malloc (fixed mmap threshold,
    two arenas): without that, fragmented arenas kept 50-230 MiB more resident after each round with
    no live allocation behind it; with it the growth was 3-15 MiB (live heap unchanged), hence the bound.
    """
    for half, stream in itertools.product((0, 1), (False, True)):
        cosy_expected(COSY_TEXT, half, stream)
    _check(_round(server.url, h), h, cosy_expected)  # warm-up round
    h.wait_idle(client)
    planned, rss = h.planned_memory(client), h.resident_bytes()
    _check(_round(server.url, h), h, cosy_expected)
    h.wait_idle(client)
    assert h.planned_memory(client) == planned
    assert h.resident_bytes() - rss < 64 << 20


def test_fifty_cancelled_streams_in_a_fresh_process(tmp_path, h):
    """The memory measurement below, in a pytest process of its own.

    In the whole suite the same 50 streams measured 5.4 MiB per 10 streams, alone 0.2-0.4.
    """
    h.in_fresh_process(tmp_path, __file__, "test_fifty_cancelled_streams_leave_no_growth")


@pytest.mark.fresh_process
def test_fifty_cancelled_streams_leave_no_growth(server, client, h):
    """Streams dropped after their first piece are cancelled (a tenth each of CosyVoice and piper, the rest toy).

    Each text runs well past its first chunks (CosyVoice's spans several segments), so every stream
    is cut mid-way; no job, slot or memory is left behind.
    """
    bodies = {"tone": {"input": "abcd" * 100, "voice": "low"},
              "piper": {"input": "A sentence of the cancelled stream. " * 8},
              "cosy": {"input": "A sentence of the cancelled stream. " * 12, "ref_audio": h.clip_base64(),
                       "ref_text": h.ref_text, "seed": 0}}
    order = itertools.cycle(["cosy"] + ["tone"] * 4 + ["piper"] + ["tone"] * 4)

    def one():
        model = next(order)
        with client.stream("POST", "/v1/audio/speech", json={"model": model, **bodies[model],
                                                             "stream_format": "audio"}) as r:
            assert r.status_code == 200
            next(r.iter_raw())

    # warm-up with the measured mix itself, so allocator pools and first-use caches are in place
    for _ in range(50):
        one()
    h.wait_idle(client)
    before, planned, rss = _cancelled(client), h.planned_memory(client), h.resident_bytes()
    done, steps = [0], [0.0]  # streams so far, resident MiB above the baseline after them
    for i in range(STREAMS):
        one()
        if i % SAMPLE_EVERY == SAMPLE_EVERY - 1:
            h.wait_idle(client)
            done.append(i + 1)
            steps.append((h.resident_bytes() - rss) / 2**20)
    assert _cancelled(client) - before == STREAMS
    assert h.planned_memory(client) == planned
    slope = float(np.polyfit(done, steps, 1)[0]) * 10  # least squares, MiB per 10 streams
    assert slope < SLOPE_MIB_PER_10, (f"resident memory grows {slope:.2f} MiB per 10 cancelled streams "
                                      f"(MiB after each {SAMPLE_EVERY}: {[round(x, 1) for x in steps]})")
    for model in bodies:
        assert client.post("/v1/audio/speech", json={"model": model, **bodies[model], "input": "ab"}).status_code == 200
