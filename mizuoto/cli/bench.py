"""`mizuoto bench`: the command line over the engine-neutral harness in mizuoto.runtime.bench.

Any model directory is timed through the engine contract first (the Runtime's own synthesize:
load time, time to the first chunk, wall time per request, RTF), whatever its engine; where the
engine offers a bench driver (`Engine.bench_driver`, e.g. CosyVoice's), its per-stage figures follow.
The driver comes from the engine of the model directory (or of `--random KIND`), or from
`--driver path/to/file.py:factory` (or `package.module:factory`). Building the parser imports
no torch: the harness is imported when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from mizuoto import progress
from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.hub import resolve_model
from mizuoto.runtime.options import LoadOptions, add_load_arguments, options_from_args
from mizuoto.runtime.threads import in_thread

# mizuoto.runtime.bench's BenchSettings and CPU_DEFAULTS and bench_memory's SECONDS, spelled here so the
# parser needs no torch (tests/runtime/test_bench.py keeps them equal): (on CUDA, off CUDA)
HELP_DEFAULTS = {"tokens": (250, 100), "runs": (5, 1), "warmup": (2, 1)}
MEMORY_SECONDS = "1,5,15,30,60"


# --- finding a driver --------------------------------------------------------------------------

def load_factory(spec: str) -> Callable[..., Any]:
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


def find_factory(model_dir: Path | None, random: str | None, required: bool = True) -> Callable[..., Any] | None:
    """The registered engine that can bench `model_dir` (or build `random`): its `Engine.bench_driver`.

    With `required` False, a model directory whose engine offers no driver gives None (the contract
    figures are all there is for it) instead of an error."""
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
    if not required:
        return None
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
    p.add_argument("--text", help="text of the request (default: a sentence about Mizuoto)")
    p.add_argument("--prompt-text", default="", help="prompt (reference) text of the request")
    p.add_argument("--tokens", type=int, help=f"speech tokens per run, stop tokens suppressed "
                   f"(default {HELP_DEFAULTS['tokens'][0]}; {HELP_DEFAULTS['tokens'][1]} off CUDA)")
    p.add_argument("--runs", type=int, help=f"measured runs, the median is reported "
                   f"(default {HELP_DEFAULTS['runs'][0]}; {HELP_DEFAULTS['runs'][1]} off CUDA)")
    p.add_argument("--warmup", type=int, help=f"runs before measuring "
                   f"(default {HELP_DEFAULTS['warmup'][0]}; {HELP_DEFAULTS['warmup'][1]} off CUDA)")
    p.add_argument("--voice", help="the contract run's voice: a preset id (default: the model's first preset;"
                   " a model without presets clones --reference, with --prompt-text as its transcript)")
    p.add_argument("--no-contract", action="store_true",
                   help="skip the engine-contract figures (Runtime synthesize) where the engine has a driver")
    p.add_argument("--stream", action="store_true", help="also time a streamed request (first-chunk latency)")
    p.add_argument("--reference", metavar="CLIP", help="also time the voice prompt of a reference clip: for a new"
                   " voice, and for the same clip again (as a request that sends it each time)")
    p.add_argument("--threaded", nargs="?", const="compute", choices=("compute", "beside"),
                   help="compute: load and measure in one worker thread (the main thread computes nothing);"
                        " beside: measure in the main thread, then again in a new worker thread, both reported")
    p.add_argument("--concurrency", metavar="N,N,...", type=_counts,
                   help="also start N streamed requests at once for each N, e.g. 1,2,4,8: aggregate LM tokens/s,"
                        " audio seconds per second, first-chunk p50/p95, peak memory")
    p.add_argument("--memory", nargs="?", const=MEMORY_SECONDS, metavar="SECONDS,...",
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
    p.add_argument("--plot", metavar="FILE.png", help="also draw the figures printed (needs the plot extra)")
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
    from mizuoto.runtime.bench import CPU_DEFAULTS, BenchSettings

    if getattr(args, "model_opt", None) is not None:
        if args.model_dir is not None and args.model_dir != args.model_opt:
            raise InvalidRequest("bench: give the model directory once (MODEL_DIR or -m DIR)")
        args.model_dir = args.model_opt
    if (args.model_dir is None) == (args.random is None):
        raise InvalidRequest("bench: give a model directory or --random KIND (one of them)")
    if getattr(args, "plot", None):
        from mizuoto.cli.plots import check_plot_path

        check_plot_path(args.plot)
    if getattr(args, "memory", None):
        return run_memory(args)
    options = _options(args)
    defaults = asdict(BenchSettings()) if options.device.startswith("cuda") else CPU_DEFAULTS
    counts = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in CPU_DEFAULTS}
    text = {"text": args.text} if getattr(args, "text", None) is not None else {}
    settings = BenchSettings(prompt_text=args.prompt_text, stream=args.stream,
                             reference=getattr(args, "reference", None), **text, **counts)
    model_dir = resolve_model(args.model_dir) if args.model_dir else None
    if model_dir is not None and not model_dir.is_dir():
        raise InvalidRequest(f"bench: not a directory: {model_dir}")
    factory = load_factory(args.driver) if args.driver else find_factory(model_dir, args.random, required=False)
    contract = None
    if model_dir is not None and not args.driver and (factory is None or not getattr(args, "no_contract", False)):
        contract = contract_bench(model_dir, args, options, settings)
    if factory is None:  # the engine offers no driver: the contract's figures are the result
        result = {"model": contract["model"], "device": contract["device"], "contract": contract}
    else:
        result = _driver_bench(factory, model_dir, args, options, settings)
        if contract is not None:
            result["contract"] = contract
    result["settings"] = asdict(settings)
    result["options"] = {"device": options.device, "precision": options.precision, **asdict(options.compute)}
    print(json.dumps(result, indent=2) if args.json else _text(result))
    if getattr(args, "plot", None):
        from mizuoto.cli.plots import plot_bench

        plot_bench(result, args.plot)
        if not args.json:
            print(f"plotted in {args.plot}")
    return 0


def _driver_bench(factory: Callable[..., Any], model_dir: Path | None, args: argparse.Namespace,
                  options: LoadOptions, settings: Any) -> dict[str, Any]:
    """The engine's own per-stage figures, from its bench driver."""
    import torch

    from mizuoto.runtime.bench import benchmark, concurrency_sweep

    threaded = getattr(args, "threaded", None)
    sweep = bool(getattr(args, "concurrency", None))
    # A sweep's batch loop must be the only live OpenMP team (docs/performance.md, "Threads"): the
    # load and the single-request table then run each in a thread of its own that ends with it.
    per_phase = sweep and threaded != "beside"

    def phase(what: str, fn: Callable[[], Any]) -> Any:
        with progress.step(f"bench: {what}"):
            return in_thread(fn, "mizuoto-bench") if per_phase else fn()

    runs = f"{settings.warmup} warm-up and {settings.runs} measured run(s) of {settings.tokens} tokens per stage"

    def measure() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="mizuoto-bench-") as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            extra = {"assets": args.assets} if getattr(args, "assets", None) else {}
            where = model_dir if model_dir is not None else f"a random {args.random} model"
            driver = phase(f"loading {where} for the engine's bench driver",
                           lambda: factory(model_dir, args.random, options, settings, workdir, **extra))
            try:
                result = phase(runs + (", streamed too" if settings.stream else ""),
                               lambda: benchmark(driver, settings, args.bandwidth))
                if threaded == "beside":
                    with progress.step(f"bench: {runs} again in a worker thread"):
                        result["threaded"] = in_thread(lambda: benchmark(driver, settings, args.bandwidth),
                                                       "mizuoto-bench")
                if sweep:
                    with progress.step(f"bench: concurrency sweep {','.join(map(str, args.concurrency))}"):
                        result["concurrency"] = concurrency_sweep(driver, settings, args.concurrency)
                    result["batch_width"] = getattr(driver, "batch_width", 1)
            except torch.OutOfMemoryError as exc:
                raise MizuotoError(f"bench: out of memory on {driver.device}: {exc}") from None
            return result

    result = in_thread(measure, "mizuoto-bench") if threaded == "compute" and not sweep else measure()
    result["thread"] = ("a worker thread per phase (load, runs), then the sweep" if per_phase else
                        {"compute": "one worker thread (load and runs)",
                         "beside": "main, then a worker thread"}.get(threaded, "main"))
    return result


def contract_bench(model_dir: Path, args: argparse.Namespace, options: LoadOptions, settings: Any) -> dict[str, Any]:
    """Any engine through the engine contract: the Runtime loads the model and synthesizes the bench request
    (streamed where the model streams), `settings.warmup` times unmeasured, then `settings.runs` times."""
    from mizuoto.runtime.api import Runtime
    from mizuoto.runtime.engine import Reference, SynthesisRequest

    with Runtime(vram=getattr(args, "vram", None), ram=getattr(args, "ram", None)) as rt:
        start = time.perf_counter()
        with progress.step(f"bench: loading {model_dir} through the Runtime"):
            name = rt.load(str(model_dir), engine=getattr(args, "engine", None), **options.as_dict())
        load_s = time.perf_counter() - start
        info, model = rt.info(name), rt.model(name)
        presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
        voice: Any = getattr(args, "voice", None) or (presets[0] if presets else None)
        if settings.reference and not getattr(args, "voice", None):
            voice = Reference(settings.reference, settings.prompt_text or None)
        out: dict[str, Any] = {"model": f"{info.engine}{f' {info.variant}' if info.variant else ''} {name}",
                               "device": str(info.device), "load_s": load_s}
        if voice is None:
            out["skipped"] = ("the model has no preset voice: give --reference CLIP (and --prompt-text, its"
                              " transcript) for a cloned request")
            return out
        stream = bool(model.capabilities.stream_out)
        request = SynthesisRequest(settings.text, voice=voice, stream=stream, seed=0)
        runs = []
        with progress.step(f"bench: {settings.warmup} warm-up and {settings.runs} measured request(s) through"
                           " Runtime.synthesize"):
            for i in range(settings.warmup + settings.runs):
                t0 = time.perf_counter()
                first, audio = None, 0.0
                for chunk in rt.synthesize(name, request):
                    first = time.perf_counter() - t0 if first is None else first
                    audio += chunk.samples.numel() / chunk.sample_rate
                wall = time.perf_counter() - t0
                if i >= settings.warmup:
                    runs.append({"first_chunk_ms": 1e3 * (first or wall), "wall_ms": 1e3 * wall,
                                 "audio_seconds": audio, "rtf": wall / audio if audio else float("inf")})
    out.update({"voice": voice if isinstance(voice, str) else f"clone of {settings.reference}",
                "mode": request.mode or ("preset" if isinstance(voice, str) else "clone"),
                "streamed": stream, "runs": runs,
                **{key: statistics.median(r[key] for r in runs)
                   for key in ("first_chunk_ms", "wall_ms", "audio_seconds", "rtf")}})
    return out


def run_memory(args: argparse.Namespace) -> int:
    """`mizuoto bench --memory`: every case in a fresh process; the calibration table (or JSON)."""
    from mizuoto.runtime.bench_memory import format_memory, memory_cases, run_case_process, summarize

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
        for i, case in enumerate(cases, 1):
            print(f"bench --memory: [{i}/{len(cases)}] {case.label} ...", file=sys.stderr, flush=True)
            calls += run_case_process({**spec, "case": asdict(case)})
    table = summarize(calls)
    if args.json:
        print(json.dumps({"calls": calls, "summary": table, "options": options.as_dict()}, indent=2))
    else:
        where = args.model_dir or f"random {args.random}"
        print(format_memory(table, f"{where} on {options.device}: planned vs measured working memory per stage call"))
    return 0


def format_contract(c: dict[str, Any]) -> str:
    """The engine-contract figures as aligned lines."""
    rows = [("model", c["model"]), ("device", c["device"]), ("load", f"{c['load_s']:.2f} s")]
    if "skipped" in c:
        rows.append(("requests", f"not run: {c['skipped']}"))
    else:
        n = len(c["runs"])
        each = ", ".join(f"{r['wall_ms']:.0f}" for r in c["runs"])
        rows += [("request", f"{c['mode']}, voice {c['voice']}; {'streamed' if c['streamed'] else 'whole'};"
                             f" median of {n} run(s)"),
                 ("first chunk", f"{c['first_chunk_ms']:.0f} ms"),
                 ("request wall", f"{c['wall_ms']:.0f} ms for {c['audio_seconds']:.2f} s of audio"
                                  f" (each: {each} ms)"),
                 ("RTF", f"{c['rtf']:.3f} (wall time / audio time)")]
    width = max(len(k) for k, _ in rows)
    return "engine contract (Runtime.synthesize)\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _text(result: dict[str, Any]) -> str:
    from mizuoto.runtime.bench import format_concurrency, format_table

    contract = format_contract(result["contract"]) if "contract" in result else ""
    if "lm_ms_per_token" not in result:  # no driver: the contract's figures only
        return contract
    text = (contract + "\n\nengine's bench driver (per stage)\n" if contract else "") + format_table(result) + \
        f"\nthread        {result['thread']}"
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
