"""The `mizuoto` command: engines, models --plan, say. Errors are one line on stderr; --debug shows tracebacks."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.options import add_load_arguments, options_from_args

# Subcommand name -> (help, setup(parser) -> run(args) -> exit code).
COMMANDS: dict[str, tuple[str, Callable]] = {}


def command(name: str, help: str):
    """Register a subcommand: the decorated function sets up its parser and returns its runner."""
    def register(setup: Callable) -> Callable:
        COMMANDS[name] = (help, setup)
        return setup
    return register


def _delegated(name: str, module: str, add: str, run: str, help: str) -> None:
    """Register a command whose flags (`add`) and runner (`run`) live in mizuoto.cli.<module> (imported lazily)."""
    def setup(p: argparse.ArgumentParser) -> Callable:
        mod = importlib.import_module(f"mizuoto.cli.{module}")
        getattr(mod, add)(p)
        return getattr(mod, run)
    COMMANDS[name] = (help, setup)


def _load_arguments(p: argparse.ArgumentParser) -> None:
    """Budgets, engine and load options: the flags of every command that loads a model."""
    p.add_argument("--vram", help="GPU memory budget, e.g. 4GiB (default: what is free on the GPU)")
    p.add_argument("--ram", help="host memory budget, e.g. 16GiB (default: what is available)")
    p.add_argument("--engine", help="engine name (default: detected from the directory)")
    add_load_arguments(p)


@command("engines", "list the registered engines and their capabilities")
def _engines_setup(p: argparse.ArgumentParser) -> Callable:
    def run(args: argparse.Namespace) -> int:
        from mizuoto.runtime.api import Runtime

        rt = Runtime()
        for name, cls in rt.engines().items():
            caps = cls.capabilities
            what = (f"modes {','.join(sorted(caps.modes))}; {caps.sample_rate} Hz"
                    f"{'; stream out' if caps.stream_out else ''}{'; stream in' if caps.stream_in else ''}"
                    f"{'; languages ' + ','.join(caps.languages) if caps.languages else ''}"
                    if caps else "capabilities depend on the model")
            print(f"{name:<12} [{rt.registry.plugin_of(name)}] {what}{'  - ' + cls.description if cls.description else ''}")
            for option in caps.options if caps else ():
                print(f"{'':<12}   --param {option.describe()}")
        for failure in rt.failures:
            print(f"unavailable: {failure}")
        return 0
    return run


@command("models", "detect model directories and show their memory plans")
def _models_setup(p: argparse.ArgumentParser) -> Callable:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="model directories or Hugging Face repo ids")
    p.add_argument("--plan", action="store_true", help="print each model's memory plan and what admission evicts")
    p.add_argument("--stream", action="store_true", help="plan for streaming requests")
    _load_arguments(p)

    def run(args: argparse.Namespace) -> int:
        from mizuoto.runtime.api import Runtime

        options_from_args(args)  # a bad load option is a mistake even where nothing loads
        if not args.plan:
            rt = Runtime(ram=args.ram)
            for d in args.dirs:
                hits = rt.detect(d)
                found = ", ".join(f"{e}{f' ({v})' if v else ''}" for e, v in hits) or "no engine recognises it"
                print(f"{d}: {found}")
            return 0
        return _plan(args)
    return run


def _plan(args: argparse.Namespace) -> int:
    """`models --plan`: the models are loaded on the host and the runtime rehearses them on the target device."""
    import torch

    from mizuoto.runtime.api import Runtime
    from mizuoto.runtime.memory import detect_budget, format_bytes, parse_bytes

    options = options_from_args(args)
    target = options.device if options.device != "auto" else options.resolved().device
    kind = torch.device(target).type
    present = kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()) or \
        (kind == "mps" and torch.backends.mps.is_available())
    if not present:
        if args.vram is None:
            raise InvalidRequest(f"models --plan: there is no {kind} device on this machine to read a budget from;"
                                 f" plan a {target} budget with --vram SIZE (e.g. --vram 8GiB), or leave out --device"
                                 " for a CPU plan")
        print(f"no {kind} device on this machine: this is a {target} plan for the budget"
              f" --vram {format_bytes(parse_bytes(args.vram))} (arithmetic only)")
    elif kind == "cpu" and args.vram is not None:
        print(f"planning for cpu ({'no GPU on this machine' if args.device is None else 'as asked'}) within the"
              " host budget; --vram is a GPU budget: add --device cuda to plan for it")
    refused = 0
    # No host budget while loading, so no load evicts another: the rehearsal applies the budgets.
    with Runtime(ram=1 << 62) as rt:
        for d in args.dirs:
            rt.load(d, engine=args.engine, **{**options.as_dict(), "device": "cpu"})
        ram = args.ram if args.ram is not None else detect_budget("cpu")
        rehearsal = rt.rehearse(target, args.stream, vram=args.vram, ram=ram)
    for admission in rehearsal.admissions:
        if admission.plan is None:
            print(f"refused: {admission.refused}")
            refused += 1
            continue
        print(admission.plan.table())
        for ev in admission.evictions:
            print(f"  admitting {admission.model} {ev.action}s {ev.model}")
    print(f"device {rehearsal.device}: {format_bytes(rehearsal.in_use)} of {format_bytes(rehearsal.budget)} in use;"
          f" active: {', '.join(rehearsal.active) or 'none'}; offloaded: {', '.join(rehearsal.offloaded) or 'none'}")
    return 1 if refused else 0


@command("say", "synthesize TEXT with a model into a wav file")
def _say_setup(p: argparse.ArgumentParser) -> Callable:
    from mizuoto.runtime.engine import MODES

    p.add_argument("text", nargs="?", help="text to speak ('-' reads stdin; omit for --mode vc)")
    p.add_argument("-m", "--model", required=True, help="model directory or Hugging Face repo id (org/name[@rev])")
    p.add_argument("-o", "--output", required=True, help="output wav path (written atomically)")
    voice = p.add_mutually_exclusive_group()
    voice.add_argument("--voice", help="preset (or cached) voice id (default: the model's first preset)")
    voice.add_argument("--ref-audio", help="reference audio file to clone")
    p.add_argument("--ref-text", help="transcript of the reference audio")
    p.add_argument("--instruct", help="instruction text (mode instruct)")
    p.add_argument("--source-audio", help="audio to convert (mode vc)")
    p.add_argument("--mode", choices=MODES, help="default: inferred from the other arguments")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--stream", action="store_true", help="request streaming synthesis (chunked audio)")
    p.add_argument("--seed", type=int)
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a request option the model's engine declares (e.g. Chatterbox's cfg_weight=0.3); "
                        "repeatable; an unknown name lists the model's options")
    _load_arguments(p)

    def run(args: argparse.Namespace) -> int:
        from dataclasses import replace

        from mizuoto.runtime.api import Runtime
        from mizuoto.runtime.engine import Reference, SynthesisRequest
        from mizuoto.runtime.request_options import parse_settings

        if args.ref_text is not None and args.ref_audio is None:
            raise InvalidRequest("--ref-text needs --ref-audio")
        text = sys.stdin.read() if args.text == "-" else args.text
        voice = Reference(args.ref_audio, args.ref_text) if args.ref_audio else args.voice
        request = SynthesisRequest(text=text, mode=args.mode, voice=voice, instruct=args.instruct,
                                   source_audio=args.source_audio, speed=args.speed, stream=args.stream,
                                   seed=args.seed)
        with Runtime(vram=args.vram, ram=args.ram) as rt:
            name = rt.load(args.model, engine=args.engine, **options_from_args(args).as_dict())
            info = rt.info(name)
            presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
            if voice is None and args.source_audio is None and presets:  # as the HTTP API: the first preset
                request = replace(request, voice=presets[0])
            if args.param:
                declared = rt.model(name).capabilities.options
                request = replace(request, options=parse_settings(declared, args.param, f"model {name}"))
            seconds, rate, count = write_wav(args.output, rt.synthesize(name, request))
        print(f"wrote {args.output}: {seconds:.2f} s at {rate} Hz in {count} chunk(s)"
              f" ({info.engine} engine on {info.device})")
        return 0
    return run


def write_wav(path: str | Path, chunks: Iterable) -> tuple[float, int, int]:
    """Collect audio chunks and write them as a float WAV, atomically; returns (seconds, rate, chunks)."""
    import torch

    from mizuoto.nn.dsp.wav import write_wav as write

    pieces = [(c.samples.detach().cpu(), c.sample_rate) for c in chunks]
    if not pieces:
        raise MizuotoError("the engine produced no audio")
    audio, rate = torch.cat([p for p, _ in pieces]), pieces[0][1]
    write(path, audio, rate, subtype="FLOAT")
    return audio.numel() / rate, rate, len(pieces)


_delegated("serve", "serve", "add_serve_arguments", "run_serve",
           "run the HTTP server (OpenAI-style /v1/audio/speech; needs mizuoto[server])")
_delegated("ray-serve", "ray_serve", "add_ray_serve_arguments", "run_ray_serve",
           "serve the HTTP API from Ray Serve replicas, models multiplexed per replica (needs mizuoto[ray])")
_delegated("wyoming", "wyoming", "add_wyoming_arguments", "run_wyoming",
           "run a Wyoming server for Home Assistant's voice pipeline (needs mizuoto[wyoming])")
_delegated("bench", "bench", "configure", "run_bench",
           "time each stage of a model on a fixed request (LM, flow, vocoder; --random builds one)")
_delegated("train", "train", "add_train_arguments", "run_train",
           "fine-tune a model dir on your recordings (features, llm, flow, export)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    debug = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subparser's default must not overwrite --debug given before the subcommand.
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser = argparse.ArgumentParser(prog="mizuoto", parents=[debug],
                                     description="Mizuoto speech runtime")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, setup) in COMMANDS.items():
        p = sub.add_parser(name, parents=[debug], help=help, description=help)
        p.set_defaults(run=setup(p))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        kind = "error" if isinstance(e, MizuotoError) else f"internal error ({type(e).__name__})"
        hint = "" if isinstance(e, MizuotoError) else " (run with --debug for the traceback)"
        print(f"mizuoto: {kind}: {' '.join(str(e).split())}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
