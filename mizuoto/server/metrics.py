"""Prometheus text exposition of the server's counters, latencies and memory."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


def _escape(value: object) -> str:
    """A label value as the exposition format writes it: backslash, quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in kv.items())
    return "{" + inner + "}" if inner else ""


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str, labels: dict) -> list[str]:
        out = [f"{name}_bucket{_labels(**labels, le=f'{b:g}')} {c}" for b, c in zip(self.buckets, self.counts)]
        out.append(f"{name}_bucket{_labels(**labels, le='+Inf')} {self.total}")
        out.append(f"{name}_sum{_labels(**labels)} {self.sum:.6f}")
        out.append(f"{name}_count{_labels(**labels)} {self.total}")
        return out


class Metrics:
    """Counters and histograms, safe to update from worker threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.first_chunk: dict[str, _Histogram] = {}
        self.queue_waits = _Histogram(LATENCY_BUCKETS)
        self.rtf: dict[str, _Histogram] = {}
        self.cancelled = 0
        self.audio_seconds: dict[str, float] = defaultdict(float)

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

    def render(self, admission: Any, memory: list[tuple[str, str, str, int]],
               batches: list[tuple[str, int, int]] = (), evictions: int = 0,
               loop_failures: list[tuple[str, int]] = ()) -> str:
        """The exposition text of the JobSlots' gauges and these counters.

        `memory` rows are (suffix, device, model, bytes); `batches` rows (model, batch width, running);
        `evictions` the runtime's count of models evicted to admit others; `loop_failures` rows
        (model, failures of its compute loop, each answered to its waiters before the loop went on).
        """
        in_flight, limit, queued = admission.active, admission.limit, admission.queued
        with self._lock:
            out = ["# HELP mizuoto_requests_total Requests answered, by route, model and status.",
                   "# TYPE mizuoto_requests_total counter"]
            out += [f"mizuoto_requests_total{_labels(route=r, model=m, status=str(s))} {n}"
                    for (r, m, s), n in sorted(self.requests.items())]
            out += ["# HELP mizuoto_requests_in_flight Synthesis jobs running now.",
                    "# TYPE mizuoto_requests_in_flight gauge", f"mizuoto_requests_in_flight {in_flight}",
                    "# HELP mizuoto_max_concurrent Jobs allowed at once (--max-concurrent).",
                    "# TYPE mizuoto_max_concurrent gauge", f"mizuoto_max_concurrent {limit}",
                    "# HELP mizuoto_batch_width Requests a model runs at once (its LM batch width, --max-batch).",
                    "# TYPE mizuoto_batch_width gauge"]
            out += [f"mizuoto_batch_width{_labels(model=m)} {w}" for m, w, _ in batches]
            out += ["# HELP mizuoto_batch_occupancy Requests running on a model over its batch width (0 to 1).",
                    "# TYPE mizuoto_batch_occupancy gauge"]
            out += [f"mizuoto_batch_occupancy{_labels(model=m)} {n / max(w, 1):g}" for m, w, n in batches]
            out += ["# HELP mizuoto_compute_loop_failures_total Failures of a model's compute (batch) loop itself;"
                    " each reached its waiting requests and the loop went on.",
                    "# TYPE mizuoto_compute_loop_failures_total counter"]
            out += [f"mizuoto_compute_loop_failures_total{_labels(model=m)} {n}" for m, n in loop_failures]
            out += ["# HELP mizuoto_model_evictions_total Models offloaded or unloaded to make room for others.",
                    "# TYPE mizuoto_model_evictions_total counter", f"mizuoto_model_evictions_total {evictions}",
                    "# HELP mizuoto_queue_depth Jobs waiting in the queue for a slot.",
                    "# TYPE mizuoto_queue_depth gauge", f"mizuoto_queue_depth {queued}",
                    "# HELP mizuoto_max_queued Jobs allowed to wait (--max-queued).",
                    "# TYPE mizuoto_max_queued gauge", f"mizuoto_max_queued {admission.max_queued}",
                    "# HELP mizuoto_requests_cancelled_total Jobs cancelled by disconnect, deadline or shutdown.",
                    "# TYPE mizuoto_requests_cancelled_total counter",
                    f"mizuoto_requests_cancelled_total {self.cancelled}",
                    "# HELP mizuoto_first_chunk_seconds Time to the first audio chunk.",
                    "# TYPE mizuoto_first_chunk_seconds histogram"]
            for model, h in sorted(self.first_chunk.items()):
                out += h.lines("mizuoto_first_chunk_seconds", {"model": model})
            out += ["# HELP mizuoto_queue_wait_seconds Time a job waited in the queue for its slot.",
                    "# TYPE mizuoto_queue_wait_seconds histogram"]
            out += self.queue_waits.lines("mizuoto_queue_wait_seconds", {})
            out += ["# HELP mizuoto_rtf Real-time factor (synthesis wall time / audio duration).",
                    "# TYPE mizuoto_rtf histogram"]
            for model, h in sorted(self.rtf.items()):
                out += h.lines("mizuoto_rtf", {"model": model})
            out += ["# HELP mizuoto_audio_seconds_total Seconds of audio produced.",
                    "# TYPE mizuoto_audio_seconds_total counter"]
            out += [f"mizuoto_audio_seconds_total{_labels(model=m)} {s:.3f}"
                    for m, s in sorted(self.audio_seconds.items())]
        helps = {"memory_budget_bytes": "Memory budget of each device pool.",
                 "memory_planned_bytes": "Memory the planner holds for each model on each device.",
                 "memory_used_bytes": "Memory measured in use on each device (process RSS for the host)."}
        for suffix, text in helps.items():
            out += [f"# HELP mizuoto_{suffix} {text}", f"# TYPE mizuoto_{suffix} gauge"]
            out += [f"mizuoto_{suffix}{_labels(device=d, **({'model': m} if m else {}))} {b}"
                    for s, d, m, b in memory if s == suffix]
        return "\n".join(out) + "\n"
