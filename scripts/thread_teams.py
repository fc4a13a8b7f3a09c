"""Times a decode-sized CPU workload in the main thread and in worker threads, to show OpenMP's thread teams.

A stand-in for one Qwen2-0.5B decode step (24 layers of fp32 matrix-vector products, about 1.4 GB
of weights read per step), no model files needed. Each argument is one measurement, in order:

    main          in the main thread (its OpenMP team lives as long as the process)
    thread        in a new worker thread (a team of its own, gone when the thread ends)

    python scripts/thread_teams.py thread thread     # the main thread never computes
    python scripts/thread_teams.py main thread main  # a worker thread while the main thread's team exists
    OMP_WAIT_POLICY=passive python scripts/thread_teams.py main thread

Figures for docs come from `mizuoto bench --threaded`; this is the mechanism in 20 seconds.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

HIDDEN, KV, FFN, LAYERS = 896, 256, 4864, 24


def build() -> list[torch.nn.Linear]:
    """Four linear maps per layer: q+k+v, o, gate+up, down."""
    torch.manual_seed(0)
    return [m for _ in range(LAYERS) for m in (torch.nn.Linear(HIDDEN, HIDDEN + KV), torch.nn.Linear(HIDDEN, HIDDEN),
                                              torch.nn.Linear(HIDDEN, 2 * FFN), torch.nn.Linear(FFN, HIDDEN))]


def step(layers: list[torch.nn.Linear], x: torch.Tensor) -> torch.Tensor:
    """One token through every layer."""
    with torch.inference_mode():
        h = x
        for i in range(0, len(layers), 4):
            a = layers[i](h)
            h = h + layers[i + 1](a[:, :HIDDEN])
            g = layers[i + 2](h)
            h = h + layers[i + 3](torch.nn.functional.silu(g[:, :FFN]) * g[:, FFN:])
        return h


def ms_per_step(layers: list[torch.nn.Linear], steps: int = 30) -> float:
    """Median-free mean over `steps` after two warm-up steps."""
    x = torch.randn(1, HIDDEN)
    step(layers, x), step(layers, x)
    start = time.perf_counter()
    for _ in range(steps):
        step(layers, x)
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str]) -> int:
    """Run the measurements named in argv."""
    layers = build()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for where in argv or ["main", "thread"]:
        if where == "main":
            ms = ms_per_step(layers)
        elif where == "thread":
            out: list[float] = []
            t = threading.Thread(target=lambda: out.append(ms_per_step(layers)))
            t.start()
            t.join()
            ms = out[0]
        else:
            print(f"unknown measurement {where!r}: main or thread", file=sys.stderr)
            return 2
        print(f"{where:<7} {ms:7.2f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
