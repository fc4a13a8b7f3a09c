"""One server hosting CosyVoice 2, Chatterbox and Piper under a host budget that holds two of them at once: the
largest at work beside either other's weights, not beside both.

Mixed requests at once are all served; the planner evicts to admit them (counted by the metrics);
each answer equals the same request sent alone (every request is seeded, so every engine is
deterministic). The Chatterbox directory is one of the repository plugins' fixture models that
the chatterbox engine detects.
"""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import httpx
import pytest

from mizuoto.runtime.api import Runtime
from mizuoto.server.state import ServerConfig

PLUGIN_MODELS = Path(__file__).resolve().parents[2] / "plugins"
TEXT = "Three engines share one budget."


def _chatterbox_dir() -> Path:
    with Runtime() as rt:
        for d in sorted(PLUGIN_MODELS.glob("*/tests/fixtures/models/*")):
            if any(engine == "chatterbox" for engine, _ in rt.detect(d)):
                return d
    raise AssertionError(f"no Chatterbox model dir under {PLUGIN_MODELS}/*/tests/fixtures/models")


def _evictions(c: httpx.Client) -> float:
    found = re.search(r"^mizuoto_model_evictions_total (\S+)$", c.get("/metrics").text, re.M)
    assert found, "the metrics list no eviction counter"
    return float(found.group(1))


@pytest.fixture(scope="module")
def three(served_dirs, h):
    dirs = {"cosy": served_dirs["cosy"], "piper": served_dirs["piper"], "chatterbox": _chatterbox_dir()}
    with h.make_runtime() as rt:
        plans = {name: rt.plan(rt.load(d, name=name, device="cpu")) for name, d in dirs.items()}
    # the largest model at work beside either other one's weights fits, beside both it does not
    big = max(plans, key=lambda n: plans[n].peak)
    budget = plans[big].peak + sum(p.movable + p.fixed for n, p in plans.items() if n != big) - 1
    s = h.start_server(dirs, ServerConfig(load_options={"device": "cpu"}, max_concurrent=6, request_timeout=300),
                       ram=budget)
    with httpx.Client(base_url=s.url, timeout=300, headers=h.admin) as c:
        yield c
    s.stop()


def _bodies(h) -> list[dict]:
    return [{"model": "cosy", "input": TEXT, "seed": 3, "ref_audio": h.clip_base64(), "ref_text": h.ref_text},
            {"model": "piper", "input": TEXT, "seed": 3},
            {"model": "chatterbox", "input": TEXT, "seed": 3, "options": {"temperature": 0.7}},
            {"model": "cosy", "input": TEXT, "seed": 4, "ref_audio": h.clip_base64(), "ref_text": h.ref_text},
            {"model": "piper", "input": TEXT + " Again.", "seed": 4},
            {"model": "chatterbox", "input": TEXT + " Again.", "seed": 4}]


def test_mixed_requests_at_once_are_served_and_equal_each_alone(three, h):
    c = three
    bodies = _bodies(h)
    alone = []
    start = _evictions(c)
    for body in bodies:
        r = c.post("/v1/audio/speech", json=body)
        assert r.status_code == 200, r.text
        alone.append(r.content)
    with concurrent.futures.ThreadPoolExecutor(len(bodies) * 2) as pool:
        answers = list(pool.map(lambda body: c.post("/v1/audio/speech", json=body), bodies * 2))
    for i, r in enumerate(answers):
        assert r.status_code == 200, (bodies[i % len(bodies)]["model"], r.text)
        assert r.content == alone[i % len(bodies)], f"{bodies[i % len(bodies)]['model']} differs from alone"
    assert _evictions(c) > start, "three models in a budget of two: admitting them must evict"
    h.wait_idle(c)
