"""`mizuoto train cosyvoice`: fine-tune a CosyVoice model dir on a recipe folder (features, llm, flow, export)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mizuoto.errors import InvalidRequest

ENGINES = ("cosyvoice",)
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The train command's arguments."""
    p.add_argument("engine", choices=ENGINES, help="the engine whose models to train")
    p.add_argument("--method", required=True, choices=("llm", "llm_flow"), help="what to fine-tune")
    p.add_argument("--from", dest="model_dir", required=True, help="the model dir to start from")
    p.add_argument("--data", required=True, help="recipe folder: wav.scp, text, utt2spk, spk2utt [, instruct]")
    p.add_argument("--out", required=True, help="run folder (features/, llm/, flow/, export/)")
    p.add_argument("--stage", action="append", choices=("features", "llm", "flow", "export"),
                   help="run only this stage (repeatable; default: every stage of the method)")
    p.add_argument("--config", help="training yaml (default: the start dir's own yaml)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps (default cpu)")
    p.add_argument("--workers", type=int, default=0, help="data-loading worker processes (default 0)")
    p.add_argument("--threads", type=int, help="intra-op CPU threads (1 reproduces upstream's recorded CPU runs)")
    p.add_argument("--average", type=int, default=5, help="export: epochs averaged, best validation loss first")
    p.add_argument("--resume", action="store_true", help="continue the run already in --out")
    p.add_argument("--train-option", action="append", metavar="KEY=VALUE",
                   help="train option: training.memory=on (gradient checkpointing)")


def _options(items: list[str] | None) -> dict[str, bool]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not sep or key != "training.memory":
            raise InvalidRequest(f"unknown train option {item!r} (known: training.memory=on|off)")
        if value not in _TRUE + _FALSE:
            raise InvalidRequest(f"training.memory takes on or off, got {value!r}")
        out["memory"] = value in _TRUE
    return out


def run_train(args: argparse.Namespace) -> int:
    """Run the requested stages; errors surface as one line through the CLI."""
    from mizuoto.engines.cosyvoice.train.stages import Progress, TrainRequest, run_request

    if args.average < 1:
        raise InvalidRequest(f"--average must be 1 or more, got {args.average}")
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidRequest(f"--threads must be 1 or more, got {args.threads}")
        from mizuoto.runtime.compute_threads import fix_compute_threads

        fix_compute_threads(args.threads)  # this process's training only: no Runtime or child takes it over
    req = TrainRequest(args.method, Path(args.model_dir), Path(args.data), Path(args.out),
                       tuple(args.stage or ()), Path(args.config) if args.config else None, args.workers,
                       args.device, resume=args.resume, average_num=args.average, **_options(args.train_option))
    run_request(req, on_batch=Progress())
    return 0
