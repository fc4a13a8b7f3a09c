"""`mizuoto serve`: the HTTP server as a subcommand. Every flag can also be set by a MIZUOTO_* variable.

Importing this module needs only the standard library and mizuoto's cheap modules; Starlette and
uvicorn are imported when the server starts, with a clear error when the `server` extra is not installed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from mizuoto.runtime.options import add_load_arguments, options_from_args

HELP = "run the HTTP server (OpenAI-style /v1/audio/speech; needs mizuoto[server])"


def _env(name: str, default: object = None) -> object:
    return os.environ.get(f"MIZUOTO_{name}", default)


def add_shared_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every server command takes (serve, wyoming): models, budgets, load options, jobs and limits."""
    models = [m for m in str(_env("MODELS", "")).split(os.pathsep) if m]
    p.add_argument("-m", "--model", action="append", default=models, metavar="[NAME=]DIR|ORG/NAME",
                   help="model directory or Hugging Face repo id to serve, loaded at start (repeatable)"
                        " [MIZUOTO_MODELS, ':'-separated]")
    p.add_argument("--vram", default=_env("VRAM"), help="device memory budget, e.g. 6GiB [MIZUOTO_VRAM]")
    p.add_argument("--ram", default=_env("RAM"), help="host memory budget, e.g. 16GiB [MIZUOTO_RAM]")
    add_load_arguments(p, os.environ)
    p.add_argument("--max-concurrent", type=int, default=_env("MAX_CONCURRENT"),
                   help="synthesis jobs running at once, over all models; more wait in the queue"
                        " (default: 4, or --max-batch if larger) [MIZUOTO_MAX_CONCURRENT]")
    p.add_argument("--max-batch", type=int, default=int(_env("MAX_BATCH", 1)),
                   help="LM batch width of each model (load option compute.batch): up to this many requests to one"
                        " model share its LM steps; 1 runs them one at a time, upstream's exact path [MIZUOTO_MAX_BATCH]")
    p.add_argument("--max-queued", type=int, default=int(_env("MAX_QUEUED", 32)),
                   help="jobs that may wait for a slot (first come, first served); more are refused"
                        " [MIZUOTO_MAX_QUEUED]")
    p.add_argument("--queue-timeout", type=float, default=float(_env("QUEUE_TIMEOUT", 120)),
                   help="seconds a job may wait in the queue before it is refused (0: no limit) [MIZUOTO_QUEUE_TIMEOUT]")
    p.add_argument("--request-timeout", type=float, default=float(_env("REQUEST_TIMEOUT", 300)),
                   help="seconds a request may run before it is cancelled (0: none) [MIZUOTO_REQUEST_TIMEOUT]")
    p.add_argument("--max-input-chars", type=int, default=int(_env("MAX_INPUT_CHARS", 4096)),
                   help="longest input text [MIZUOTO_MAX_INPUT_CHARS]")
    p.add_argument("--shutdown-timeout", type=float, default=float(_env("SHUTDOWN_TIMEOUT", 10)),
                   help="seconds in-flight requests get to finish on shutdown [MIZUOTO_SHUTDOWN_TIMEOUT]")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), help="log level [MIZUOTO_LOG_LEVEL]")


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
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to listen on [MIZUOTO_HOST]")
    p.add_argument("--port", type=int, default=int(_env("PORT", 8000)), help="port [MIZUOTO_PORT]")
    roots = [m for m in str(_env("MODEL_ROOTS", "")).split(os.pathsep) if m]
    p.add_argument("--model-root", action="append", default=roots, metavar="DIR",
                   help="folder whose model directories POST /v1/models/load may load [MIZUOTO_MODEL_ROOTS]")
    add_shared_arguments(p)
    p.add_argument("--api-key", default=_env("API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (/health, /ready, /metrics stay open) [MIZUOTO_API_KEY]")
    p.add_argument("--admin-key", default=_env("ADMIN_KEY"),
                   help="key for loading/unloading models and deleting voices; without it those are off"
                        " [MIZUOTO_ADMIN_KEY]")
    p.add_argument("--header-timeout", type=float, default=float(_env("HEADER_TIMEOUT", 10)),
                   help="seconds a connection may take to send its request headers [MIZUOTO_HEADER_TIMEOUT]")
    p.add_argument("--idle-timeout", type=float, default=float(_env("IDLE_TIMEOUT", 30)),
                   help="seconds a request body or WebSocket session may stay silent [MIZUOTO_IDLE_TIMEOUT]")
    p.add_argument("--drain-seconds", type=float, default=float(_env("DRAIN_SECONDS", 2)),
                   help="on SIGTERM, seconds /ready answers 503 before the listener closes [MIZUOTO_DRAIN_SECONDS]")


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
            name, path = (spec.partition("@")[0] if is_repo_id(spec) else Path(spec).resolve().name), spec
        resolved = resolve_model(path)  # a directory, or a Hugging Face repo id's snapshot
        if not resolved.is_dir():
            raise InvalidRequest(f"-m {spec}: model directory not found: {path}")
        if name in out:
            raise InvalidRequest(f"-m {spec}: model name {name!r} is given twice; use NAME=DIR")
        out[name] = resolved
    return out


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then shut down gracefully."""
    from mizuoto.errors import InvalidRequest, MizuotoError

    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        raise MizuotoError("mizuoto serve needs the server extra: pip install 'mizuoto[server]'") from None
    from mizuoto.runtime.api import Runtime
    from mizuoto.server.app import create_app
    from mizuoto.server.launch import Server, config
    from mizuoto.server.state import ServerConfig

    shared = shared_config(args)
    for flag in ("header_timeout", "idle_timeout"):
        if getattr(args, flag) <= 0:
            raise InvalidRequest(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    server_config = ServerConfig(**shared, model_roots=tuple(Path(r) for r in args.model_root),
                                 api_key=args.api_key or None, admin_key=args.admin_key or None,
                                 header_timeout=args.header_timeout, idle_timeout=args.idle_timeout,
                                 drain_seconds=max(0.0, args.drain_seconds))
    runtime = Runtime(vram=args.vram, ram=args.ram)
    app = create_app(runtime, server_config, _models(args.model))

    server = Server(config(app, args.host, args.port, args.shutdown_timeout, args.log_level), app.state.mizuoto)
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it stopped on once it is done; after a graceful stop that
        # signal should end the process normally (exit 0), not kill it.
        signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0 if server.started else 1


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
