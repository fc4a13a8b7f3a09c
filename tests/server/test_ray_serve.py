"""Ray Serve: a real local Ray (one node, 2 CPUs, 127.0.0.1) started and stopped by the test, called over HTTP.

CosyVoice and Piper are served from one replica that holds one model at a time (@serve.multiplexed
LRU); the queue bound in front of it answers 503 + Retry-After.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from mizuoto.errors import InvalidRequest
from mizuoto.server.launch import free_port
from mizuoto.server.ray_serve import RayConfig, read_config

REPO = Path(__file__).resolve().parents[2]
START_SECONDS = 150


@pytest.fixture(scope="module")
def ray_server(served_dirs, tmp_path_factory):
    """`mizuoto ray-serve config.yaml` in a child process: its URL; SIGTERM at the end, and it must exit."""
    tmp = tmp_path_factory.mktemp("ray")
    port = free_port()
    config = {"models": {"cosy": str(served_dirs["cosy"]), "piper": str(served_dirs["piper"])},
              "replicas": 1, "models_per_replica": 1, "max_ongoing_requests": 1, "max_queued_requests": 1,
              "retry_after": 2, "num_cpus": 2, "cluster_cpus": 2, "port": port, "options": {"device": "cpu"}}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    ready = tmp / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "MIZUOTO_HOME": str(tmp / "home"), "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp / "ray.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mizuoto.cli", "ray-serve", str(tmp / "config.yaml"),
                             "--ready-file", str(ready)], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_SECONDS
        while not ready.exists():
            assert proc.poll() is None, (tmp / "ray.log").read_text()[-3000:]
            assert time.monotonic() < deadline, \
                "Ray Serve did not start in time:\n" + (tmp / "ray.log").read_text()[-3000:]
            time.sleep(0.5)
        assert ready.read_text() == f"http://127.0.0.1:{port}"
        yield ready.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
        finally:
            log.close()
    assert code == 0, (tmp / "ray.log").read_text()[-3000:]


def _loaded(url: str) -> set:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"] if m["loaded"]}


def test_both_engines_from_a_replica(ray_server, cosy_expected, served_dirs, h):
    """Piper and CosyVoice answer over Ray's HTTP proxy as `mizuoto serve` does; one model per replica at a time."""
    from mizuoto.runtime.api import Runtime
    from mizuoto.server.audio import pcm16

    r = httpx.post(f"{ray_server}/v1/audio/speech", timeout=120,
                   json={"model": "piper", "input": "Hello from Ray.", "response_format": "pcm", "seed": 4})
    assert r.status_code == 200, r.text
    with Runtime() as rt:
        name = rt.load(served_dirs["piper"])
        voice = rt.voices(name)[0].id
        assert r.content == b"".join(pcm16(c.samples) for c in rt.synthesize(name, "Hello from Ray.", voice=voice,
                                                                                 seed=4))
    assert _loaded(ray_server) == {"piper"}
    with httpx.stream("POST", f"{ray_server}/v1/audio/speech", timeout=120,
                      json={"model": "piper", "input": "One. Two.", "response_format": "pcm", "seed": 4,
                            "stream_format": "audio"}) as streamed:
        assert streamed.status_code == 200
        pieces = [p for p in streamed.iter_raw() if p]
    assert len(b"".join(pieces)) > 0
    text, seed = "Ray serves this clone.", 3
    r = httpx.post(f"{ray_server}/v1/audio/speech", timeout=120,
                   json={"model": "cosy", "input": text, "seed": seed, "response_format": "pcm",
                         "ref_audio": h.clip_base64(), "ref_text": h.ref_text})
    assert r.status_code == 200, r.text
    assert r.content == cosy_expected(text, seed)
    assert _loaded(ray_server) == {"cosy"}  # the LRU of one model per replica unloaded piper
    r = httpx.post(f"{ray_server}/v1/audio/speech", json={"model": "nope", "input": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_503_past_the_queue_bound(ray_server, h):
    """One request running and one queued: the others are refused at once with 503 and Retry-After."""
    body = {"model": "cosy", "input": "A longer sentence keeps the replica busy for a while, on purpose. " * 3,
            "seed": 1, "response_format": "pcm", "ref_audio": h.clip_base64(), "ref_text": h.ref_text}
    results, barrier = [], threading.Barrier(6)

    def call():
        barrier.wait()
        r = httpx.post(f"{ray_server}/v1/audio/speech", json=body, timeout=180)
        results.append((r.status_code, r.headers.get("retry-after")))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    codes = sorted(c for c, _ in results)
    assert len(results) == 6 and 200 in codes and 503 in codes, results
    assert all(after == "2" for code, after in results if code == 503), results
    assert codes.count(200) <= 4, results  # with one slot and one queue place, most arrivals are refused


def test_config_is_checked(tmp_path):
    """A config with an unknown key or a bad bound is one clear line, before Ray starts."""
    (tmp_path / "c.yaml").write_text("models: {a: /x}\nreplica: 2\n")
    with pytest.raises(InvalidRequest, match="unknown setting 'replica'"):
        read_config(tmp_path / "c.yaml")
    with pytest.raises(InvalidRequest, match="max_ongoing_requests must be a positive integer"):
        RayConfig.from_dict({"models": {"a": "/x"}, "max_ongoing_requests": 0})
    with pytest.raises(InvalidRequest, match="'models' must map"):
        RayConfig.from_dict({"models": []})
    r = subprocess.run([sys.executable, "-m", "mizuoto.cli", "ray-serve", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown setting 'replica'" in r.stderr, r.stderr
