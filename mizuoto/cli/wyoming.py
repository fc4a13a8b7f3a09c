"""`mizuoto wyoming`: the Wyoming (Home Assistant) server as a subcommand; flags and MIZUOTO_* variables as `serve`.

Importing this module needs only the standard library; the `wyoming` package is imported when
the server starts, with a clear error when the `wyoming` extra is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
from pathlib import Path

from mizuoto.cli.serve import _env, _models
from mizuoto.runtime.options import add_load_arguments, options_from_args

HELP = "run a Wyoming server for Home Assistant's voice pipeline (needs mizuoto[wyoming])"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_wyoming_arguments(p: argparse.ArgumentParser) -> None:
    """The wyoming flags, with defaults from the environment."""
    p.add_argument("--uri", default=_env("WYOMING_URI", "tcp://127.0.0.1:10200"),
                   help="where to listen: tcp://HOST:PORT or unix://PATH [MIZUOTO_WYOMING_URI]")
    models = [m for m in str(_env("MODELS", "")).split(os.pathsep) if m]
    p.add_argument("-m", "--model", action="append", default=models, metavar="[NAME=]DIR|ORG/NAME",
                   help="model directory or Hugging Face repo id to serve, loaded at start (repeatable)"
                        " [MIZUOTO_MODELS, ':'-separated]")
    voices = [v for v in str(_env("VOICES", "")).split(os.pathsep) if v]
    p.add_argument("--voice", action="append", default=voices, metavar="ID=CLIP",
                   help="a voice to clone from a reference clip, offered by every model that clones; its transcript"
                        " is read from CLIP's .txt sibling when there is one (repeatable) [MIZUOTO_VOICES]")
    seed = _env("SEED")
    p.add_argument("--seed", type=int, default=None if seed is None else int(seed),
                   help="seed every request: the same text gives the same audio [MIZUOTO_SEED]")
    p.add_argument("--vram", default=_env("VRAM"), help="device memory budget, e.g. 6GiB [MIZUOTO_VRAM]")
    p.add_argument("--ram", default=_env("RAM"), help="host memory budget, e.g. 16GiB [MIZUOTO_RAM]")
    add_load_arguments(p, os.environ)
    p.add_argument("--max-concurrent", type=int, default=int(_env("MAX_CONCURRENT", 4)),
                   help="synthesis jobs at once; more get an error event [MIZUOTO_MAX_CONCURRENT]")
    p.add_argument("--request-timeout", type=float, default=float(_env("REQUEST_TIMEOUT", 300)),
                   help="seconds a request may run before it is cancelled (0: none) [MIZUOTO_REQUEST_TIMEOUT]")
    p.add_argument("--max-input-chars", type=int, default=int(_env("MAX_INPUT_CHARS", 4096)),
                   help="longest text of one request [MIZUOTO_MAX_INPUT_CHARS]")
    p.add_argument("--shutdown-timeout", type=float, default=float(_env("SHUTDOWN_TIMEOUT", 10)),
                   help="seconds running jobs get to stop on shutdown [MIZUOTO_SHUTDOWN_TIMEOUT]")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), help="log level [MIZUOTO_LOG_LEVEL]")


def _register_voices(state, specs: list[str]) -> None:
    from mizuoto.errors import InvalidRequest
    from mizuoto.server.audio import decode_reference
    from mizuoto.server.errors import ApiError
    from mizuoto.server.state import StoredVoice

    for spec in specs:
        voice_id, sep, clip = spec.partition("=")
        if not sep or not _ID.match(voice_id):
            raise InvalidRequest(f"--voice {spec}: use ID=CLIP, the id 1-64 letters, digits, '_', '.' or '-'")
        if voice_id in state.voices:
            raise InvalidRequest(f"--voice {spec}: voice {voice_id!r} is given twice")
        path = Path(clip)
        if not path.is_file():
            raise InvalidRequest(f"--voice {spec}: reference clip not found: {clip}")
        transcript = path.with_suffix(".txt")
        text = " ".join(transcript.read_text(encoding="utf-8").split()) if transcript.is_file() else None
        try:
            samples, rate = decode_reference(path.read_bytes(), f"--voice {voice_id}")
        except ApiError as e:
            raise InvalidRequest(e.message) from None
        state.voices[voice_id] = StoredVoice(voice_id, samples, rate, text or None)


async def _serve(server, shutdown_timeout: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop(shutdown_timeout)


def run_wyoming(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then cancel running jobs and free the models."""
    from mizuoto.errors import InvalidRequest, MizuotoError

    try:
        import wyoming  # noqa: F401
    except ImportError:
        raise MizuotoError("mizuoto wyoming needs the wyoming extra: pip install 'mizuoto[wyoming]'") from None
    from mizuoto.runtime.api import Runtime
    from mizuoto.server.state import ServerConfig, ServerState
    from mizuoto.server.wyoming import WyomingServer, WyomingService

    if args.max_concurrent < 1:
        raise InvalidRequest(f"--max-concurrent must be at least 1, got {args.max_concurrent}")
    if args.seed is not None and args.seed < 0:
        raise InvalidRequest(f"--seed must be a non-negative integer, got {args.seed}")
    logging.basicConfig(level=str(args.log_level).upper(), format="mizuoto wyoming: %(message)s")
    options = options_from_args(args)
    options.resolved()  # an unavailable device fails here, in one line, not at the first load
    models = _models(args.model)
    if not models:
        raise InvalidRequest("give at least one model to serve: -m [NAME=]DIR")
    config = ServerConfig(max_concurrent=args.max_concurrent, request_timeout=args.request_timeout or None,
                          max_input_chars=args.max_input_chars, load_options=options.as_dict())
    state = ServerState(Runtime(vram=args.vram, ram=args.ram), config, models)
    _register_voices(state, args.voice)
    server = WyomingServer(WyomingService(state, args.seed), args.uri)
    asyncio.run(_serve(server, args.shutdown_timeout))
    return 0
