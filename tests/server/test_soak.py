"""A soak: two real engines under a memory budget that holds only one of them, batched, 127.0.0.1 only.

32 mixed requests at once (CosyVoice batched two wide, and piper; whole files, chunked audio and
SSE), then 100 streams cancelled after their first piece. Every request must be a 200 with its full
audio (a request whose model was evicted waits for the memory, and loads it again); afterwards no
job, LM row or batch loop thread is left, no KV row is held, and resident memory is back near its
baseline. Bounded: 8 jobs at once, every client with a timeout.
"""

import base64
import itertools
import json
import re
import threading

import httpx
import numpy as np
import pytest

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import SynthesisRequest
from mizuoto.server.state import ServerConfig

WIDTH = 2  # CosyVoice's LM batch
SHORT = "A soak of many requests at once."
LONG = "A sentence of a long streamed request. " * 5
PIPER_TEXT = "Soaking the server with requests."
# (model, text, stream_format): CosyVoice's long streams need the memory piper holds
COSY_MIX = [("cosy", LONG, "audio"), ("cosy", LONG, "sse"), ("cosy", SHORT, None), ("cosy", SHORT, "audio")]
PIPER_MIX = [("piper", PIPER_TEXT, fmt) for fmt in (None, "audio", "sse", None)]
MIX = (COSY_MIX + PIPER_MIX) * 4
CANCELLED = 100
RSS_SLACK = 192 << 20  # models are unloaded and loaded again on every eviction: allocator pools settle high


def _budget(served_dirs, h) -> int:
    """A RAM budget that holds CosyVoice's long stream or piper, but not both: their requests evict each other."""
    import base64

    from mizuoto.runtime.engine import Reference, check_request
    from mizuoto.server.audio import decode_reference

    ref = Reference(decode_reference(base64.b64decode(h.clip_base64()), "ref_audio"), h.ref_text)
    with Runtime(ram="64GiB") as rt:
        cosy = rt.load(served_dirs["cosy"], compute={"batch": WIDTH})
        piper = rt.load(served_dirs["piper"])
        bounds = [rt.plan(n, stream=s).peak for n in (cosy, piper) for s in (False, True)]
        longest = check_request(SynthesisRequest(LONG, voice=ref, stream=True), rt.model(cosy))
        need = rt.memory.plan_for(rt._get(cosy), longest).peak  # what that request's turn admits
    budget = max(need, *bounds) + (1 << 20)
    # a long stream cannot be admitted beside piper's plan: requests of one evict the other
    assert need + min(bounds[2:]) > budget, "the budget must not hold a long stream beside piper"
    return budget


@pytest.fixture(scope="module")
def soak(served_dirs, h):
    config = ServerConfig(max_concurrent=8, max_queued=64, request_timeout=600,
                          load_options={"device": "cpu", "compute": {"batch": WIDTH}})
    server = h.start_server({"cosy": served_dirs["cosy"], "piper": served_dirs["piper"]}, config,
                            ram=_budget(served_dirs, h))
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield server, client
    server.stop()


def _body(h, model: str, text: str, fmt: str | None, seed: int = 0) -> dict:
    body = {"model": model, "input": text, "response_format": "wav"}
    if fmt:
        body["stream_format"] = fmt
    if model == "cosy":
        body.update({"seed": seed, "ref_audio": h.clip_base64(), "ref_text": h.ref_text})
    return body


def _pcm(r, fmt) -> bytes:
    if fmt == "sse":
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        return b"".join(base64.b64decode(e["audio"]) for e in events[:-1])[44:]
    return r.content[44:]


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _evictions(client) -> int:
    text = client.get("/metrics").text  # the client library writes 3 as 3.0
    return int(float(re.search(r"^mizuoto_model_evictions_total (\S+)$", text, re.M).group(1)))


def _quiet(client, h) -> None:
    """No job, no LM row, at most one batch loop per loaded model, no request on any model."""
    h.wait_idle(client, timeout=60)
    assert _threads("mizuoto-job") == 0
    h.until(lambda: _threads("mizuoto-cosy-row") == 0, "LM rows to end")
    assert _threads("mizuoto-cosy-batch") <= 1
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("mizuoto_batch_occupancy{"):
            assert float(line.rsplit(" ", 1)[1]) == 0, line


def test_mixed_requests_and_cancelled_streams_under_eviction(soak, h):
    server, client = soak
    # what each CosyVoice request gives alone (seeded: it must not depend on the load)
    alone = {}
    for (_, text, fmt), seed in itertools.product(COSY_MIX, (0, 1)):
        r = client.post("/v1/audio/speech", json=_body(h, "cosy", text, fmt, seed))
        assert r.status_code == 200, r.text
        alone[text, fmt, seed] = _pcm(r, fmt)
    _quiet(client, h)
    rss = h.resident_bytes()
    evicted = _evictions(client)

    out, barrier = [], threading.Barrier(len(MIX))

    def run(i, model, text, fmt):
        body = _body(h, model, text, fmt, seed=i % 2)
        with httpx.Client(base_url=server.url, timeout=600) as c:
            barrier.wait()
            out.append((body, fmt, c.post("/v1/audio/speech", json=body)))

    threads = [threading.Thread(target=run, args=(i, *m)) for i, m in enumerate(MIX)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert len(out) == len(MIX)
    for body, fmt, r in out:
        assert r.status_code == 200, (body["model"], fmt, r.status_code, r.text[:300])
        pcm = _pcm(r, fmt)
        if body["model"] == "cosy":
            assert pcm == alone[body["input"], fmt, body["seed"]], (fmt, body["seed"], len(pcm))
        else:
            samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
            seconds = len(samples) / int(r.headers["x-sample-rate"])
            assert np.sqrt(np.mean(samples ** 2)) > 0.01 and len(PIPER_TEXT) / 25 < seconds < len(PIPER_TEXT) / 6, seconds
    assert _evictions(client) > evicted, "the budget never forced an eviction"
    _quiet(client, h)

    cancelled_before = _cancelled(client)
    for i in range(CANCELLED):
        model = ("cosy", "piper")[i % 2]
        with client.stream("POST", "/v1/audio/speech", json=_body(h, model, LONG, "audio", seed=i)) as r:
            assert r.status_code == 200, r.read()[:300]
            next(r.iter_raw())
    h.until(lambda: _cancelled(client) - cancelled_before == CANCELLED, "every dropped stream to be cancelled")
    _quiet(client, h)
    grown = h.resident_bytes() - rss
    assert grown < RSS_SLACK, f"resident memory grew {grown / 2**20:.0f} MiB over the soak"
    for model in ("cosy", "piper"):  # still serving
        assert client.post("/v1/audio/speech", json=_body(h, model, SHORT, None)).status_code == 200


def _cancelled(client) -> int:
    text = client.get("/metrics").text  # the client library writes 3 as 3.0
    return int(float(re.search(r"^mizuoto_requests_cancelled_total (\S+)$", text, re.M).group(1)))
