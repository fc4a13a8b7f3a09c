"""`mizuoto wyoming`: the Wyoming (Home Assistant) server as a subcommand; flags and MIZUOTO_* variables as `serve`.

Importing this module needs only the standard library; the `wyoming` package is imported when
the server starts, with a clear error when the `wyoming` extra is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from mizuoto.cli.serve import _env, _flag, _models, add_shared_arguments, shared_config


def add_wyoming_arguments(p: argparse.ArgumentParser) -> None:
    """The wyoming flags, with defaults from the environment."""
    p.add_argument("--uri", default=_env("WYOMING_URI", "tcp://127.0.0.1:10200"),
                   help="where to listen: tcp://HOST:PORT or unix://PATH [MIZUOTO_WYOMING_URI]")
    voices = [v for v in str(_env("VOICES", "")).split(os.pathsep) if v]
    p.add_argument("--voice", action="append", default=voices, metavar="ID=CLIP",
                   help="a voice to clone from a reference clip, offered by every model that clones; its transcript"
                        " is read from CLIP's .txt sibling when there is one (repeatable) [MIZUOTO_VOICES]")
    _flag(p, "--seed", int, None, "seed every request: the same text gives the same audio")
    params = [v for v in str(_env("PARAMS", "")).split() if v]
    p.add_argument("--param", action="append", default=params, metavar="NAME=VALUE",
                   help="a request option for every request whose model's engine declares it (e.g. Chatterbox's "
                        "exaggeration=0.7; `mizuoto engines` lists them; repeatable) [MIZUOTO_PARAMS]")
    _flag(p, "--idle-timeout", float, 30, "seconds a connection may send no event (a stream waiting for its next"
          " chunk included) before it is closed")
    add_shared_arguments(p)


def _register_voices(state, specs: list[str]) -> None:
    from mizuoto.errors import InvalidRequest
    from mizuoto.runtime.voicestore import VOICE_ID
    from mizuoto.server.audio import decode_reference
    from mizuoto.server.errors import ApiError
    from mizuoto.server.state import StoredVoice

    for spec in specs:
        voice_id, sep, clip = spec.partition("=")
        if not sep or not VOICE_ID.fullmatch(voice_id):
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
        raise MizuotoError("mizuoto wyoming needs the wyoming extra: pip install 'mizuoto-runtime[wyoming]'") from None
    from mizuoto.runtime.api import Runtime
    from mizuoto.server.state import ServerConfig, ServerState
    from mizuoto.server.wyoming import WyomingServer
    from mizuoto.server.wyoming_service import WyomingService

    if args.seed is not None and args.seed < 0:
        raise InvalidRequest(f"--seed must be a non-negative integer, got {args.seed}")
    if args.idle_timeout <= 0:
        raise InvalidRequest(f"--idle-timeout must be positive, got {args.idle_timeout}")
    logging.basicConfig(level=str(args.log_level).upper(), format="mizuoto wyoming: %(message)s")
    shared = shared_config(args)
    models = _models(args.model)
    if not models:
        raise InvalidRequest("give at least one model to serve: -m [NAME=]DIR")
    config = ServerConfig(**shared, idle_timeout=args.idle_timeout)
    state = ServerState(Runtime(vram=args.vram, ram=args.ram), config, models)
    _register_voices(state, args.voice)
    server = WyomingServer(WyomingService(state, args.seed, tuple(args.param)), args.uri)
    asyncio.run(_serve(server, args.shutdown_timeout))
    return 0
