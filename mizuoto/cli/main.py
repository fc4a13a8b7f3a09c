"""The `mizuoto` command: engines, models --plan, say. Errors are one line on stderr; --debug shows tracebacks.

Building the parser imports nothing heavy (no torch): `mizuoto --help` and a mistyped command answer
at once; each command imports what it runs when it runs. Every command takes `--log-level` (the
package's log lines, on stderr) and `--progress`/`--no-progress` (what a slow step is doing, on
stderr; by default on when stderr is a terminal).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from mizuoto import progress
from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.options import add_load_arguments, options_from_args

# mizuoto.runtime.engine.MODES, spelled here so the parser needs no torch (a test keeps them equal)
MODES = ("preset", "clone", "cross_lingual", "instruct", "vc")
# the longest text `say` takes unless --max-input-chars says otherwise: the server's default limit
# (mizuoto.server.state.ServerConfig.max_input_chars; a test keeps them equal)
MAX_INPUT_CHARS = 4096
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

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
    p.add_argument("--plot", metavar="FILE.png", help="with --plan: also draw the plans (needs the plot extra)")
    _load_arguments(p)

    def run(args: argparse.Namespace) -> int:
        from mizuoto.runtime.api import Runtime

        options_from_args(args)  # a bad load option is a mistake even where nothing loads
        if args.plot:
            if not args.plan:
                raise InvalidRequest("models --plot draws the memory plans: add --plan")
            from mizuoto.cli.plots import check_plot_path

            check_plot_path(args.plot)
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
            _load(rt, "models", d, args.engine, {**options.as_dict(), "device": "cpu"})
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
    if args.plot:
        from mizuoto.cli.plots import plot_plans

        plans = [a.plan for a in rehearsal.admissions if a.plan is not None]
        refusals = [a.refused for a in rehearsal.admissions if a.plan is None]
        plot_plans(plans, refusals, args.plot)
        print(f"plotted {len(plans)} plan(s) in {args.plot}")
    return 1 if refused else 0


def _load(rt, command: str, model: str, engine: str | None, options: dict) -> str:
    """rt.load with a progress line saying what loads, and then what loaded where in how long."""
    done: dict[str, str] = {}

    def closing(seconds: float) -> str:
        return f"{command}: loaded {done.get('what', model)} in {seconds:.1f} s"

    with progress.step(f"{command}: loading {model}", closing):
        name = rt.load(model, engine=engine, **options)
        info = rt.info(name)
        done["what"] = f"{name} ({info.engine}{f' {info.variant}' if info.variant else ''} on {info.device})"
    return name


@command("say", "synthesize TEXT with a model into an audio file (.wav, .mp3, .flac, .ogg/.opus, .aac)")
def _say_setup(p: argparse.ArgumentParser) -> Callable:
    p.add_argument("text", nargs="?", help="text to speak ('-' reads stdin; omit for --mode vc)")
    p.add_argument("-m", "--model", required=True,
                   help="model directory, a plugin's model id (en_US-joe-medium) or Hugging Face repo id"
                        " (org/name[@rev])")
    p.add_argument("-o", "--output", required=True,
                   help="output file, written atomically in the format its name says: .wav (16-bit PCM), .mp3, .flac,"
                        " .ogg/.opus, .aac (needs the aac extra), .pcm (raw 16-bit)")
    p.add_argument("--float", dest="float_wav", action="store_true", help="a .wav of 32-bit float samples instead")
    p.add_argument("--max-input-chars", type=int, default=MAX_INPUT_CHARS, metavar="N",
                   help=f"refuse longer text (default {MAX_INPUT_CHARS}, the server's limit)")
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

        from mizuoto.nn.dsp.encode import format_for_path
        from mizuoto.runtime.api import Runtime
        from mizuoto.runtime.engine import Reference, SynthesisRequest, check_request
        from mizuoto.runtime.request_options import parse_settings

        if args.ref_text is not None and args.ref_audio is None:
            raise InvalidRequest("--ref-text needs --ref-audio")
        fmt = format_for_path(args.output)  # an extension it cannot write is a mistake before any work
        if args.float_wav and fmt != "wav":
            raise InvalidRequest(f"--float writes a float WAV; {args.output} names {fmt}")
        text = sys.stdin.read() if args.text == "-" else args.text
        if text is not None and args.max_input_chars > 0 and len(text) > args.max_input_chars:
            raise InvalidRequest(f"the text is {len(text):,} characters, more than {args.max_input_chars:,} (the"
                                 " server's limit too): split it, or raise the limit with --max-input-chars N")
        voice = Reference(args.ref_audio, args.ref_text) if args.ref_audio else args.voice
        request = SynthesisRequest(text=text, mode=args.mode, voice=voice, instruct=args.instruct,
                                   source_audio=args.source_audio, speed=args.speed, stream=args.stream,
                                   seed=args.seed)
        with Runtime(vram=args.vram, ram=args.ram) as rt:
            name = _load(rt, "say", args.model, args.engine, options_from_args(args).as_dict())
            info = rt.info(name)
            presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
            if voice is None and args.source_audio is None and presets:  # as the HTTP API: the first preset
                request = replace(request, voice=presets[0])
            if args.param:
                declared = rt.model(name).capabilities.options
                request = replace(request, options=parse_settings(declared, args.param, f"model {name}"))
            request = check_request(request, rt.model(name), name)  # the mode it runs in, for the user
            what = f"say: {request.mode} with {name}" + (f", {len(text):,} characters" if text else "")
            seconds, rate, count = write_audio(args.output, _counted(rt.synthesize(name, request), what),
                                               fmt, args.float_wav)
        kind = ("32-bit float wav" if args.float_wav else
                {"wav": "16-bit PCM wav", "pcm": "raw 16-bit PCM"}.get(fmt, fmt))
        print(f"wrote {args.output}: {seconds:.2f} s at {rate} Hz in {count} chunk(s)"
              f" ({info.engine} engine on {info.device}); mode {request.mode}{_why_mode(args, request)}, {kind}")
        return 0
    return run


def _why_mode(args: argparse.Namespace, request) -> str:
    """Why a mode the user did not name was chosen, where it may surprise them."""
    if args.mode is None and request.mode == "cross_lingual" and args.ref_audio and args.ref_text is None:
        return " (no --ref-text: the clip gives the voice, not its words; add --ref-text for mode clone)"
    if args.mode is None and request.mode == "preset" and args.voice is None:
        return f" (the model's first preset voice, {request.voice})"
    return ""


def _counted(chunks: Iterable, what: str) -> Iterable:
    """The chunks, with a progress line (elapsed time, chunks and audio so far) while they come."""
    if not progress.enabled():
        yield from chunks
        return
    state = {"chunks": 0, "audio": 0.0}

    def status() -> str:
        return f"{state['chunks']} chunk(s), {state['audio']:.1f} s of audio" if state["chunks"] else ""

    def closing(seconds: float) -> str:
        rtf = f", RTF {seconds / state['audio']:.2f}" if state["audio"] else ""
        return f"{what}: {state['audio']:.2f} s of audio in {seconds:.1f} s{rtf}"

    with progress.step(what, closing, status=status):
        for chunk in chunks:
            state["chunks"] += 1
            state["audio"] += chunk.samples.numel() / chunk.sample_rate
            yield chunk


def write_audio(path: str | Path, chunks: Iterable, fmt: str | None = None,
                float32: bool = False) -> tuple[float, int, int]:
    """Collect audio chunks and write them atomically in the format `path` names (or `fmt`): 16-bit PCM wav
    by default, as the server writes it; `float32`: a float WAV. Returns (seconds, rate, chunks)."""
    import torch

    from mizuoto.files import atomic_write_bytes
    from mizuoto.nn.dsp.encode import encode, format_for_path

    fmt = fmt or format_for_path(path)
    pieces = [(c.samples.detach().cpu(), c.sample_rate) for c in chunks]
    if not pieces:
        raise MizuotoError("the engine produced no audio")
    audio, rate = torch.cat([p for p, _ in pieces]), pieces[0][1]
    atomic_write_bytes(path, encode(audio, rate, fmt, float32=float32))
    return audio.numel() / rate, rate, len(pieces)


write_wav = write_audio  # the name the demo and older callers use


_delegated("serve", "serve", "add_serve_arguments", "run_serve",
           "run the HTTP server (OpenAI-style /v1/audio/speech; needs the server extra)")
_delegated("ray-serve", "ray_serve", "add_ray_serve_arguments", "run_ray_serve",
           "serve the HTTP API from Ray Serve replicas, models multiplexed per replica (needs the ray extra)")
_delegated("wyoming", "wyoming", "add_wyoming_arguments", "run_wyoming",
           "run a Wyoming server for Home Assistant's voice pipeline (needs the wyoming extra)")
_delegated("bench", "bench", "configure", "run_bench",
           "time each stage of a model on a fixed request (LM, flow, vocoder; --random builds one)")
_delegated("train", "train", "add_train_arguments", "run_train",
           "fine-tune a model dir on your recordings (features, llm, flow, export)")
_delegated("fetch", "fetch", "add_fetch_arguments", "run_fetch",
           "install a pinned data file a model needs, sha256-checked (whisper-vocab: CosyVoice 1's vocabulary)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand (nothing heavy is imported to build it)."""
    debug = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subparser's default must not overwrite --debug given before the subcommand.
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser = argparse.ArgumentParser(prog="mizuoto", parents=[debug],
                                     description="Mizuoto speech runtime")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, setup) in COMMANDS.items():
        p = sub.add_parser(name, parents=[debug], help=help, description=help)
        p.set_defaults(run=setup(p))
        _common_arguments(p)
    return parser


def _common_arguments(p: argparse.ArgumentParser) -> None:
    """--log-level (where the command has none of its own: serve and wyoming do) and --progress."""
    if "--log-level" not in p._option_string_actions:
        p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                       help="the package's log lines shown on stderr (default info)")
    if "--progress" in p._option_string_actions:
        return
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress lines on stderr while slow work runs (default: on when stderr is a terminal)")


class _StderrHandler(logging.StreamHandler):
    """Log lines on the current sys.stderr (tests swap it), ending an open progress line first."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("mizuoto: %(levelname)s: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        progress.interrupt()
        super().emit(record)


PACKAGE_LOGGERS = ("mizuoto", "mizuoto_piper", "mizuoto_chatterbox")


def configure_logging(level: str) -> Callable[[], None]:
    """Show the package's (and plugins') log lines at `level` on stderr, other libraries' from warning up;
    returns what puts logging back as it was (main() calls it when the command ends)."""
    value = getattr(logging, str(level).upper(), logging.INFO)
    root = logging.getLogger()
    before = root.level, {name: logging.getLogger(name).level for name in PACKAGE_LOGGERS}
    handler = _StderrHandler()
    root.addHandler(handler)
    root.setLevel(max(value, logging.WARNING))
    for name in PACKAGE_LOGGERS:
        logging.getLogger(name).setLevel(value)

    def restore() -> None:
        root.removeHandler(handler)
        root.setLevel(before[0])
        for name, old in before[1].items():
            logging.getLogger(name).setLevel(old)
    return restore


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    # serve and wyoming configure their own logging (uvicorn, Wyoming) from their --log-level
    restore = configure_logging(args.log_level) if args.command not in ("serve", "wyoming") else (lambda: None)
    if progress.wanted(args.progress):
        progress.enable()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        kind = "error" if isinstance(e, MizuotoError) else f"internal error ({type(e).__name__})"
        hint = "" if isinstance(e, MizuotoError) else " (run with --debug for the traceback)"
        progress.interrupt()
        print(f"mizuoto: {kind}: {' '.join(str(e).split())}{hint}", file=sys.stderr)
        return 1
    finally:
        progress.disable()
        restore()


if __name__ == "__main__":
    sys.exit(main())
