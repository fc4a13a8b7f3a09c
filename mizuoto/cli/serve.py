"""`mizuoto serve`: the HTTP server as a subcommand. Every flag can also be set by a MIZUOTO_* variable.

Importing this module needs only the standard library and mizuoto's cheap modules; FastAPI and
uvicorn are imported when the server starts, with a clear error when the `server` extra is not installed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from mizuoto.runtime.options import add_load_arguments, options_from_args

log = logging.getLogger("mizuoto.serve")
HELP = "run the HTTP server (OpenAI-style /v1/audio/speech; needs mizuoto[server])"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's ("trace": debug and more)
NO_MODEL = ("no model to serve: give one with -m [NAME=]DIR (a model directory, a plugin's model id such as"
            " en_US-joe-medium, or a Hugging Face repo id); to start without one and load models later through"
            " POST /v1/models/load, give --model-root DIR and --admin-key KEY")


def _env(name: str, default: object = None) -> object:
    return os.environ.get(f"MIZUOTO_{name}", default)


def _flag(p: argparse.ArgumentParser, flag: str, kind: type | None, default: object, help: str) -> None:
    """Add `flag` with its default from $MIZUOTO_<FLAG> (named at the end of its help), converted by `kind`."""
    env = flag[2:].replace("-", "_").upper()
    value = _env(env, default)
    p.add_argument(flag, type=kind, default=value if kind is None or value is None else kind(value),
                   help=f"{help} [MIZUOTO_{env}]")


def add_shared_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every server command takes (serve, wyoming): models, budgets, load options, jobs and limits."""
    models = [m for m in str(_env("MODELS", "")).split(os.pathsep) if m]
    p.add_argument("-m", "--model", action="append", default=models, metavar="[NAME=]DIR|ORG/NAME",
                   help="model directory or Hugging Face repo id to serve, loaded at start (repeatable)"
                        " [MIZUOTO_MODELS, ':'-separated]")
    _flag(p, "--vram", None, None, "device memory budget, e.g. 6GiB")
    _flag(p, "--ram", None, None, "host memory budget, e.g. 16GiB")
    add_load_arguments(p, os.environ)
    # the default stays a string: argparse converts it, so a bad $MIZUOTO_MAX_CONCURRENT is a usage error
    p.add_argument("--max-concurrent", type=int, default=_env("MAX_CONCURRENT"),
                   help="synthesis jobs running at once, over all models; more wait in the queue"
                        " (default: 4, or --max-batch if larger) [MIZUOTO_MAX_CONCURRENT]")
    _flag(p, "--max-batch", int, 1, "LM batch width of each model (load option compute.batch): up to this many requests"
          " to one model share its LM steps; 1 runs them one at a time, upstream's exact path")
    _flag(p, "--max-queued", int, 32, "jobs that may wait for a slot (first come, first served); more are refused")
    _flag(p, "--queue-timeout", float, 120, "seconds a job may wait in the queue before it is refused (0: no limit)")
    _flag(p, "--request-timeout", float, 300, "seconds a request may run before it is cancelled (0: none)")
    _flag(p, "--max-input-chars", int, 4096, "longest input text")
    _flag(p, "--shutdown-timeout", float, 10, "seconds in-flight requests get to finish on shutdown")
    _flag(p, "--log-level", None, "info", "log level of the lines on stderr: info says each model as it loads and"
          " where the server listens")


def shared_config(args: argparse.Namespace) -> dict:
    """ServerConfig fields of the shared flags, checked (an unavailable device fails here, in one line)."""
    from mizuoto.errors import InvalidRequest

    concurrent = int(args.max_concurrent) if args.max_concurrent is not None else max(4, args.max_batch)
    if args.max_batch < 1 or concurrent < 1:
        raise InvalidRequest(f"--max-batch and --max-concurrent must be at least 1, got {args.max_batch} and {concurrent}")
    if args.max_queued < 0 or args.queue_timeout < 0:
        raise InvalidRequest("--max-queued and --queue-timeout must not be negative")
    options = options_from_args(args, {"compute.batch": args.max_batch})  # an explicit --option wins
    options.resolved()
    return {"max_concurrent": concurrent, "max_queued": args.max_queued, "queue_timeout": args.queue_timeout or None,
            "request_timeout": args.request_timeout or None, "max_input_chars": args.max_input_chars,
            "load_options": options.as_dict()}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve flags, with defaults from the environment."""
    _flag(p, "--host", None, "127.0.0.1", "address to listen on")
    _flag(p, "--port", int, 8000, "port")
    roots = [m for m in str(_env("MODEL_ROOTS", "")).split(os.pathsep) if m]
    p.add_argument("--model-root", action="append", default=roots, metavar="DIR",
                   help="folder whose model directories POST /v1/models/load may load [MIZUOTO_MODEL_ROOTS]")
    add_shared_arguments(p)
    _flag(p, "--api-key", None, None, "require `Authorization: Bearer KEY` on /v1/* (/health, /ready, /metrics stay open)")
    _flag(p, "--admin-key", None, None, "key for loading/unloading models and deleting voices; without it those are off")
    _flag(p, "--header-timeout", float, 10, "seconds a connection may take to send its request headers")
    _flag(p, "--idle-timeout", float, 30, "seconds a request body or WebSocket session may stay silent")
    _flag(p, "--body-timeout", float, 60, "seconds a whole request body may take to arrive")
    _flag(p, "--drain-seconds", float, 2, "on SIGTERM, seconds /ready answers 503 before the listener closes")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction,
                   default=str(_env("ACCESS_LOG", "1")).lower() not in ("0", "false", "no", "off"),
                   help="a line per request on stdout (uvicorn's access log, at level info; default on)"
                        " [MIZUOTO_ACCESS_LOG]")
    _flag(p, "--default-format", None, None, "response_format of a speech request that gives none (default: mp3,"
          " OpenAI's, or wav where mp3 has no encoder; a stream without one is wav)")
    aliases = str(_env("ALIASES", "")).split()
    p.add_argument("--alias", action="append", default=aliases, metavar="ALIAS=MODEL",
                   help="another name for a served model, e.g. tts-1=cosy (repeatable) [MIZUOTO_ALIASES,"
                        " space-separated]")
    voice_aliases = str(_env("VOICE_ALIASES", "")).split()
    p.add_argument("--voice-alias", action="append", default=voice_aliases, metavar="ALIAS=[MODEL/]VOICE",
                   help="another name for a voice: of one model (alloy=piper/joe) or of every model that has it"
                        " (alloy=joe) (repeatable) [MIZUOTO_VOICE_ALIASES, space-separated]")


def add_serve_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` to an argparse subparsers object; the parser's `run` default is run_serve."""
    p = subparsers.add_parser("serve", help=HELP, description=HELP)
    add_serve_arguments(p)
    p.set_defaults(run=run_serve)
    return p


def _models(specs: list[str]) -> dict[str, Path]:
    from mizuoto.errors import InvalidRequest
    from mizuoto.runtime.hub import is_repo_id, resolve_model

    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = (spec.partition("@")[0] if is_repo_id(spec) else None), spec
        if (name is not None and not name.strip()) or not path.strip():
            raise InvalidRequest(f"-m {spec!r}: give a model directory, as DIR or NAME=DIR")
        resolved = resolve_model(path)  # a directory, a plugin's short id, or a Hugging Face repo id's snapshot
        if not resolved.is_dir():
            raise InvalidRequest(f"-m {spec}: model directory not found: {path}")
        if name is None:  # the engine names it (Piper: the voice's name), else the folder's name
            from mizuoto.runtime.plugins import default_registry

            name = path if resolved != Path(path) else default_registry().model_name(resolved)
        if name in out:
            raise InvalidRequest(f"-m {spec}: model name {name!r} is given twice; use NAME=DIR")
        out[name] = resolved
    return out


def run_serve(args: argparse.Namespace) -> int:
    """Load the models (a line for each), serve until SIGINT/SIGTERM, then shut down gracefully."""
    from mizuoto.errors import InvalidRequest, MizuotoError

    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        raise MizuotoError("mizuoto serve needs the server extra: pip install 'mizuoto-runtime[server]'") from None
    from mizuoto.cli.main import configure_logging
    from mizuoto.runtime.api import Runtime
    from mizuoto.server.app import create_app
    from mizuoto.server.launch import config
    from mizuoto.server.state import ServerConfig

    shared = shared_config(args)
    level = str(args.log_level).lower()
    if level not in LOG_LEVELS:
        raise InvalidRequest(f"--log-level {args.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    for flag in ("header_timeout", "idle_timeout", "body_timeout"):
        if getattr(args, flag) <= 0:
            raise InvalidRequest(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    models = _models(args.model)
    if not models and not (args.model_root and args.admin_key):
        raise InvalidRequest(NO_MODEL)
    restore = configure_logging("debug" if level == "trace" else level)
    try:
        server_config = ServerConfig(**shared, model_roots=tuple(Path(r) for r in args.model_root),
                                     api_key=args.api_key or None, admin_key=args.admin_key or None,
                                     header_timeout=args.header_timeout, idle_timeout=args.idle_timeout,
                                     body_timeout=args.body_timeout, drain_seconds=max(0.0, args.drain_seconds),
                                     default_format=_default_format(args.default_format),
                                     model_aliases=tuple(args.alias), voice_aliases=tuple(args.voice_alias))
        runtime = Runtime(vram=args.vram, ram=args.ram)
        app = create_app(runtime, server_config, models)
        state = app.state.mizuoto
        server = _server(config(app, args.host, args.port, args.shutdown_timeout, level, access_log=args.access_log),
                         state, f"http://{args.host}:{args.port}")
        _preload(state)
        if threading.current_thread() is threading.main_thread():
            # uvicorn re-raises the signal it stopped on once it is done; after a graceful stop that
            # signal should end the process normally (exit 0), not kill it.
            signal.signal(signal.SIGTERM, lambda *_: None)
        server.run()
        return 0 if server.started else 1
    finally:
        restore()


def _default_format(given: str | None) -> str:
    """--default-format checked against this machine's encoders; absent: mp3 (OpenAI's), else wav, said in a line."""
    from mizuoto.errors import InvalidRequest
    from mizuoto.server.audio import ENCODER_HINTS, available_formats

    formats = available_formats()
    if given is not None:
        if given not in formats:
            need = f" (it needs {ENCODER_HINTS[given]})" if given in ENCODER_HINTS else ""
            raise InvalidRequest(f"--default-format {given!r} cannot be written here{need}; available: "
                                 f"{', '.join(formats)}")
        return given
    if "mp3" in formats:
        return "mp3"
    log.warning("this libsndfile has no mp3 encoder (%s): requests without response_format get wav, not OpenAI's"
                " mp3", ENCODER_HINTS["mp3"])
    return "wav"


def _preload(state) -> None:
    """Load the served models before the listener opens, in a thread that ends with the loads (its OpenMP team
    with it); a model that cannot load ends the command with its error, the runtime closed."""
    from mizuoto.runtime.threads import in_thread
    from mizuoto.server.listing import preload

    if not state.catalogue:
        log.warning("serving no model: /ready answers 503 until one is loaded through POST /v1/models/load")
    try:
        in_thread(lambda: preload(state), name="mizuoto-load")
    except BaseException:
        state.runtime.close()
        raise


def _server(cfg, state, url: str):
    """The uvicorn server of `mizuoto serve`: it says where it listens, and what it serves, once it accepts."""
    from mizuoto.server.launch import Server

    class Serving(Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                aliases = "".join(f"; alias {a} -> {t}" for a, t in sorted(state.aliases.models.items()))
                log.info("ready on %s (models: %s%s); the web page is at %s/", url,
                         ", ".join(state.loaded()) or "none", aliases, url)
    return Serving(cfg, state)


def main(argv: list[str] | None = None) -> int:
    """`python -m mizuoto.cli.serve serve ...` (the same as `mizuoto serve ...`)."""
    from mizuoto.errors import MizuotoError

    parser = argparse.ArgumentParser(prog="mizuoto")
    add_serve_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except MizuotoError as e:
        print(f"mizuoto: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
