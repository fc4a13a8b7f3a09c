"""Activation memory of one training forward with and without `training.memory` (gradient checkpointing).

    python scripts/measure_train_memory.py --from MODEL_DIR --data DATA_DIR --model llm|flow [--config train.yaml] [--random]

Prints the bytes autograd holds for backward after the first batch's forward (parameters not
counted), each way; see docs/training.md for figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mizuoto.engines.cosyvoice.train.memory import activation_bytes, checkpoint_blocks
from mizuoto.engines.cosyvoice.llm import build_lm
from mizuoto.engines.cosyvoice.train.session import (StageSpec, build_model, build_training_flow, make_loaders,
                                                     model_forward, open_model_dir, train_config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="model_dir", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--model", choices=("llm", "flow"), required=True)
    p.add_argument("--config")
    p.add_argument("--out", default="/tmp/mizuoto-train-memory", help="where features would be looked up")
    p.add_argument("--random", action="store_true", help="random weights of the yaml's sizes (no <model>.pt needed)")
    args = p.parse_args()
    spec = StageSpec(args.model, Path(args.model_dir), Path(args.data), Path(args.out),
                     Path(args.config) if args.config else None)
    variant, model_config = open_model_dir(spec.model_dir)
    config = train_config(spec, variant, model_config)
    batch = next(iter(make_loaders(spec, variant, config).train))
    sizes = {}
    for memory in (False, True):
        if args.random:
            torch.manual_seed(0)
            model = build_lm(config["llm"], spec.model_dir) if args.model == "llm" else build_training_flow(config)
        else:
            model, _, _ = build_model(spec, config)
        if memory:
            checkpoint_blocks(model)
        torch.manual_seed(0)
        sizes[memory] = activation_bytes(model, model_forward(model, config, memory), batch, torch.device("cpu"))
    print(f"{args.model}: batch of {len(batch['utts'])}, activations held for backward: "
          f"{sizes[False] / 2**20:.2f} MiB without, {sizes[True] / 2**20:.2f} MiB with training.memory "
          f"({sizes[True] / sizes[False]:.0%})")


if __name__ == "__main__":
    main()
