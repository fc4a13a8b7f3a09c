"""The queue in front of the job slots: FIFO waiting with the defaults, 503 + Retry-After past its bound or timeout.

Event-based: the 'gate' model holds its requests until the test opens the gate, and the test reads
the queue depth from /metrics before each next step, so nothing depends on how fast the machine is.
"""

import re
import threading
import time

import httpx
import pytest

from mizuoto.server.state import ServerConfig

COSY_TEXT = "Sixteen clients arrive at once."


def _metric(client, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", client.get("/metrics").text, re.M).group(1))


def _until(check, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _post(url: str, body: dict, out: list, barrier: threading.Barrier | None = None) -> threading.Thread:
    def run():
        with httpx.Client(base_url=url, timeout=120) as c:
            if barrier is not None:
                barrier.wait()
            out.append((body, c.post("/v1/audio/speech", json=body)))
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.fixture
def gated(h, tmp_path, request):
    """A server of one 'gate' model with the config the test gives (indirect), and a client of it."""
    gate = h.new_gate()
    s = h.start_server({"gate": h.write_gate_model(tmp_path / "gate")}, request.param)
    with httpx.Client(base_url=s.url, timeout=30) as c:
        yield s, c, gate
    gate.open.set()
    s.stop()


def _body(text: str) -> dict:
    return {"model": "gate", "input": text, "voice": "low", "response_format": "wav"}


@pytest.mark.parametrize("gated", [ServerConfig(max_concurrent=1, max_queued=3)], indirect=True)
def test_queued_requests_run_first_come_first_served(gated, h):
    server, c, gate = gated
    out, threads = [], [_post(server.url, _body("abcd"), [])]
    assert gate.entered.acquire(timeout=20), "the first request never reached the model"
    for i, text in enumerate(["bb", "ccc", "dddd"]):
        threads.append(_post(server.url, _body(text), out))
        _until(lambda: _metric(c, "mizuoto_queue_depth") == i + 1, f"{i + 1} queued")
    assert _metric(c, "mizuoto_requests_in_flight") == 1 and _metric(c, 'mizuoto_batch_occupancy{model="gate"}') == 1
    gate.open.set()
    for t in threads:
        t.join(30)
    assert gate.texts == ["abcd", "bb", "ccc", "dddd"]
    assert [r.status_code for _, r in out] == [200] * 3
    for body, r in out:
        audio, rate = h.read_audio(r.content)
        assert len(audio) / rate == pytest.approx(h.tone_seconds(body["input"]))
    assert _metric(c, "mizuoto_queue_depth") == 0
    assert _metric(c, "mizuoto_queue_wait_seconds_count") == 4


@pytest.mark.parametrize("gated", [ServerConfig(max_concurrent=1, max_queued=1)], indirect=True)
def test_past_the_queue_bound_is_503_with_retry_after(gated):
    server, c, gate = gated
    out = []
    threads = [_post(server.url, _body("abcd"), out)]
    assert gate.entered.acquire(timeout=20)
    threads.append(_post(server.url, _body("ab"), out))
    _until(lambda: _metric(c, "mizuoto_queue_depth") == 1, "the second request to queue")
    r = c.post("/v1/audio/speech", json=_body("ab"))
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "limit of 1 concurrent requests and 1 queued" in r.json()["error"]["message"]
    assert c.get("/ready").status_code == 503
    gate.open.set()
    for t in threads:
        t.join(30)
    assert [r.status_code for _, r in out] == [200, 200]
    assert c.get("/ready").status_code == 200


@pytest.mark.parametrize("gated", [ServerConfig(max_concurrent=1, queue_timeout=0.5)], indirect=True)
def test_a_request_that_waits_past_the_queue_timeout_is_503(gated, h):
    server, c, gate = gated
    out = []
    holder = _post(server.url, _body("abcd"), out)
    assert gate.entered.acquire(timeout=20)
    r = c.post("/v1/audio/speech", json=_body("ab"))  # waits 0.5 s in line behind the held request
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "in the queue" in r.json()["error"]["message"]
    assert _metric(c, "mizuoto_queue_depth") == 0
    gate.open.set()
    holder.join(30)
    assert [r.status_code for _, r in out] == [200]
    assert gate.texts == ["abcd"], "the timed-out request never reached the model"
    h.wait_idle(c)
    assert c.post("/v1/audio/speech", json=_body("ab")).status_code == 200


def test_sixteen_simultaneous_cosyvoice_requests_all_succeed_with_the_defaults(h, served_dirs, cosy_expected):
    """16 clients at once against the default limits: all 200, each with the engine's own full audio."""
    for seed in (0, 1):
        cosy_expected(COSY_TEXT, seed, False)
    server = h.start_server({"cosy": served_dirs["cosy"]}, ServerConfig())
    try:
        out, barrier = [], threading.Barrier(16)
        bodies = [{"model": "cosy", "input": COSY_TEXT, "response_format": "wav", "seed": i % 2,
                   "ref_audio": h.clip_base64(), "ref_text": h.ref_text} for i in range(16)]
        threads = [_post(server.url, b, out, barrier) for b in bodies]
        for t in threads:
            t.join(300)
        assert sorted(r.status_code for _, r in out) == [200] * 16, [r.text[:200] for _, r in out]
        for body, r in out:
            assert r.content[44:] == cosy_expected(COSY_TEXT, body["seed"], False)
        with httpx.Client(base_url=server.url) as c:
            assert _metric(c, "mizuoto_queue_wait_seconds_count") == 16
            assert _metric(c, "mizuoto_max_concurrent") == 4 and _metric(c, "mizuoto_max_queued") == 32
    finally:
        server.stop()


def test_sixteen_simultaneous_requests_batched_give_what_each_gives_alone(h, served_dirs):
    """--max-batch 8: 16 clients at once share the LM's steps, 8 at a time; each response equals that
    request run alone on the same server (a seeded request does not depend on the load)."""
    config = ServerConfig(max_concurrent=8, load_options={"compute": {"batch": 8}})
    server = h.start_server({"cosy": served_dirs["cosy"]}, config)
    try:
        texts = [COSY_TEXT, "A second, longer sentence for the batch to carry along.", "Short one."]
        bodies = [{"model": "cosy", "input": texts[i % 3], "response_format": "wav", "seed": i % 5,
                   "ref_audio": h.clip_base64(), "ref_text": h.ref_text} for i in range(16)]
        alone = {}
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for b in bodies:
                key = (b["input"], b["seed"])
                if key not in alone:
                    r = c.post("/v1/audio/speech", json=b)
                    assert r.status_code == 200, r.text
                    alone[key] = r.content
        out, barrier = [], threading.Barrier(16)
        threads = [_post(server.url, b, out, barrier) for b in bodies]
        for t in threads:
            t.join(300)
        assert sorted(r.status_code for _, r in out) == [200] * 16, [r.text[:200] for _, r in out]
        for body, r in out:
            assert r.content == alone[body["input"], body["seed"]], (body["input"], body["seed"])
        with httpx.Client(base_url=server.url) as c:
            assert _metric(c, 'mizuoto_batch_width{model="cosy"}') == 8
            assert _metric(c, 'mizuoto_batch_occupancy{model="cosy"}') == 0
    finally:
        server.stop()
