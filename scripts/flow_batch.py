"""Time a CosyVoice flow estimator call for one request's CFG batch (2) against two requests' (4).

    python scripts/flow_batch.py MODEL_DIR [--frames 250]

MODEL_DIR: a CosyVoice 2/3 directory, e.g. the one `mizuoto bench --random cosyvoice2 --workdir W`
writes (W/random-cosyvoice2). Inputs are random; the figure is the best of 3 calls per batch size.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mizuoto.engines.cosyvoice.engine import CosyVoiceModel
from mizuoto.runtime.options import LoadOptions


def best_call_s(estimator: torch.nn.Module, batch: int, mels: int, frames: int, repeats: int = 3) -> float:
    """Best wall time of `repeats` estimator calls on a random batch (after one warm-up call)."""
    x, mu, cond = (torch.randn(batch, mels, frames) for _ in range(3))
    mask, t, spks = torch.ones(batch, 1, frames), torch.rand(batch), torch.randn(batch, mels)
    with torch.inference_mode():
        estimator(x, mask, mu, t, spks, cond)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            estimator(x, mask, mu, t, spks, cond)
            times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Print ms per estimator call at batch 2 and 4, twice (alternating)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--frames", type=int, default=250, help="mel frames (prompt + speech); default 250")
    args = p.parse_args()
    model = CosyVoiceModel(args.model_dir, LoadOptions(device="cpu"), frontend_optional=True)
    for batch in (2, 4, 2, 4):
        ms = 1e3 * best_call_s(model.flow.decoder.estimator, batch, model.flow.output_size, args.frames)
        print(f"batch {batch}: {ms:.1f} ms per estimator call")


if __name__ == "__main__":
    main()
