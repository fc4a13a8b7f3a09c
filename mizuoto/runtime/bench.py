"""`mizuoto bench`: per-stage speed of a speech model, engine-neutral.

The engine supplies a *bench driver* (see `BenchDriver`) that runs its stages on one fixed
request: the LM generates exactly `tokens` speech tokens with its stop tokens suppressed (so
every run does the same work), then the flow and the vocoder speak them. This module times
the stages (the device synchronized around each), takes the median of N runs after warm-up,
and prints a table or JSON: LM ms/token, flow and vocoder ms per second of audio, first-chunk
latency when streaming, real-time factor, peak memory, and on CUDA the LM step's achieved
memory bandwidth against the device's.

Drivers are found through the engine registry: an Engine class may offer
`bench_driver(model_dir, random, options, settings, workdir[, assets=]) -> BenchDriver` and
list in `bench_random` the model kinds it can build with random weights (`--random cosyvoice2`;
`assets` is passed only when `--assets` is given).
`--driver path/to/file.py:factory` (or `package.module:factory`) names one directly.

`--threaded` runs the measurement in a worker thread, as the server's jobs run; `--concurrency`
starts that many requests at once, LM-only ones (aggregate LM tokens/s) and streamed ones (audio
seconds per second, first-chunk latency percentiles); the model batches them when its
compute.batch is above 1 (the command sets it to the largest level unless given).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.threads import in_thread

# Peak memory bandwidth (GB/s) of common cards, used when the device does not report its own.
KNOWN_BANDWIDTH_GBS = {
    "H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0, "A10G": 600.0, "A10": 600.0,
    "RTX 4090": 1008.0, "RTX 4080": 717.0, "RTX 3090 Ti": 1008.0, "RTX 3090": 936.0, "RTX 3080": 760.0,
    "T4": 320.0, "V100": 900.0,
}


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark request and how often to run it."""

    text: str = "Mizuoto measures how fast each stage of a speech model runs on this machine."
    prompt_text: str = ""
    tokens: int = 250  # speech tokens the LM generates (stop tokens suppressed)
    runs: int = 5
    warmup: int = 2
    stream: bool = False
    reference: str | None = None  # a clip whose voice prompt is timed, new and again (driver.reference)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.runs < 1 or self.warmup < 0:
            raise InvalidRequest("bench: --tokens and --runs must be >= 1 and --warmup >= 0")
        if self.reference is not None:
            reference_seconds(self.reference)  # a bad clip fails before the model loads


def reference_seconds(path: str) -> float:
    """The length of a reference clip in seconds; an InvalidRequest naming it if it is no audio file."""
    import soundfile

    try:
        return soundfile.info(path).duration
    except RuntimeError as e:
        raise InvalidRequest(f"bench: --reference {path}: not an audio file ({e})") from None


# A full-size model is slow off CUDA (a CosyVoice 2 flow takes about 3 s per second of audio on
# two CPU cores): there the defaults are one run, so the command ends in minutes. It keeps one
# warm-up: the first pass over freshly loaded weights is several times slower. 100 tokens is 4 s
# of audio, about what the default text takes to say; fewer would be a request upstream never
# makes (its minimum is 2 tokens per text token: 34 here) and would mostly time the prefill.
CPU_DEFAULTS = {"tokens": 100, "runs": 1, "warmup": 1}


class BenchDriver(Protocol):
    """What an engine provides so its stages can be timed on one fixed request."""

    name: str  # e.g. "cosyvoice2 (random weights)"
    device: torch.device
    sample_rate: int

    def lm(self, tokens: int) -> Any:
        """Generate exactly `tokens` speech tokens (stop tokens suppressed); return them."""

    def lm_bytes_per_step(self, tokens: int) -> int:
        """Bytes a decode step reads on average over a `tokens` run (weights + KV cache)."""

    def flow(self, tokens: Any) -> Any:
        """Tokens -> acoustic features (e.g. mel)."""

    def vocoder(self, features: Any) -> torch.Tensor:
        """Features -> audio samples (1-D or (1, L))."""

    def stream(self, tokens: int) -> Iterator[torch.Tensor]:
        """The whole request streamed (LM, flow, vocoder), yielding audio chunks as they come."""

    # Optional, for a model that clones voices: `reference(clip, new)`, which computes the clip's
    # voice prompt as for a voice never seen before (`new`) or as for one seen before, and
    # `reference_order`, how it analyses the clip (e.g. its compute.reference).
    # Optional, for a model whose LM batches concurrent requests: `batch_width` (int, its
    # compute.batch) and `use_batch(on)`, which routes `lm` and `stream` through the batch
    # (off for the single-request table, on for the --concurrency sweep), and `loop_seconds()`,
    # where its batch loop's time went so far by kind of work (runtime.executor.Executor.timings).
    # Optional, for `bench --memory` (runtime.bench_memory): `model` (the loaded Model),
    # `tokens_per_second` (of audio) and `memory_case(tokens, stream, rows)`, one request of
    # `tokens` through the model's own stage calls, its LM decoding `rows` requests at once; a
    # driver whose model batches may take `served` too (rows as a server runs them: MemoryCase).
    # Several requests' calls that together make one call to measure (an LM's rows decoded at
    # once) go inside `measured_call(model, stage, **sizes)`.


def measured_call(model: Any, stage: str, **sizes: int) -> contextlib.AbstractContextManager:
    """The block's work as one call of `stage` on inputs of these sizes for `bench --memory` (measured against the
    stage's `call_memory(**sizes)`; the calls inside it are part of it), e.g. `rows` requests decoded together."""
    return model.room(stage, **sizes)  # the harness measures reservations (runtime.bench_memory.CallRecorder)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (so timings cover it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory and what it counts: CUDA allocations since the last reset, else the process RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "device (allocated)"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; process lifetime peak
    return int(rss_kib) * (1 if sys.platform == "darwin" else 1024), "host RSS (process peak)"


def device_bandwidth_gbs(device: torch.device) -> tuple[float | None, str]:
    """The device's peak memory bandwidth in GB/s and where the number comes from (None off CUDA)."""
    if device.type != "cuda":
        return None, "not measured off CUDA"
    props = torch.cuda.get_device_properties(device)
    for key in sorted(KNOWN_BANDWIDTH_GBS, key=len, reverse=True):
        if key.lower() in props.name.lower():
            return KNOWN_BANDWIDTH_GBS[key], f"{props.name} datasheet"
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, f"{props.name}: 2 x memory clock x bus width"
    return None, f"{props.name}: unknown (pass --bandwidth)"


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Measured device-to-device copy bandwidth (read + write bytes per second), CUDA only."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, seconds = _timed(device, lambda: [dst.copy_(src) for _ in range(repeats)])
    return 2 * nbytes * repeats / seconds / 1e9


def read_bandwidth_gbs(device: torch.device, nbytes: int, chunk: int = 256 << 20, repeats: int = 3) -> float:
    """Measured read bandwidth: `nbytes` summed in passes over a `chunk`-byte float32 buffer, best of `repeats`.

    A decode step reads its weights once; this reads as many bytes, in the same threads' way
    (a buffer far larger than any cache, summed), so the step's achieved GB/s can be set beside it.
    """
    buf = torch.ones(max(1, min(chunk, nbytes) // 4), dtype=torch.float32, device=device)
    passes = max(1, round(nbytes / (buf.numel() * 4)))
    buf.sum()
    best = min(_timed(device, lambda: [buf.sum() for _ in range(passes)])[1] for _ in range(repeats))
    return passes * buf.numel() * 4 / best / 1e9


def _audio_seconds(audio: torch.Tensor, rate: int) -> float:
    return audio.shape[-1] / rate


def run_once(driver: BenchDriver, settings: BenchSettings) -> dict[str, float]:
    """One pass of the request: seconds per stage, audio length, first-chunk latency, peak memory."""
    device = driver.device
    _peak_reset(device)
    tokens, t_lm = _timed(device, lambda: driver.lm(settings.tokens))
    features, t_flow = _timed(device, lambda: driver.flow(tokens))
    audio, t_voc = _timed(device, lambda: driver.vocoder(features))
    result = {"lm_s": t_lm, "flow_s": t_flow, "vocoder_s": t_voc,
              "audio_s": _audio_seconds(audio, driver.sample_rate)}
    if settings.tokens > 1:  # the same request's first token alone: its prefill, so the steps can be told apart
        result["lm_first_s"] = _timed(device, lambda: driver.lm(1))[1]
    if settings.stream:
        synchronize(device)
        start = time.perf_counter()
        first = None
        for chunk in driver.stream(settings.tokens):
            if first is None:
                synchronize(device)
                first = time.perf_counter() - start
        result["first_chunk_s"] = first if first is not None else float("nan")
    result["peak_bytes"] = float(peak_memory_bytes(device)[0])
    return result


def summarize(runs: Sequence[dict[str, float]], driver: BenchDriver, settings: BenchSettings,
              bandwidth: float | None = None, read_before: float = 0.0) -> dict[str, Any]:
    """Medians over the runs, turned into the reported per-stage figures (`read_before`: a read measured before them)."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    audio_s = med["audio_s"]
    total = med["lm_s"] + med["flow_s"] + med["vocoder_s"]
    out: dict[str, Any] = {
        "model": driver.name, "device": str(driver.device), "runs": len(runs), "tokens": settings.tokens,
        "audio_seconds": audio_s,
        "lm_ms_per_token": 1e3 * med["lm_s"] / settings.tokens,
        "flow_ms_per_audio_second": 1e3 * med["flow_s"] / audio_s,
        "vocoder_ms_per_audio_second": 1e3 * med["vocoder_s"] / audio_s,
        "rtf": total / audio_s,
        "peak_memory_bytes": int(med["peak_bytes"]),
        "peak_memory_kind": peak_memory_bytes(driver.device)[1],
    }
    if "first_chunk_s" in med:
        out["first_chunk_ms"] = 1e3 * med["first_chunk_s"]
    step_bytes = driver.lm_bytes_per_step(settings.tokens)
    out["lm_bytes_per_step"] = step_bytes
    # a decode step's time: the run's LM time less its first token (the prefill), over the other tokens
    step_s = med["lm_s"] / settings.tokens
    if "lm_first_s" in med:
        out["lm_first_token_ms"] = 1e3 * med["lm_first_s"]
        step_s = max(med["lm_s"] - med["lm_first_s"], 1e-9) / (settings.tokens - 1)
    out["lm_ms_per_step"] = 1e3 * step_s
    out["lm_achieved_gb_per_s"] = step_bytes / step_s / 1e9
    # a shared machine's read speed drifts (24-34 GB/s over one afternoon here): the better of a read
    # before the runs and one after them, so the step is set beside what the machine can do
    out["device_read_gb_per_s"] = max(read_before, read_bandwidth_gbs(driver.device, step_bytes))
    out["lm_read_fraction"] = out["lm_achieved_gb_per_s"] / out["device_read_gb_per_s"]
    if driver.device.type == "cuda":
        peak, source = (bandwidth, "given") if bandwidth else device_bandwidth_gbs(driver.device)
        out["device_bandwidth_gb_per_s"], out["device_bandwidth_source"] = peak, source
        out["device_copy_gb_per_s"] = copy_bandwidth_gbs(driver.device)
        if peak:
            out["lm_bandwidth_fraction"] = out["lm_achieved_gb_per_s"] / peak
    return out


def benchmark(driver: BenchDriver, settings: BenchSettings, bandwidth: float | None = None) -> dict[str, Any]:
    """Warm up, run `settings.runs` times, and summarize."""
    read_before = read_bandwidth_gbs(driver.device, driver.lm_bytes_per_step(settings.tokens))
    for _ in range(settings.warmup):
        run_once(driver, settings)
    runs = [run_once(driver, settings) for _ in range(settings.runs)]
    out = summarize(runs, driver, settings, bandwidth, read_before)
    if settings.reference:
        out.update(time_reference(driver, settings))
    return out


def time_reference(driver: BenchDriver, settings: BenchSettings) -> dict[str, Any]:
    """Milliseconds to make a voice prompt of `settings.reference`: for a new voice, and for the same clip again."""
    if not hasattr(driver, "reference"):
        raise InvalidRequest(f"bench: {driver.name} does not clone voices (--reference)")
    seconds = reference_seconds(settings.reference)
    for _ in range(settings.warmup):
        driver.reference(settings.reference, True)
    new = [_timed(driver.device, lambda: driver.reference(settings.reference, True))[1] for _ in range(settings.runs)]
    again = [_timed(driver.device, lambda: driver.reference(settings.reference, False))[1]
             for _ in range(settings.runs)]
    return {"reference_seconds": seconds, "reference_order": getattr(driver, "reference_order", ""),
            "reference_new_ms": 1e3 * statistics.median(new), "reference_again_ms": 1e3 * statistics.median(again)}


def format_table(r: dict[str, Any]) -> str:
    """The summary as aligned text lines."""
    gib = 1024 ** 3
    rows = [
        ("model", r["model"]), ("device", r["device"]),
        ("request", f"{r['tokens']} tokens -> {r['audio_seconds']:.2f} s of audio; median of {r['runs']} runs"),
        ("LM", f"{r['lm_ms_per_token']:.2f} ms/token" + (
            f" ({r['lm_first_token_ms']:.0f} ms to the first token, its prefill; then {r['lm_ms_per_step']:.2f} ms"
            " per decode step)" if "lm_first_token_ms" in r else "")),
        ("flow", f"{r['flow_ms_per_audio_second']:.1f} ms per second of audio"),
        ("vocoder", f"{r['vocoder_ms_per_audio_second']:.1f} ms per second of audio"),
    ]
    if "first_chunk_ms" in r:
        rows.append(("first chunk", f"{r['first_chunk_ms']:.0f} ms (streaming)"))
    rows.append(("RTF", f"{r['rtf']:.3f} (LM + flow + vocoder time / audio time)"))
    if "reference_new_ms" in r:
        order = f", {r['reference_order']}" if r["reference_order"] else ""
        rows.append(("reference", f"{r['reference_new_ms']:.0f} ms for a new voice from a {r['reference_seconds']:.1f} s"
                                  f" clip{order}; {r['reference_again_ms']:.0f} ms for the same clip again"))
    rows.append(("peak memory", f"{r['peak_memory_bytes'] / gib:.2f} GiB ({r['peak_memory_kind']})"))
    bw = f"{r['lm_achieved_gb_per_s']:.1f} GB/s achieved by a decode step ({r['lm_bytes_per_step'] / 1e6:.0f} MB per step)"
    if r.get("device_bandwidth_gb_per_s"):
        bw += (f" of {r['device_bandwidth_gb_per_s']:.0f} GB/s peak ({r['device_bandwidth_source']}):"
               f" {100 * r['lm_bandwidth_fraction']:.1f}%")
    if r.get("device_copy_gb_per_s"):
        bw += f"; copy test {r['device_copy_gb_per_s']:.0f} GB/s"
    if r.get("device_read_gb_per_s") and r.get("lm_read_fraction", 0) >= 0.005:
        bw += (f"; a read of the same bytes {r['device_read_gb_per_s']:.1f} GB/s:"
               f" the step reaches {100 * r['lm_read_fraction']:.0f}% of it")
    # only where it means something: a step that moves next to nothing (a small or CPU-bound LM) reads as 0.0 GB/s
    if r.get("device_bandwidth_gb_per_s") or r["lm_achieved_gb_per_s"] >= 0.05:
        rows.append(("LM bandwidth", bw))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# --- threads and concurrent requests -------------------------------------------------------------

def _percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def run_clients(n: int, work: Callable[[], Any]) -> tuple[list[Any], float]:
    """work() in n threads started at once; their results and the wall time from the start."""
    barrier = threading.Barrier(n + 1)
    results: list[Any] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            barrier.wait()
            results.append(work())
        except BaseException as e:  # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=client, name="mizuoto-bench-client") for _ in range(n)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return results, wall


def concurrent_run(driver: BenchDriver, settings: BenchSettings, clients: int) -> dict[str, Any]:
    """`clients` requests started at once, each in its own thread; aggregate figures.

    LM tokens/s come from `clients` LM-only requests (what the LM's batching serves); audio
    seconds per second and first-chunk latency from `clients` streamed requests. A driver whose
    model does not batch (`batch_width` 1) runs one request at a time (a lock, as the runtime's
    scheduler does), so a request's first-chunk latency includes its wait for the ones before it.
    """
    device = driver.device
    lock = threading.Lock() if getattr(driver, "batch_width", 1) <= 1 else contextlib.nullcontext()

    def lm() -> None:
        with lock:
            driver.lm(settings.tokens)

    def stream() -> tuple[float, int]:
        first, total, start = None, 0, time.perf_counter()
        with lock:
            for chunk in driver.stream(settings.tokens):
                if first is None:
                    synchronize(device)
                    first = time.perf_counter() - start
                total += chunk.shape[-1]
        return (first if first is not None else float("nan")), total

    loop = getattr(driver, "loop_seconds", lambda: {})
    _peak_reset(device)
    synchronize(device)
    _, lm_wall = run_clients(clients, lm)
    before = loop()
    streams, wall = run_clients(clients, stream)
    synchronize(device)
    after = loop()
    firsts = [f for f, _ in streams]
    return {"concurrency": clients, "wall_s": wall, "lm_wall_s": lm_wall,
            "lm_tokens_per_s": clients * settings.tokens / lm_wall,
            "audio_seconds_per_s": sum(n for _, n in streams) / driver.sample_rate / wall,
            "first_chunk_p50_ms": 1e3 * _percentile(firsts, 50),
            "first_chunk_p95_ms": 1e3 * _percentile(firsts, 95),
            "peak_memory_bytes": peak_memory_bytes(device)[0],
            "loop_s": {k: round(after[k] - before.get(k, 0.0), 6) for k in sorted(after)
                       if after[k] > before.get(k, 0.0)}}


def loop_groups(seconds: dict[str, float]) -> dict[str, float]:
    """A loop's seconds by kind (`loop_s`) grouped as the sweep's table shows them: steps (all row
    counts), prefill, flow, vocoder, idle and other (front end, LM inputs, a chunk's own work)."""
    groups = dict.fromkeys(("steps", "prefill", "flow", "vocoder", "idle", "other"), 0.0)
    for kind, t in seconds.items():
        group = "steps" if kind.startswith("step") else kind
        groups[group if group in groups else "other"] += t
    return groups


def concurrency_sweep(driver: BenchDriver, settings: BenchSettings, levels: Sequence[int]) -> list[dict[str, Any]]:
    """concurrent_run at each level (after one warm-up request)."""
    if not levels or any(c < 1 for c in levels):
        raise InvalidRequest(f"bench: --concurrency takes positive counts, e.g. 1,2,4,8; got {list(levels)}")
    batched = getattr(driver, "batch_width", 1) > 1
    if batched:
        driver.use_batch(True)
    try:
        in_thread(lambda: [None for _ in driver.stream(settings.tokens)], "mizuoto-bench")  # its team ends with it
        return [concurrent_run(driver, settings, c) for c in levels]
    finally:
        if batched:
            driver.use_batch(False)


def format_concurrency(rows: Sequence[dict[str, Any]], width: int = 1) -> str:
    """The sweep as an aligned table, under a line saying how the model batches (`width`)."""
    head = f"{'clients':>7}  {'LM tok/s':>9}  {'audio s/s':>9}  {'1st chunk p50':>13}  {'p95':>9}  {'peak mem':>9}"
    lines = [f"LM batch width {width}" + (" (compute.batch): LM steps shared by up to that many requests" if width > 1
                                         else ": one request at a time, so tokens/s stays flat and latency grows"),
             head]
    for r in rows:
        lines.append(f"{r['concurrency']:>7}  {r['lm_tokens_per_s']:>9.1f}  {r['audio_seconds_per_s']:>9.3f}  "
                     f"{r['first_chunk_p50_ms']:>10.0f} ms  {r['first_chunk_p95_ms']:>6.0f} ms  "
                     f"{r['peak_memory_bytes'] / 1024 ** 3:>5.2f} GiB")
    looped = [r for r in rows if r.get("loop_s")]
    if looped:
        names = list(loop_groups({}))
        lines += ["", "the batch loop's time during the streamed requests, seconds (--json: by kind, steps by rows busy)",
                  f"{'clients':>7}  {'wall':>7}  " + "  ".join(f"{n:>7}" for n in names)]
        for r in looped:
            groups = loop_groups(r["loop_s"])
            lines.append(f"{r['concurrency']:>7}  {r['wall_s']:>7.1f}  " + "  ".join(f"{groups[n]:>7.1f}" for n in names))
    return "\n".join(lines)
