"""The request context under stress: 64 requests over two batched CosyVoice models whose budget holds one.

Each round sends 64 requests at once (16 run, the rest queue) to two models at `compute.batch=8`
whose memory budget holds one of them, so they evict each other; a third of the clients leave
at seeded random points of their stream. Every request that completes must equal the same
request sent alone, byte for byte (or fail alone as it fails here); nothing may hang; threads,
batch rows and slots return to their baseline after each round; resident memory stays bounded.
"""

import random
import threading

import httpx
import pytest

from mizuoto.server.state import ServerConfig
from mizuoto.testing import variation
from mizuoto.testing.cosyvoice_cases import assemble_model_dir, first_speaking_seed

ROUNDS, REQUESTS, WIDTH, RUNNING = 3, 64, 8, 16
TEXTS = (variation.text("Many clients arrive at once."), variation.text("The budget holds one model only."))
LEAVE_EVERY = 3  # a third of the clients leave mid-stream
# Resident memory after the third round against after the first, after gc and malloc_trim: every
# round loads and closes the two models several times over; the bound is about one tiny model's
# weights and caches allocated twice, far below what a model or a request leaked per round would add.
RSS_BOUND = 160 << 20
REQUEST_S = 240.0  # a client's own bound: a request past it is a hang


def test_stress_in_a_fresh_process(tmp_path, h):
    """The stress rounds below, in a pytest process of its own (threads and memory measured there alone)."""
    h.in_fresh_process(tmp_path, __file__, "test_two_batched_models_evicting_each_other_under_load")


def _budget(model_dir) -> int:
    """A host budget that holds one of the models (its plan for any request) but not two."""
    from mizuoto.runtime.api import Runtime

    with Runtime(plugins=True, voices=False) as rt:
        peak = rt.plan(rt.load(model_dir, **{"compute.batch": WIDTH})).peak
    return peak + peak // 2


def _threads(prefix: str = "mizuoto-") -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefix))


def _body(h, model, text, seed, stream) -> dict:
    body = {"model": model, "input": text, "seed": seed, "response_format": "wav",
            "ref_audio": h.clip_base64(), "ref_text": h.ref_text}
    if stream:
        body["stream_format"] = "audio"
    return body


def _send(url, body, leave_after: int | None) -> tuple[int, bytes] | None:
    """(status, body) of a request; None for a client that leaves after `leave_after` pieces of its stream."""
    with httpx.Client(base_url=url, timeout=REQUEST_S) as c:
        if leave_after is None:
            r = c.post("/v1/audio/speech", json=body)
            return r.status_code, r.content
        with c.stream("POST", "/v1/audio/speech", json=body) as r:
            for i, _ in enumerate(r.iter_raw()):
                if i >= leave_after:
                    break
        return None


def _metric(client, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")]


@pytest.mark.fresh_process
def test_two_batched_models_evicting_each_other_under_load(tmp_path, h):
    dirs = {name: assemble_model_dir(h.cosyvoice2_dir(), tmp_path / name) for name in ("a", "b")}
    config = ServerConfig(max_concurrent=RUNNING, max_queued=REQUESTS, request_timeout=REQUEST_S,
                          queue_timeout=REQUEST_S, load_options={"compute.batch": WIDTH})
    server = h.start_server(dirs, config, ram=_budget(dirs["a"]))
    try:
        with httpx.Client(base_url=server.url, timeout=REQUEST_S) as client:
            # alone: each distinct request once, nothing beside it; its seeds start at one whose request
            # speaks (a random-weight LM may stop at once for a seed)
            first, _ = first_speaking_seed(
                lambda s: _send(server.url, _body(h, "a", TEXTS[0], s, False), None)[0] == 200, variation.seed(0))
            kinds = [(m, t, s, st) for m in dirs for t in TEXTS for s in (first, first + 1) for st in (False, True)]
            alone = {k: _send(server.url, _body(h, *k), None) for k in kinds}
            assert any(status == 200 for status, _ in alone.values()), "no request speaks alone"
            baseline = len(_threads("mizuoto-job")) + len(_threads("mizuoto-a-row")) + len(_threads("mizuoto-b-row"))
            rng = random.Random(20261203)
            rss = None
            for round_ in range(ROUNDS):
                picks = [kinds[rng.randrange(len(kinds))] for _ in range(REQUESTS)]
                leaving = {i for i in range(REQUESTS) if i % LEAVE_EVERY == 0}
                leave_after = {i: rng.randrange(3) for i in leaving}  # pieces read before leaving
                outcomes: list = [None] * REQUESTS
                barrier = threading.Barrier(REQUESTS)

                def one(i):
                    barrier.wait()
                    kind = picks[i]
                    leave = leave_after.get(i)
                    body = _body(h, *kind) if leave is None else {**_body(h, *kind), "stream_format": "audio"}
                    outcomes[i] = _send(server.url, body, leave)
                threads = [threading.Thread(target=one, args=(i,)) for i in range(REQUESTS)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(REQUEST_S + 30)
                assert not any(t.is_alive() for t in threads), f"round {round_}: a client hangs"
                for i, got in enumerate(outcomes):
                    if i not in leaving:
                        want = alone[picks[i]]
                        assert got == want, (round_, i, picks[i], got[0], want[0], got[1][:300] if got[0] != 200 else "")
                h.wait_idle(client, timeout=60)
                h.until(lambda: len(_threads("mizuoto-job")) + len(_threads("mizuoto-a-row"))
                        + len(_threads("mizuoto-b-row")) <= baseline, "threads back to the baseline", 30)
                assert _metric(client, "mizuoto_requests_in_flight") == [0]
                assert _metric(client, "mizuoto_queue_depth") == [0]
                assert all(v == 0 for v in _metric(client, "mizuoto_batch_occupancy")), "a batch row is still held"
                computing = [n for n in _threads() if n.endswith(("-compute", "-batch"))]
                assert len(computing) <= len(dirs), computing  # one executor per loaded model, no more
                if round_ == 0:
                    rss = h.resident_bytes()
            evictions = _metric(client, "mizuoto_model_evictions_total")[0]
            assert evictions > 0, "the budget never forced an eviction"
            grown = h.resident_bytes() - rss
            print(f"[stress] {ROUNDS} rounds of {REQUESTS}: {evictions:.0f} evictions, "
                  f"{sum(s == 200 for s, _ in alone.values())}/{len(alone)} kinds speak alone, "
                  f"resident +{grown / 2**20:.1f} MiB after the first round")
            assert grown < RSS_BOUND, f"resident memory grew {grown / 2**20:.0f} MiB over two rounds"
    finally:
        server.stop()
    assert not [n for n in _threads() if n.endswith(("-compute", "-batch")) or "-row" in n], _threads()
