"""Limits and failures: 503 + Retry-After past --max-concurrent, deadlines, OOM, engine bugs, disconnects."""

import re
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


def _metric(c, name: str) -> float:
    """The value of one unlabelled metric on /metrics; a missing line fails."""
    found = re.findall(rf"^{re.escape(name)} (\S+)$", c.get("/metrics").text, flags=re.M)
    assert len(found) == 1, f"metric {name} appears {len(found)} times on /metrics"
    return float(found[0])


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    """Wait until `condition()` holds (an event, not a time bound: the timeout only stops a hang)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def no_deadline(tmp_path, h):
    """A server with one slow model (0.2 s per chunk), at most 2 jobs, no queue and no deadline."""
    s = h.start_server({"slow": h.write_slow_model(tmp_path / "slow", 0.2)},
                       ServerConfig(max_concurrent=2, max_queued=0, request_timeout=None, load_options={"device": "cpu"}))
    with httpx.Client(base_url=s.url, timeout=30) as c:
        yield c
    s.stop()


def test_over_the_limit_is_503(no_deadline, h):
    """With two streams holding both slots, a third request is refused with 503 and Retry-After.

    Event-based: the third request is made once both jobs hold their slots (two worker threads),
    and both still hold them when the refusal has come back. The model runs one request at a time,
    so the second stream waits for the first: together 20 chunks of 0.2 s, a margin of seconds.
    """
    c = no_deadline
    statuses = []
    threads = [threading.Thread(target=lambda: statuses.append(_post(c, "abcd" * 10, stream_format="audio")
                                                               .status_code)) for _ in range(2)]
    for t in threads:
        t.start()
    _wait_for(lambda: h.job_threads() == 2, "both streams to take their slot")
    r = _post(c, "ab")
    held = h.job_threads()
    ready = c.get("/ready").status_code
    assert r.status_code == 503 and held == 2 and not statuses, (r.status_code, held, statuses)
    assert r.headers["retry-after"] == "1" and "limit of 2" in r.json()["error"]["message"]
    assert ready == 503
    for t in threads:
        t.join()
    assert statuses == [200, 200]
    h.wait_idle(c)
    assert c.get("/ready").status_code == 200
    assert _post(c, "ab").status_code == 200


def test_deadline_is_504(slow, h):
    """A request that runs past the deadline gets 504 and its job is cancelled."""
    r = _post(slow, "abcd" * 12)  # 12 chunks x 0.2 s > 1.5 s
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
    h.wait_idle(slow)
    assert _metric(slow, "mizuoto_requests_cancelled_total") == 1


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


def test_disconnect_cancels_whole_request(no_deadline, h):
    """A client that leaves a non-streaming request has its job cancelled (no deadline: only the disconnect can)."""
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=str(no_deadline.base_url), timeout=0.3) as impatient:
            _post(impatient, "abcd" * 4)  # one chunk after 0.8 s
    h.wait_idle(no_deadline)
    assert _metric(no_deadline, "mizuoto_requests_cancelled_total") == 1


def test_disconnect_cancels_stream(no_deadline, h):
    """Closing a stream after its first piece cancels the job (no deadline); the model is free for the next request."""
    body = {"model": "slow", "input": "abcd" * 20, "voice": "low", "stream_format": "audio"}  # 20 chunks, 4 s
    with no_deadline.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    # wait_idle returns once no job runs; the counter says the stream was cancelled, not finished
    h.wait_idle(no_deadline)
    assert _metric(no_deadline, "mizuoto_requests_cancelled_total") == 1
    assert _post(no_deadline, "ab").status_code == 200


def test_a_stream_nobody_reads_gives_its_slot_back_at_the_deadline(tmp_path, h):
    """A client that opens a stream and never reads it holds its slot only until the request's deadline.

    A fast 48 kHz tone model speaks minutes of audio (tens of MB) at once: the socket's buffers fill,
    the response stops pulling chunks, and the worker waits for room in its output queue. That wait
    takes the job's lease, so the deadline ends it and frees the slot; before leases only the
    reader's pull applied the deadline, and the slot was held until the client closed.
    """
    deadline = 2.0
    s = h.start_server({"tone": h.write_model(tmp_path / "tone", sample_rate=48000)},
                       ServerConfig(max_concurrent=1, request_timeout=deadline, load_options={"device": "cpu"}))
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            body = {"model": "tone", "input": "abcd" * 1000, "voice": "low", "stream_format": "audio"}
            with c.stream("POST", "/v1/audio/speech", json=body) as r:
                assert r.status_code == 200
                started = time.monotonic()
                _wait_for(lambda: _metric(c, "mizuoto_requests_in_flight") == 0, "the slot to come back", timeout=15)
                assert time.monotonic() - started < deadline + 1.5  # never read, still open
                h.until(lambda: h.job_threads() == 0, "the worker to end", 5)
    finally:
        s.stop()
