"""`mizuoto bench`: the command line over the engine-neutral harness in mizuoto.runtime.bench.

The driver comes from the engine of the model directory (or of `--random KIND`), or from
`--driver path/to/file.py:factory` (or `package.module:factory`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.bench import (CPU_DEFAULTS, BenchDriver, BenchSettings, benchmark, concurrency_sweep,
                                   format_concurrency, format_table)
from mizuoto.runtime.bench_memory import SECONDS, format_memory, memory_cases, run_case_process, summarize
from mizuoto.runtime.hub import resolve_model
from mizuoto.runtime.options import LoadOptions, add_load_arguments, options_from_args
from mizuoto.runtime.threads import in_thread


# --- finding a driver --------------------------------------------------------------------------

def load_factory(spec: str) -> Callable[..., BenchDriver]:
    """`path/to/file.py:name` or `package.module:name` -> the named callable."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise InvalidRequest(f"--driver takes FILE.py:NAME or MODULE:NAME, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise InvalidRequest(f"--driver: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"_mizuoto_bench_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise InvalidRequest(f"--driver: {target} has no {attr!r}") from None


def find_factory(model_dir: Path | None, random: str | None) -> Callable[..., BenchDriver]:
    """The registered engine that can bench `model_dir` (or build `random`): its `Engine.bench_driver`."""
    from mizuoto.runtime.plugins import Registry

    registry = Registry()
    offered = []
    engines = registry.load_all() if random is not None else \
        {name: registry.engine_class(name) for name, _ in registry.detect(model_dir)}
    for name, cls in engines.items():
        if not cls.offers_bench():
            continue
        offered += [f"{k} ({name})" for k in cls.bench_random]
        if random is None or random in cls.bench_random:
            return cls().bench_driver
    if random is not None:
        raise InvalidRequest(f"bench: no engine builds a random {random!r} model; offered: "
                             f"{', '.join(offered) or 'none'} (or pass --driver FILE.py:NAME)")
    raise InvalidRequest(f"bench: no registered engine offers a bench driver for {model_dir} "
                         "(or pass --driver FILE.py:NAME)")


# --- command line ------------------------------------------------------------------------------

def configure(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the bench arguments to `p`; return the runner."""
    p.add_argument("model_dir", nargs="?", help="model directory (or use --random)")
    p.add_argument("-m", "--model", dest="model_opt", metavar="DIR",
                   help="model directory or Hugging Face repo id (same as MODEL_DIR)")
    p.add_argument("--random", metavar="KIND", help="build a full-size model with random weights, e.g. cosyvoice2")
    p.add_argument("--driver", metavar="FILE.py:NAME", help="bench driver factory to use instead of the engine's")
    p.add_argument("--workdir", help="where --random writes its model directory (default: a temporary one;"
                   " a directory written before is reused)")
    p.add_argument("--assets", help="where --random finds the model's yaml and configs (default: $MIZUOTO_ASSETS"
                   " or the shared assets)")
    p.add_argument("--text", default=BenchSettings.text, help="text of the request")
    p.add_argument("--prompt-text", default="", help="prompt (reference) text of the request")
    p.add_argument("--tokens", type=int, help=f"speech tokens per run, stop tokens suppressed "
                   f"(default {BenchSettings.tokens}; {CPU_DEFAULTS['tokens']} off CUDA)")
    p.add_argument("--runs", type=int, help=f"measured runs, the median is reported "
                   f"(default {BenchSettings.runs}; {CPU_DEFAULTS['runs']} off CUDA)")
    p.add_argument("--warmup", type=int, help=f"runs before measuring "
                   f"(default {BenchSettings.warmup}; {CPU_DEFAULTS['warmup']} off CUDA)")
    p.add_argument("--stream", action="store_true", help="also time a streamed request (first-chunk latency)")
    p.add_argument("--reference", metavar="CLIP", help="also time the voice prompt of a reference clip: for a new"
                   " voice, and for the same clip again (as a request that sends it each time)")
    p.add_argument("--threaded", nargs="?", const="compute", choices=("compute", "beside"),
                   help="compute: load and measure in one worker thread (the main thread computes nothing);"
                        " beside: measure in the main thread, then again in a new worker thread, both reported")
    p.add_argument("--concurrency", metavar="N,N,...", type=_counts,
                   help="also start N streamed requests at once for each N, e.g. 1,2,4,8: aggregate LM tokens/s,"
                        " audio seconds per second, first-chunk p50/p95, peak memory")
    p.add_argument("--memory", nargs="?", const=",".join(str(x) for x in SECONDS), metavar="SECONDS,...",
                   type=_seconds, help="instead of timing: each stage call's planned working memory against its"
                   " measured peak, for requests of these lengths (default 1,5,15,30,60 s), whole and streamed,"
                   " each in a fresh process")
    p.add_argument("--memory-rows", metavar="N,N,...", type=_counts, default=[1, 8],
                   help="with --memory: the LM's batch rows of the whole requests (default 1,8; "
                        "without 1, only the batched ones; streamed requests are one row)")
    p.add_argument("--memory-modes", metavar="MODE,...", type=_modes, default=["whole", "streamed"],
                   help="with --memory: whole, streamed or both (default both)")
    p.add_argument("--memory-served", action="store_true",
                   help="with --memory and rows above 1: run the batched cases as a server runs them (each row a "
                        "request of its own length, up to the case's, its flow and vocoder calls on the batch loop's "
                        "thread beside the rows still decoding) instead of one batch of equal rows")
    add_load_arguments(p)
    p.add_argument("--bandwidth", type=float, help="the device's peak bandwidth in GB/s (overrides the lookup)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return run_bench


def _counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2,4,8, got {text!r}") from None


def _seconds(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected seconds like 1,5,15,30,60, got {text!r}")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - {"whole", "streamed"}:
        raise argparse.ArgumentTypeError(f"expected whole, streamed or both, got {text!r}")
    return modes


def add_bench_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on an argparse subparsers object; the parser's `run` default is run_bench."""
    p = subparsers.add_parser("bench", help="time each stage of a model on a fixed request",
                              description=__doc__.split("\n\n")[0])
    p.set_defaults(run=configure(p))
    return p


def _options(args: argparse.Namespace) -> LoadOptions:
    # the sweep measures the LM batched at its widest level, unless --option compute.batch says otherwise
    levels = getattr(args, "concurrency", None)
    return options_from_args(args, {"compute.batch": max(levels)} if levels else None).resolved()


def run_bench(args: argparse.Namespace) -> int:
    """Run `mizuoto bench` from parsed arguments; print the table or JSON."""
    if getattr(args, "model_opt", None) is not None:
        if args.model_dir is not None and args.model_dir != args.model_opt:
            raise InvalidRequest("bench: give the model directory once (MODEL_DIR or -m DIR)")
        args.model_dir = args.model_opt
    if (args.model_dir is None) == (args.random is None):
        raise InvalidRequest("bench: give a model directory or --random KIND (one of them)")
    if getattr(args, "memory", None):
        return run_memory(args)
    options = _options(args)
    defaults = asdict(BenchSettings()) if options.device.startswith("cuda") else CPU_DEFAULTS
    counts = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in CPU_DEFAULTS}
    settings = BenchSettings(text=args.text, prompt_text=args.prompt_text, stream=args.stream,
                             reference=getattr(args, "reference", None), **counts)
    model_dir = resolve_model(args.model_dir) if args.model_dir else None
    if model_dir is not None and not model_dir.is_dir():
        raise InvalidRequest(f"bench: not a directory: {model_dir}")
    factory = load_factory(args.driver) if args.driver else find_factory(model_dir, args.random)
    threaded = getattr(args, "threaded", None)
    sweep = bool(getattr(args, "concurrency", None))
    # A sweep's batch loop must be the only live OpenMP team (docs/performance.md, "Threads"): the
    # load and the single-request table then run each in a thread of its own that ends with it.
    per_phase = sweep and threaded != "beside"

    def phase(fn: Callable[[], Any]) -> Any:
        return in_thread(fn, "mizuoto-bench") if per_phase else fn()

    def measure() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="mizuoto-bench-") as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            extra = {"assets": args.assets} if getattr(args, "assets", None) else {}
            driver = phase(lambda: factory(model_dir, args.random, options, settings, workdir, **extra))
            try:
                result = phase(lambda: benchmark(driver, settings, args.bandwidth))
                if threaded == "beside":
                    result["threaded"] = in_thread(lambda: benchmark(driver, settings, args.bandwidth), "mizuoto-bench")
                if sweep:
                    result["concurrency"] = concurrency_sweep(driver, settings, args.concurrency)
                    result["batch_width"] = getattr(driver, "batch_width", 1)
            except torch.OutOfMemoryError as exc:
                raise MizuotoError(f"bench: out of memory on {driver.device}: {exc}") from None
            return result

    result = in_thread(measure, "mizuoto-bench") if threaded == "compute" and not sweep else measure()
    result["thread"] = ("a worker thread per phase (load, runs), then the sweep" if per_phase else
                        {"compute": "one worker thread (load and runs)",
                         "beside": "main, then a worker thread"}.get(threaded, "main"))
    result["settings"] = asdict(settings)
    result["options"] = {"device": options.device, "precision": options.precision, **asdict(options.compute)}
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def run_memory(args: argparse.Namespace) -> int:
    """`mizuoto bench --memory`: every case in a fresh process; the calibration table (or JSON)."""
    batch = max(args.memory_rows)
    options = options_from_args(args, {"compute.batch": batch} if batch > 1 else None).resolved()
    if args.memory_served and (batch < 2 or "whole" not in args.memory_modes):
        raise InvalidRequest("--memory-served runs whole requests in a batch: it needs --memory-rows above 1 and "
                             "--memory-modes with whole")
    cases = memory_cases(args.memory, [m == "streamed" for m in args.memory_modes], args.memory_rows,
                         args.memory_served)
    with tempfile.TemporaryDirectory(prefix="mizuoto-bench-") as tmp:
        spec = {"model_dir": str(resolve_model(args.model_dir)) if args.model_dir else None, "random": args.random,
                "workdir": args.workdir or tmp, "assets": getattr(args, "assets", None), "driver": args.driver,
                "options": options.as_dict()}
        calls = []
        for case in cases:
            print(f"bench --memory: {case.label} ...", file=sys.stderr, flush=True)
            calls += run_case_process({**spec, "case": asdict(case)})
    table = summarize(calls)
    if args.json:
        print(json.dumps({"calls": calls, "summary": table, "options": options.as_dict()}, indent=2))
    else:
        where = args.model_dir or f"random {args.random}"
        print(format_memory(table, f"{where} on {options.device}: planned vs measured working memory per stage call"))
    return 0


def _text(result: dict[str, Any]) -> str:
    text = format_table(result) + f"\nthread        {result['thread']}"
    if "threaded" in result:
        main, worker = result["lm_ms_per_token"], result["threaded"]["lm_ms_per_token"]
        text += (f"\nthreaded LM   {worker:.2f} ms/token in a worker thread vs {main:.2f} in the main thread"
                 f" ({worker / main:.2f}x); RTF {result['threaded']['rtf']:.3f}")
    if "concurrency" in result:
        text += "\n\n" + format_concurrency(result["concurrency"], result["batch_width"])
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m mizuoto.runtime.bench ...` (the same as `mizuoto bench ...`)."""
    parser = argparse.ArgumentParser(prog="mizuoto bench", description=__doc__.split("\n\n")[0])
    run = configure(parser)
    try:
        return run(parser.parse_args(argv))
    except MizuotoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
