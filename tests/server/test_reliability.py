"""Limits and failures: 503 + Retry-After past --max-concurrent, deadlines, OOM, engine bugs, disconnects."""

import threading
import time

import httpx
import pytest

from mizuoto.server.state import ServerConfig


@pytest.fixture
def slow(tmp_path, h):
    """A server with one slow model (0.2 s per chunk of 4 notes), at most 2 jobs, a 1.5 s deadline."""
    s = h.start_server({"slow": h.write_slow_model(tmp_path / "slow", 0.2)},
                       ServerConfig(max_concurrent=2, request_timeout=1.5, load_options={"device": "cpu"}))
    with httpx.Client(base_url=s.url, timeout=30) as c:
        yield c
    s.stop()


def _post(c, text, **extra):
    return c.post("/v1/audio/speech", json={"model": "slow", "input": text, "voice": "low", **extra})


def test_over_the_limit_is_503(slow, h):
    """With two streams holding both slots, a third request is refused at once with 503 and Retry-After."""
    long = "abcdefgh" * 2  # 4 chunks -> 0.8 s, inside the 1.5 s deadline
    statuses = []
    threads = [threading.Thread(target=lambda: statuses.append(_post(slow, long, stream_format="audio").status_code))
               for _ in range(2)]
    for t in threads:
        t.start()
    end = time.monotonic() + 5
    while h.job_threads() < 2 and time.monotonic() < end:
        time.sleep(0.01)
    start = time.monotonic()
    r = _post(slow, "ab")
    assert r.status_code == 503 and time.monotonic() - start < 0.7  # refused, not queued behind 0.8 s streams
    assert r.headers["retry-after"] == "1" and "limit of 2" in r.json()["error"]["message"]
    assert slow.get("/ready").status_code == 503
    for t in threads:
        t.join()
    assert statuses == [200, 200]
    h.wait_idle(slow)
    assert _post(slow, "ab").status_code == 200


def test_deadline_is_504(slow, h):
    """A request that runs past the deadline gets 504 and its job is cancelled."""
    r = _post(slow, "abcd" * 12)  # 12 chunks x 0.2 s > 1.5 s
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
    h.wait_idle(slow)
    assert "mizuoto_requests_cancelled_total 0" not in slow.get("/metrics").text


def test_out_of_memory_is_507_and_server_serves(slow, h):
    """An allocation failure inside the engine fails that request only."""
    r = _post(slow, "OOM please")
    assert r.status_code == 507 and "out of memory" in r.json()["error"]["message"]
    assert _post(slow, "ab").status_code == 200


def test_engine_bug_is_500_and_server_serves(slow):
    """An unexpected engine exception is a 500 that says little; the next request works."""
    r = _post(slow, "CRASH")
    assert r.status_code == 500 and "internal error" in r.json()["error"]["message"]
    assert _post(slow, "ab").status_code == 200


def test_disconnect_cancels_whole_request(slow, h):
    """A client that leaves a non-streaming request has its job cancelled (it ends with its one chunk)."""
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=str(slow.base_url), timeout=0.3) as impatient:
            _post(impatient, "abcd" * 4)  # one chunk after 0.8 s
    h.wait_idle(slow, timeout=3)
    assert "mizuoto_requests_cancelled_total 1" in slow.get("/metrics").text


def test_disconnect_cancels_stream(slow, h):
    """Closing a stream after its first piece cancels the job; the model is free for the next request."""
    with slow.stream("POST", "/v1/audio/speech", json={"model": "slow", "input": "abcd" * 20, "voice": "low",
                                                       "stream_format": "audio"}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    h.wait_idle(slow, timeout=3)
    start = time.monotonic()
    assert _post(slow, "ab").status_code == 200 and time.monotonic() - start < 2.0
