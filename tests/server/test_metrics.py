"""Metrics on prometheus_client: today's names and labels, OpenMetrics when asked, process metrics, escaping."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from mizuoto.server.metrics import LATENCY_BUCKETS, Metrics

SLOTS = SimpleNamespace(active=2, limit=4, queued=1, max_queued=32)


def _scrape(m: Metrics, accept: str | None = None) -> tuple[str, str]:
    body, media = m.exposition(accept, SLOTS, [("memory_budget_bytes", "cpu", "", 100),
                                               ("memory_planned_bytes", "cpu", "tone", 40)],
                               [("tone", 8, 2)], 3, [("tone", 1)])
    return body.decode(), media


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_names_labels_and_values():
    """Every metric of the server's table comes out with its labels and values; histograms are cumulative."""
    m = Metrics()
    m.request("speech", "tone", 200)
    m.request("speech", "tone", 200)
    m.cancel()
    for seconds in (0.07, 0.3, 99.0):
        m.first_chunk_latency("tone", seconds)
    m.synthesis("tone", 1.0, 4.0)
    text, media = _scrape(m)
    assert media.startswith("text/plain; version=0.0.4")
    got = _samples(text)
    assert got["mizuoto_requests_total", (("model", "tone"), ("route", "speech"), ("status", "200"))] == 2
    assert got["mizuoto_requests_cancelled_total", ()] == 1
    assert got["mizuoto_requests_in_flight", ()] == 2 and got["mizuoto_queue_depth", ()] == 1
    assert got["mizuoto_max_concurrent", ()] == 4 and got["mizuoto_max_queued", ()] == 32
    assert got["mizuoto_batch_width", (("model", "tone"),)] == 8
    assert got["mizuoto_batch_occupancy", (("model", "tone"),)] == 0.25
    assert got["mizuoto_compute_loop_failures_total", (("model", "tone"),)] == 1
    assert got["mizuoto_model_evictions_total", ()] == 3
    assert got["mizuoto_audio_seconds_total", (("model", "tone"),)] == 4.0
    assert got["mizuoto_memory_budget_bytes", (("device", "cpu"),)] == 100
    assert got["mizuoto_memory_planned_bytes", (("device", "cpu"), ("model", "tone"))] == 40
    buckets = [got["mizuoto_first_chunk_seconds_bucket", (("le", f"{b:g}"), ("model", "tone"))] for b in LATENCY_BUCKETS]
    assert buckets == sorted(buckets) and buckets[0] == 0 and buckets[1] == 1 and buckets[-1] == 2
    assert got["mizuoto_first_chunk_seconds_bucket", (("le", "+Inf"), ("model", "tone"))] == 3
    assert got["mizuoto_first_chunk_seconds_count", (("model", "tone"),)] == 3
    assert got["mizuoto_rtf_bucket", (("le", "0.25"), ("model", "tone"))] == 1


def test_openmetrics_when_asked_and_process_metrics():
    """An OpenMetrics Accept gets OpenMetrics (ending in # EOF); both formats carry the process metrics."""
    m = Metrics()
    text, media = _scrape(m, "application/openmetrics-text; version=1.0.0")
    assert media.startswith("application/openmetrics-text") and text.rstrip().endswith("# EOF")
    plain, _ = _scrape(m, "text/plain")
    for out in (text, plain):
        assert "process_resident_memory_bytes" in out and "python_info" in out
    assert "# EOF" not in plain


def test_label_values_are_escaped():
    """A model name with a quote, backslash or newline cannot forge a line of its own."""
    m = Metrics()
    m.request("speech", 'a"b\\c\nmizuoto_forged_total 1', 200)
    text, _ = _scrape(m)
    assert not any(line.startswith("mizuoto_forged_total") for line in text.splitlines())
    got = _samples(text)
    assert got["mizuoto_requests_total", (("model", 'a"b\\c\nmizuoto_forged_total 1'), ("route", "speech"),
                                          ("status", "200"))] == 1


def test_servers_in_one_process_count_apart():
    """Each server's registry is its own: two Metrics do not share counts."""
    a, b = Metrics(), Metrics()
    a.cancel()
    assert _samples(_scrape(a)[0])["mizuoto_requests_cancelled_total", ()] == 1
    assert _samples(_scrape(b)[0])["mizuoto_requests_cancelled_total", ()] == 0
