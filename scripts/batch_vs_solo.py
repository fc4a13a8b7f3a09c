"""How often a batched CosyVoice 2/3 LM draws other tokens than the same seeded request alone.

    python scripts/batch_vs_solo.py [--workdir W] [--assets DIR] [--seeds 5] [--tokens 100] [--width 8]

Builds (or reuses) the full-size random CosyVoice 2 that `mizuoto bench --random cosyvoice2
--workdir W` writes, loads it with `compute.batch=WIDTH`, draws `--tokens` tokens for each seed
alone through upstream's loop, then all seeds at once through the batch, and prints how many
positions differ (batched results may differ from unbatched ones in the last bits of a logit;
they never depend on the company, which the test suite checks).
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import torch

from mizuoto.cli.bench import CPU_DEFAULTS, find_factory
from mizuoto.runtime.bench import BenchSettings
from mizuoto.runtime.options import add_load_arguments, options_from_args


def main() -> None:
    """Parse the arguments, draw the tokens both ways, print the count."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/benchwd")
    p.add_argument("--assets", default=None)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--width", type=int, default=8)
    add_load_arguments(p)
    args = p.parse_args()
    options = options_from_args(args, {"compute.batch": args.width}).resolved()
    extra = {"assets": args.assets} if args.assets else {}
    driver = find_factory(None, "cosyvoice2")(None, "cosyvoice2", options, BenchSettings(**CPU_DEFAULTS),
                                              Path(args.workdir), **extra)

    def tokens(seed: int) -> list[int]:
        return list(driver.synthesizer(args.tokens).lm_tokens(driver.inputs, torch.Generator().manual_seed(seed)))

    seeds = range(args.seeds)
    solo = {s: tokens(s) for s in seeds}  # before the batch's first pass: its loop packs the layers
    driver.use_batch(True)
    batched: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda s=s: batched.__setitem__(s, tokens(s))) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    differ = sum(a != b for s in seeds for a, b in zip(solo[s], batched[s]))
    first = {s: next((i for i, (a, b) in enumerate(zip(solo[s], batched[s])) if a != b), None) for s in seeds}
    print(f"batched (width {args.width}) vs alone: {differ} of {sum(map(len, solo.values()))} positions differ; "
          f"first differing position per seed: {first}; batch {driver.model.batch_loop().stats()}")


if __name__ == "__main__":
    main()
