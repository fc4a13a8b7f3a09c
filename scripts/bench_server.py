"""The HTTP server's overhead per request: Piper requests through the server against direct synthesis.

    python scripts/bench_server.py [--text Hello.] [-n 200] [--concurrency 16] [--warmup 10] [--repeat 1] [--json]
                                   [--attack [idle,trickle,drip]]

Starts the server in-process on 127.0.0.1 with Piper's default voice. Each run times N direct
`runtime.synthesize` calls (encoded to PCM16 as the server does) and N POST /v1/audio/speech
(pcm), first one after the other, then over --concurrency threads (one httpx.Client each), at
the caller. overhead = server - direct (p50, p99), per run; each figure is the median over
--repeat runs. `mizuoto` comes from sys.path: `PYTHONPATH=/other/checkout` measures that one.

--attack also times the server one request after the other while hostile clients run beside it
(`attack`: idle connections, bodies trickled a byte at a time, WebSocket sessions dripping text),
and reports the server's resident memory before, at the end of, and after the attack.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import torch

import mizuoto
import mizuoto_piper
from mizuoto.runtime.api import Runtime
from mizuoto.server.app import create_app
from mizuoto.server.launch import ServerThread
from mizuoto.server.state import ServerConfig

MODEL = "piper"


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def busy_seconds() -> tuple[float, float]:
    """CPU seconds spent so far by the whole machine (0 where /proc/stat is missing) and by this process."""
    own = sum(os.times()[:2])
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return own, own
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own


def run_clients(call, n: int, workers: int) -> tuple[list[float], float, float]:
    """Run `call(client)` n times over `workers` threads: per-call seconds, wall seconds, cores busy elsewhere."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(n):
        todo.put(None)
    times: list[float] = []

    def worker() -> None:
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            while True:
                try:
                    todo.get_nowait()
                except queue.Empty:
                    return
                t0 = time.perf_counter()
                call(client)
                times.append(time.perf_counter() - t0)

    with ThreadPoolExecutor(workers) as pool:
        machine, own = busy_seconds()
        start = time.perf_counter()
        for done in [pool.submit(worker) for _ in range(workers)]:
            done.result()  # a worker's error ends the run with its own traceback
        wall = time.perf_counter() - start
    assert len(times) == n, f"{n - len(times)} requests failed"
    machine_after, own_after = busy_seconds()
    return times, wall, max(0.0, (machine_after - machine) - (own_after - own)) / wall


def attack(url: str, stop: threading.Event, chosen: list[str]) -> list[threading.Thread]:
    """Hostile clients until `stop`, of the kinds chosen: 64 idle connections, 8 trickled bodies, 4 WebSocket
    sessions dripping text."""
    import websockets.sync.client

    host, port = url.removeprefix("http://").split(":")

    def idle() -> None:
        while not stop.is_set():
            with socket.create_connection((host, int(port))) as sock:
                sock.settimeout(1.0)
                while not stop.is_set():
                    try:
                        if not sock.recv(1):
                            break  # closed by the server's header timeout: open another
                    except socket.timeout:
                        continue

    def trickle() -> None:
        while not stop.is_set():
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100000\r\n\r\n")
                try:
                    while not stop.wait(0.5):
                        sock.sendall(b" ")
                except OSError:
                    pass  # answered 408 and closed: start again

    def drip() -> None:
        while not stop.is_set():
            try:
                with websockets.sync.client.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
                    ws.send(json.dumps({"type": "session.start", "model": MODEL}))
                    ws.recv(timeout=30)
                    while not stop.wait(1.0):
                        ws.send(json.dumps({"type": "input_text.append", "text": " a"}))
            except Exception:
                pass  # ended by the server (its deadlines): start again

    kinds = {"idle": (idle, 64), "trickle": (trickle, 8), "drip": (drip, 4)}
    threads = [threading.Thread(target=kinds[k][0], daemon=True) for k in chosen for _ in range(kinds[k][1])]
    for t in threads:
        t.start()
    return threads


def resident_mb() -> float:
    """This process's resident memory in MB (the server runs in it)."""
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def summary(times: list[float], wall: float, others: float) -> dict:
    """p50/p99 in ms, requests per second, and the cores other processes kept busy meanwhile."""
    return {"p50_ms": float(np.percentile(times, 50)) * 1e3, "p99_ms": float(np.percentile(times, 99)) * 1e3,
            "rps": len(times) / wall, "others": others}


def main() -> None:
    """Parse the arguments, start the server, time both paths, print the table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default="Hello.")
    p.add_argument("-n", "--requests", type=int, default=200, help="timed requests per measurement")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1, help="runs; each figure is the median of the runs'")
    p.add_argument("--json", action="store_true")
    p.add_argument("--attack", nargs="?", const="idle,trickle,drip", metavar="KINDS",
                   help="also time the server under hostile clients of these kinds (default: all three)")
    args = p.parse_args()
    info = {"mizuoto": mizuoto.__file__, "cpu": f"{cpu_model()} ({os.cpu_count()} cores)",
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "text": args.text,
            "requests": args.requests, "concurrency": args.concurrency, "repeat": args.repeat,
            "torch_threads": torch.get_num_threads()}

    runtime = Runtime(voices=False)
    config = ServerConfig(max_concurrent=args.concurrency, max_queued=4 * args.concurrency)
    server = ServerThread(create_app(runtime, config, {MODEL: mizuoto_piper.default_voice_dir()})).start()
    voice = next(v.id for v in runtime.voices(MODEL) if v.kind == "preset")
    body = {"model": MODEL, "input": args.text, "response_format": "pcm"}

    def via_server(client: httpx.Client) -> None:
        r = client.post(server.url + "/v1/audio/speech", json=body)
        assert r.status_code == 200 and r.content, (r.status_code, r.text[:200])

    def direct(_client: httpx.Client) -> None:
        samples = torch.cat([c.samples.detach().cpu() for c in runtime.synthesize(MODEL, args.text, voice=voice)])
        assert (np.clip(samples.numpy(), -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()

    paths = {"direct": direct, "server": via_server}
    modes = {"sequential": 1, f"concurrent{args.concurrency}": args.concurrency}
    runs: list[dict] = []
    try:
        for call in paths.values():
            run_clients(call, args.warmup, 1)
        for _ in range(args.repeat):
            runs.append({f"{path}/{mode}": summary(*run_clients(call, args.requests, workers))
                         for mode, workers in modes.items() for path, call in paths.items()})
            if args.attack:
                stop, before = threading.Event(), resident_mb()
                attackers = attack(server.url, stop, args.attack.split(","))
                time.sleep(2.0)  # let them connect
                runs[-1]["server/sequential+attack"] = summary(*run_clients(via_server, args.requests, 1))
                during = resident_mb()
                stop.set()
                for t in attackers:
                    t.join(30)
                runs[-1]["rss_mb"] = {"before": before, "during": during, "after": resident_mb()}
    finally:
        server.stop()
        runtime.close()

    for r in runs:  # overhead within each run, then the median over runs (drift between runs cancels out)
        for mode in modes:
            s, d = r[f"server/{mode}"], r[f"direct/{mode}"]
            r[f"overhead/{mode}"] = {"p50_ms": s["p50_ms"] - d["p50_ms"], "p99_ms": s["p99_ms"] - d["p99_ms"]}
    result = {key: {stat: statistics.median(r[key][stat] for r in runs) for stat in runs[0][key]} for key in runs[0]}
    if args.json:
        print(json.dumps({"info": info, "result": result, "runs": runs}, indent=2))
        return
    for k, v in info.items():
        print(f"{k:>12}: {v}")
    print(f"\n{'':24}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>8}{'others':>8}  (others: cores busy in other processes)")
    for key, stats in result.items():
        rest = f"{stats['rps']:8.1f}{stats['others']:8.2f}" if "rps" in stats else ""
        if key == "rss_mb":
            print(f"{'resident MB':24}" + "  ".join(f"{k} {v:.0f}" for k, v in stats.items()))
            continue
        print(f"{key:24}{stats['p50_ms']:9.2f}{stats['p99_ms']:9.2f}{rest}")
    if args.repeat > 1:
        print("\nper run p50 ms / others:")
        for key in (k for k in runs[0] if k != "rss_mb"):
            print(f"{key:24}", "  ".join(f"{r[key]['p50_ms']:8.2f}" + (f" /{r[key]['others']:5.2f}" if "others" in r[key]
                                                                      else " " * 7) for r in runs))


if __name__ == "__main__":
    main()
