"""The Starlette application: routes, error responses, startup and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute

from mizuoto import __version__
from mizuoto.server import openapi, page, speech, voices, websocket
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.jobs import in_fresh_thread
from mizuoto.server.malloc import tune_malloc
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.server.validation import name_field, parse_json, parse_speech, text_field

log = logging.getLogger("mizuoto.server")
SHUTDOWN_JOIN_SECONDS = 10.0


def _state(request: Any) -> ServerState:
    return request.app.state.mizuoto


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes, and (408) when it stalls past the idle timeout or
    takes longer than the body timeout in all (a body trickled a byte at a time never stalls)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    parts, size = [], 0
    stream = request.stream().__aiter__()
    config = _state(request).config
    idle, end = config.idle_timeout, time.monotonic() + config.body_timeout
    while True:
        left = end - time.monotonic()
        try:
            part = await asyncio.wait_for(stream.__anext__(), min(idle, max(left, 0.0)))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            if idle < left:
                raise ApiError(408, f"the request body stalled for {idle:g} s") from None
            raise ApiError(408, f"the request body took longer than {config.body_timeout:g} s") from None
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def _route(name: str, admin: bool = False):
    """Wrap a handler: the key it needs is checked first; errors become JSON responses; every answer is counted.

    The endpoint's `auth` ("api" or "admin") is the key it needs, as the OpenAPI document says.
    """
    def wrap(handler):
        async def endpoint(request: Request) -> Response:
            state = _state(request)
            try:
                state.authorize(request.headers.get("authorization"), admin)
                response = await handler(request, state)
            except Exception as e:
                error = from_exception(e)
                if error.status == 500:
                    log.exception("%s failed", name)
                response = _error(error)
            state.metrics.request(name, state.model_label(getattr(request.state, "model", "")), response.status_code)
            return response
        endpoint.auth = "admin" if admin else "api"
        return endpoint
    return wrap


@_route("speech")
async def _speech(request: Request, state: ServerState) -> Response:
    p = parse_speech(parse_json(await _body(request, state.config.max_body_bytes)),
                            state.formats, state.config.max_input_chars)
    request.state.model = p.model
    state.check_model(p.model)
    job = speech.start_job(state, p, stream=p.stream_format is not None)
    pull = speech.Pull(state, job, p.model, request)
    try:
        if p.stream_format is None:
            body, rate = await speech.whole(state, p, pull)
            return Response(body, media_type=speech.media_type(p), headers=speech.headers(p, rate))
        first = await pull.next()
        if first is None:
            raise ApiError(500, "the engine produced no audio")
    except speech.ClientGone:
        return Response(status_code=499)
    except BaseException:
        pull.cancel()
        raise
    stream = speech.sse_stream if p.stream_format == "sse" else speech.audio_stream
    return StreamingResponse(stream(p, pull, first), media_type=speech.media_type(p),
                             headers=speech.headers(p, first.sample_rate))


def _model_entry(state: ServerState, name: str) -> dict:
    loaded = name in state.loaded()
    entry = {"id": name, "object": "model", "created": 0, "loaded": loaded,
             "path": str(state.catalogue.get(name, ""))}
    if loaded:
        info = state.runtime.info(name)
        caps = info.capabilities
        entry.update(owned_by=info.engine, engine=info.engine, variant=info.variant, device=info.device,
                     state=info.state, strategy=info.strategy, sample_rate=caps.sample_rate, modes=sorted(caps.modes),
                     stream_out=caps.stream_out, stream_in=caps.stream_in, languages=list(caps.languages),
                     voices=[v.id for v in state.runtime.voices(name)])
    else:
        entry["owned_by"] = "mizuoto"
    return entry


@_route("models")
async def _models(request: Request, state: ServerState) -> Response:
    names = list(dict.fromkeys([*state.loaded(), *state.catalogue]))
    return JSONResponse({"object": "list", "data": [_model_entry(state, n) for n in names]})


@_route("models.load", admin=True)
async def _load(request: Request, state: ServerState) -> Response:
    data = parse_json(await _body(request, 1 << 20))
    name = name_field(data, "model", required=True)
    request.state.model = name
    given = text_field(data, "path")
    engine = text_field(data, "engine")
    if given is None:
        state.check_model(name)
        path = state.catalogue[name] if name in state.catalogue else None
        if path is None:
            raise ApiError(409, f"model {name!r} is already loaded", "model")
    else:
        path = Path(given)
        if not state.loadable(path):
            raise ApiError(403, f"path {given!r} is not a served model directory nor inside a --model-root", "path")
    loaded, evicted = await in_fresh_thread(state.load, name, path, engine)
    return JSONResponse({**_model_entry(state, loaded), "evicted": evicted})


@_route("models.unload", admin=True)
async def _unload(request: Request, state: ServerState) -> Response:
    name = name_field(parse_json(await _body(request, 1 << 20)), "model", required=True)
    request.state.model = name
    try:
        await in_fresh_thread(state.unload, name)
    except ApiError:
        raise
    except Exception as e:
        if "running a request" in str(e):
            raise ApiError(409, str(e), "model") from None
        raise
    return JSONResponse({"id": name, "object": "model", "loaded": False})


@_route("voices")
async def _voices(request: Request, state: ServerState) -> Response:
    if request.method == "GET":
        return JSONResponse({"object": "list", "data": voices.listing(state, request.query_params.get("model"))})
    body = await _body(request, state.config.max_body_bytes)
    # decoding an upload is work like a synthesis: it takes a slot, so uploads cannot starve requests
    if not state.limiter.try_acquire():
        raise ApiError(503, f"the server is at its limit of {state.config.max_concurrent} concurrent requests;"
                            " retry shortly", headers={"Retry-After": str(state.config.retry_after)})
    try:
        voice = await in_fresh_thread(voices.register, state, body, request.headers.get("content-type", ""))
    finally:
        state.limiter.release()
    return JSONResponse(voice, status_code=201)


@_route("voices.delete", admin=True)
async def _voice_delete(request: Request, state: ServerState) -> Response:
    model = request.query_params.get("model")
    body = await asyncio.to_thread(voices.delete, state, request.path_params["voice_id"], model)
    return JSONResponse(body)


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _ready(request: Request) -> Response:
    state = _state(request)
    if state.closing:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if not state.loaded():
        return JSONResponse({"status": "no model loaded"}, status_code=503)
    full = state.limiter.full()
    failures = {m.name: m.loop_failures for m in state.runtime.models() if m.loop_failures}
    body = {"status": "busy" if full else "ready", "models": state.loaded(), "in_flight": state.limiter.active,
            "queued": state.limiter.queued}
    if failures:  # each loop went on serving; say so, with how often it failed
        body["loop_failures"] = failures
    return JSONResponse(body, status_code=503 if full else 200)


async def _metrics(request: Request) -> Response:
    state = _state(request)
    rows = await asyncio.to_thread(state.memory_rows)
    models = state.runtime.models()
    batches = [(m.name, m.batch_width, m.running) for m in models]
    failures = [(m.name, m.loop_failures) for m in models]
    return PlainTextResponse(state.metrics.render(state.limiter, rows, batches, state.runtime.evictions, failures),
                             media_type="text/plain; version=0.0.4")


async def _openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def _ws(ws) -> None:
    await websocket.session(ws, ws.app.state.mizuoto)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route 404, wrong method 405) as JSON like every other error."""
    return _error(ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return _error(ApiError(500, f"internal error ({type(exc).__name__}); see the server log"))


def create_app(runtime: Any, config: ServerConfig | None = None, models: dict[str, Path] | None = None,
               preload: bool = True) -> Starlette:
    """The ASGI app over `runtime`; `models` (name -> dir) are served, loaded at startup when `preload`."""
    state = ServerState(runtime, config or ServerConfig(), models)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        tune_malloc(state.config.mmap_threshold, state.config.malloc_arenas)
        if preload:
            for name in list(state.catalogue):
                if name not in state.loaded():
                    await in_fresh_thread(state.ensure_loaded, name)
        yield
        # Shutdown: uvicorn has let in-flight responses finish (up to its graceful timeout);
        # whatever still runs is cancelled and joined, then the models are released.
        await asyncio.to_thread(state.shutdown, SHUTDOWN_JOIN_SECONDS)

    routes = [
        Route("/v1/audio/speech", _speech, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/load", _load, methods=["POST"]),
        Route("/v1/models/unload", _unload, methods=["POST"]),
        Route("/v1/audio/voices", _voices, methods=["GET", "POST"]),
        Route("/v1/audio/voices/{voice_id}", _voice_delete, methods=["DELETE"]),
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/openapi.json", _openapi, methods=["GET"]),
        WebSocketRoute("/v1/audio/speech/stream", _ws),
        Route("/", page.index, methods=["GET"]),
        Mount("/web", page.static_files()),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.mizuoto = state
    # built once, now: a route without a description (or the reverse) fails here, not at the first GET
    app.state.openapi = openapi.document(routes, state.formats, state.config.max_input_chars,
                                         api_key=state.config.api_key is not None, version=__version__)
    return app
