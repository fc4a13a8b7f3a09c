"""The server's counters, latencies and memory as Prometheus metrics (prometheus_client, a registry per server)."""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
_MEMORY = {"memory_budget_bytes": "Memory budget of each device pool.",
           "memory_planned_bytes": "Memory the planner holds for each model on each device.",
           "memory_used_bytes": "Memory measured in use on each device (process RSS for the host)."}


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum = buckets, [0] * (len(buckets) + 1), 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate((*self.buckets, float("inf"))):
            self.counts[i] += value <= b  # cumulative, as the exposition wants them
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        bounds = [f"{b:g}" for b in self.buckets] + ["+Inf"]
        family.add_metric(labels, list(zip(bounds, self.counts)), self.sum)


class Metrics:
    """Counters and histograms, safe to update from worker threads; `exposition` answers a scrape."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.first_chunk: dict[str, _Histogram] = {}
        self.queue_waits = _Histogram(LATENCY_BUCKETS)
        self.rtf: dict[str, _Histogram] = {}
        self.cancelled = 0
        self.audio_seconds: dict[str, float] = defaultdict(float)
        self._scrape: tuple = ()  # what the runtime and the job slots say now, set for one scrape
        self._scraping = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def request(self, route: str, model: str, status: int) -> None:
        """Count a finished request."""
        with self._lock:
            self.requests[(route, model, status)] += 1

    def first_chunk_latency(self, model: str, seconds: float) -> None:
        """Time from request to the first audio chunk."""
        with self._lock:
            self.first_chunk.setdefault(model, _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def queue_wait(self, seconds: float) -> None:
        """Time a job waited in the queue for its slot (0 when one was free)."""
        with self._lock:
            self.queue_waits.observe(seconds)

    def synthesis(self, model: str, wall: float, audio: float) -> None:
        """A completed synthesis: real-time factor = wall time / audio time."""
        with self._lock:
            self.audio_seconds[model] += audio
            if audio > 0:
                self.rtf.setdefault(model, _Histogram(RTF_BUCKETS)).observe(wall / audio)

    def cancel(self) -> None:
        """Count a request cancelled by its client, its deadline or shutdown."""
        with self._lock:
            self.cancelled += 1

    def exposition(self, accept: str | None, admission: Any, memory: list[tuple[str, str, str, int]],
                   batches: list[tuple[str, int, int]] = (), evictions: int = 0,
                   loop_failures: list[tuple[str, int]] = (),
                   compute_pending: list[tuple[str, int]] = ()) -> tuple[bytes, str]:
        """(body, content type) of a scrape: OpenMetrics when `accept` asks for it, else the text format 0.0.4.

        `admission` is the JobSlots; `memory` rows are (suffix, device, model, bytes); `batches` rows
        (model, batch width, running); `evictions` the runtime's count of models evicted to admit
        others; `loop_failures` rows (model, failures of its compute loop, each answered to its waiters);
        `compute_pending` rows (model, calls waiting on or running in its compute loop).
        """
        encode, media = choose_encoder(accept or "")
        with self._scraping:
            self._scrape = (admission, memory, batches, evictions, loop_failures, compute_pending)
            return encode(self.registry), media

    def collect(self) -> Iterator[Metric]:
        """The families of a scrape (prometheus_client's collector protocol)."""
        if not self._scrape:
            return
        admission, memory, batches, evictions, loop_failures, compute_pending = self._scrape

        def family(kind: type, name: str, text: str, value: float | None = None, labels: tuple = (),
                   rows: list = ()) -> Metric:
            out = kind(f"mizuoto_{name}", text, value=value, labels=None if value is not None else labels)
            for row in rows:
                out.add_metric(*row)
            return out
        gauge, counter = functools.partial(family, GaugeMetricFamily), functools.partial(family, CounterMetricFamily)

        def histogram(name: str, text: str, per: dict[tuple, _Histogram], labels: tuple) -> HistogramMetricFamily:
            out = HistogramMetricFamily(f"mizuoto_{name}", text, labels=labels)
            for key, h in sorted(per.items()):
                h.add_to(out, list(key))
            return out

        with self._lock:
            yield counter("requests", "Requests answered, by route, model and status.",
                          labels=("route", "model", "status"),
                          rows=[([r, m, str(s)], n) for (r, m, s), n in sorted(self.requests.items())])
            yield counter("requests_cancelled", "Jobs cancelled by disconnect, deadline or shutdown.", self.cancelled)
            yield counter("audio_seconds", "Seconds of audio produced.", labels=("model",),
                          rows=[([m], s) for m, s in sorted(self.audio_seconds.items())])
            yield histogram("first_chunk_seconds", "Time to the first audio chunk.",
                            {(m,): h for m, h in self.first_chunk.items()}, ("model",))
            yield histogram("queue_wait_seconds", "Time a job waited in the queue for its slot.",
                            {(): self.queue_waits}, ())
            yield histogram("rtf", "Real-time factor (synthesis wall time / audio duration).",
                            {(m,): h for m, h in self.rtf.items()}, ("model",))
        yield gauge("requests_in_flight", "Synthesis jobs running now.", admission.active)
        yield gauge("max_concurrent", "Jobs allowed at once (--max-concurrent).", admission.limit)
        yield gauge("queue_depth", "Jobs waiting in the queue for a slot.", admission.queued)
        yield gauge("max_queued", "Jobs allowed to wait (--max-queued).", admission.max_queued)
        yield gauge("batch_width", "Requests a model runs at once (its LM batch width, --max-batch).",
                    labels=("model",), rows=[([m], w) for m, w, _ in batches])
        yield gauge("batch_occupancy", "Requests running on a model over its batch width (0 to 1).",
                    labels=("model",), rows=[([m], n / max(w, 1)) for m, w, n in batches])
        yield counter("compute_loop_failures", "Failures of a model's compute (batch) loop itself; each reached its "
                      "waiting requests and the loop went on.", labels=("model",),
                      rows=[([m], n) for m, n in loop_failures])
        yield gauge("compute_pending", "Calls waiting on or running in a model's compute loop (a cancelled "
                    "request's started call runs to its end).", labels=("model",),
                    rows=[([m], n) for m, n in compute_pending])
        yield counter("model_evictions", "Models offloaded or unloaded to make room for others.", evictions)
        for suffix, text in _MEMORY.items():  # a budget and a use are per device, a plan per model too
            labels = ("device", "model") if suffix == "memory_planned_bytes" else ("device",)
            yield gauge(suffix, text, labels=labels, rows=[([d, m][:len(labels)], b) for s, d, m, b in memory
                                                            if s == suffix])
