"""The FastAPI application: routes, error responses, startup and graceful shutdown.

Handlers read their bodies themselves (`_body`: size, idle and total limits) and check them with
the pydantic models of `schemas`; the document at /openapi.json is FastAPI's, from those models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Query, Request, Security, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.staticfiles import StaticFiles

from mizuoto import __version__
from mizuoto.errors import MizuotoError
from mizuoto.server import listing, page, schemas, speech, voices, websocket
from mizuoto.server.audio import MEDIA_TYPES
from mizuoto.server.bodies import parse_json, read_body
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.jobs import ClientGone, in_fresh_thread
from mizuoto.server.listing import model_entry as _model_entry, model_list
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.malloc import tune_malloc
from mizuoto.server.schemas import Error, Omitted, checked
from mizuoto.server.session import Session
from mizuoto.server.state import ServerConfig, ServerState

log = logging.getLogger("mizuoto.server")
SHUTDOWN_JOIN_SECONDS = 10.0
ADMIN_BODY_BYTES = 1 << 20  # load and unload bodies are a name and a path
_STATUS_TEXT = {
    400: "a field is invalid (`param` names it), or the request is not valid HTTP",
    401: "missing or wrong key (`Authorization: Bearer <key>`)",
    403: "the admin key is needed (or administration is off: the server has no --admin-key)",
    404: "unknown model or voice",
    408: "the request body stalled past --idle-timeout, or took longer than --body-timeout",
    409: "conflict with what the server holds",
    413: "request body over the server's limit",
    500: "the engine failed or produced non-finite audio (details in the server log)",
    503: "every job slot and queue place is taken, or the server is shutting down; retry after Retry-After",
    504: "past --request-timeout; the job was cancelled",
    507: "out of memory",
}
_HEADERS = {401: ("WWW-Authenticate", {"type": "string"}), 503: ("Retry-After", {"type": "integer", "minimum": 0})}
_API_KEY = HTTPBearer(scheme_name="apiKey", auto_error=False, description="the --api-key (every /v1 route)")
_ADMIN_KEY = HTTPBearer(scheme_name="adminKey", auto_error=False,
                        description="the --admin-key (model and voice administration; also works as the API key)")
WEBSOCKETS = {"/v1/audio/speech/stream": {
    "summary": "Text in as it arrives, audio (PCM16 mono binary frames) out as it is produced",
    "description": "client: session.start {speech fields except input and stream_format; response_format pcm}, "
                   "then input_text.append {text} messages and input_text.done; server: session.created "
                   "{model, sample_rate, format, stream_in}, binary audio, speech.audio.done; errors as "
                   "{type: error, error: {...}} and the socket closes (1008 bad input, 1013 every slot taken: retry, "
                   "4504 deadline, 4507 out of memory, 1011 server error, 1009 message too big)"}}


def errors(*codes: int, why: dict[int, str] | None = None) -> dict[int | str, dict]:
    """Documented error responses (the JSON error body); `why` replaces the description of some."""
    out: dict[int | str, dict] = {}
    for code in codes:
        out[code] = {"model": Error, "description": (why or {}).get(code, _STATUS_TEXT[code])}
        if code in _HEADERS:  # every 401 and every 503 carries it
            name, schema = _HEADERS[code]
            out[code]["headers"] = {name: {"required": True, "schema": schema}}
    return out


def _state(request: Any) -> ServerState:
    return request.app.state.mizuoto


def _error(e: ApiError, state: ServerState) -> JSONResponse:
    return JSONResponse(e.body(state.private_paths()), status_code=e.status, headers=e.headers)


async def _body(request: Request, limit: int) -> bytes:
    config = _state(request).config
    return await read_body(request, limit, config.idle_timeout, config.body_timeout)


async def _json_body(request: Request, model: type, limit: int) -> Any:
    return checked(model, parse_json(await _body(request, limit)))


def _authorize(admin: bool):
    """A dependency: the key the route needs (so the document's security says which)."""
    async def api(request: Request, _a: Any = Security(_API_KEY), _b: Any = Security(_ADMIN_KEY)) -> None:
        _state(request).authorize(request.headers.get("authorization"), admin=False)

    async def administer(request: Request, _: Any = Security(_ADMIN_KEY)) -> None:
        _state(request).authorize(request.headers.get("authorization"), admin=True)
    return administer if admin else api


# ---- handlers ------------------------------------------------------------------------------------
async def _speech(request: Request) -> Response:
    state = _state(request)
    p = state.aliases.apply(await _json_body(request, state.speech, state.speech_body_bytes))
    request.state.model = p.model
    state.check_model(p.model)
    session = Session(state, p, stream=p.stream_format is not None, request=request)
    try:
        session.start(p.input)
        if p.stream_format is None:
            body, rate = await speech.whole(p, session)
            return Response(body, media_type=speech.media_type(p), headers=speech.headers(p, rate))
        first = await session.next()
        if first is None:
            raise ApiError(500, "the engine produced no audio")
    except ClientGone:
        return Response(status_code=499)
    except BaseException:
        session.close()
        raise
    stream = speech.sse_stream if p.stream_format == "sse" else speech.audio_stream
    return StreamingResponse(stream(p, session, first), media_type=speech.media_type(p),
                             headers=speech.headers(p, first.sample_rate))


async def _models(request: Request) -> Response:
    state = _state(request)
    return JSONResponse(model_list(state, state.is_admin(request.headers.get("authorization"))))


async def _load(request: Request) -> Response:
    state = _state(request)
    body = await _json_body(request, schemas.LoadRequest, ADMIN_BODY_BYTES)
    name = request.state.model = state.aliases.model(body.model) if body.path is None else body.model
    if name in state.aliases.models:
        raise ApiError(409, f"{name!r} is a model alias (--alias); load the model under another name", "model")
    if body.path is None:
        state.check_model(name)
        path = state.catalogue[name] if name in state.catalogue else None
        if path is None:
            raise ApiError(409, f"model {name!r} is already loaded", "model")
    else:
        path = Path(body.path)
        if not state.loadable(path):
            raise ApiError(403, f"path {body.path!r} is not a served model directory nor inside a --model-root",
                           "path")
    loaded, evicted = await in_fresh_thread(state.load, name, path, body.engine)
    return JSONResponse({**_model_entry(state, loaded), "evicted": evicted})


async def _unload(request: Request) -> Response:
    state = _state(request)
    body = await _json_body(request, schemas.UnloadRequest, ADMIN_BODY_BYTES)
    name = request.state.model = _state(request).aliases.model(body.model)
    await in_fresh_thread(state.unload, name)  # a model running a request: ModelBusy, a 409
    return JSONResponse({"id": name, "object": "model", "loaded": False})


async def _voices(request: Request, model: str | Omitted = Query(None, description=(
        "a served model's name: only uploaded voices and this model's"))) -> Response:
    state = _state(request)
    return JSONResponse({"object": "list", "data": voices.listing(state, state.aliases.model(model))})


async def _voice_create(request: Request) -> Response:
    state = _state(request)
    body = await _body(request, state.config.max_body_bytes)
    # decoding an upload is work like a synthesis: it takes a slot, so uploads cannot starve requests
    if not state.limiter.try_acquire():
        raise ApiError(503, f"the server is at its limit of {state.config.max_concurrent} concurrent requests;"
                            " retry shortly", headers={"Retry-After": str(state.config.retry_after)})
    # the upload's lease: its deadline and its client leaving end its waits; the slot goes when its work has
    # ended (the lease's release, after any call of its still running), not when this handler stops waiting
    lease = Lease(state.config.request_timeout)
    lease.on_release(state.limiter.release)
    content_type = request.headers.get("content-type", "")

    def register() -> dict:
        try:
            return voices.register(state, body, content_type, lease)
        finally:
            lease.release()
    try:
        voice = await in_fresh_thread(register)
    except asyncio.CancelledError:
        lease.cancel("because its client left")
        raise
    return JSONResponse(voice, status_code=201)


async def _voice_delete(request: Request, voice_id: str, model: str | Omitted = Query(None, description=(
        "a served model's name: delete the voice from this (loaded) model only"))) -> Response:
    state = _state(request)
    return JSONResponse(await asyncio.to_thread(voices.delete, state, voice_id, state.aliases.model(model)))


async def _health() -> Response:
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
    pending = [(m.name, m.compute_pending) for m in models]
    body, media = state.metrics.exposition(request.headers.get("accept"), state.limiter, rows, batches,
                                           state.runtime.evictions, failures, pending)
    return Response(body, media_type=media)


async def _ws(ws: WebSocket) -> None:
    await websocket.session(ws, ws.app.state.mizuoto)


# ---- errors and counting -------------------------------------------------------------------------
class _Answers:
    """Counts every answer by route, model and status, turns an unhandled error into the JSON 500, and answers
    HEAD as GET."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD":
            # a GET without its body (RFC 9110 9.3.2), for monitors that probe with HEAD: the routes are declared
            # GET only (the document lists no HEAD operations); uvicorn, whose scope still says HEAD, sends no body
            scope = {**scope, "method": "GET"}
        status = None

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            if status is not None:  # the answer had begun: nothing else can be sent
                raise
            log.exception("unhandled error on %s", scope.get("path"))
            error = ApiError(500, f"internal error ({type(e).__name__}); see the server log")
            await _error(error, scope["app"].state.mizuoto)(scope, receive, send)
            status = 500
        finally:
            route = scope.get("route")
            if route is not None and getattr(route, "name", None) in _COUNTED:
                state = scope["app"].state.mizuoto
                model = (scope.get("state") or {}).get("model", "")
                state.metrics.request(route.name, state.model_label(model), status or 499)


async def _api_error(request: Request, exc: Exception) -> Response:
    error = from_exception(exc)
    if error.status == 500:
        log.exception("%s failed", request.url.path, exc_info=exc)
    return _error(error, _state(request))


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """A client that closed while sending its body: counted as 499 (client closed request), not a server error."""
    return Response(status_code=499)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route 404, wrong method 405) as JSON like every other error."""
    message = str(exc.detail)
    if exc.status_code == 404 and request.url.path.rstrip("/") in ("/docs", "/redoc"):
        # FastAPI's /docs and /redoc load their scripts from a CDN: this server serves neither
        message = ("this server has no /docs page (Swagger UI loads its scripts from a CDN); its API is described "
                   "at /openapi.json, which any OpenAPI viewer opens")
    return _error(ApiError(exc.status_code, message, headers=dict(exc.headers or {})), _state(request))


async def _invalid(request: Request, exc: RequestValidationError) -> Response:
    return _error(schemas.problem(list(exc.errors()), []), _state(request))


# (path, handler, method, route name (metrics), admin, documentation)
def _routes(state: ServerState) -> list[tuple]:
    max_chars = state.config.max_input_chars
    as_json = lambda model: {"requestBody": {"required": True, "content": {  # noqa: E731
        "application/json": {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}
    voice_json, voice_form = schemas.voice_models(max_chars)
    uploads = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": voice_json.model_json_schema()},
        "multipart/form-data": {"schema": voice_form.model_json_schema()}}}}
    audio = {MEDIA_TYPES[f].split(";")[0]: {"schema": {"type": "string", "format": "binary"}} for f in state.formats}
    events = schemas.SpeechEvent.model_json_schema(ref_template="#/components/schemas/{model}")
    return [
        ("/v1/audio/speech", _speech, "POST", "speech", False, dict(
            operation_id="createSpeech", tags=["speech"], summary="Speak a text", response_class=Response,
            openapi_extra=as_json(state.speech),
            responses={200: {"description": "the audio (a whole file, a chunked stream, or server-sent events)",
                             "headers": {"X-Sample-Rate": {"required": True, "schema": {"type": "integer"}},
                                         "X-Mizuoto-Model": {"required": True, "schema": {"type": "string"}}},
                             "content": {**audio, "text/event-stream": {"schema": events}}},
                       **errors(400, 404, 408, 413, 500, 503, 504, 507, why={
                           413: "request body over the limit, or a request whose memory figure exceeds the budget"})})),
        ("/v1/models", _models, "GET", "models", False, dict(
            operation_id="listModels", tags=["models"], summary="The served models", response_model=schemas.ModelList,
            response_description="loaded models in full; catalogue models not loaded now with loaded: false")),
        ("/v1/models/load", _load, "POST", "models.load", True, dict(
            operation_id="loadModel", tags=["models"], summary="Load a model (admin)",
            openapi_extra=as_json(schemas.LoadRequest), response_model=schemas.LoadedModel,
            response_description="the loaded model; evicted lists models the planner evicted to make room",
            responses=errors(400, 404, 408, 409, 413, 507, why={
                409: "already loaded, or that directory is loaded under another name",
                507: "the model cannot fit the memory budget"}))),
        ("/v1/models/unload", _unload, "POST", "models.unload", True, dict(
            operation_id="unloadModel", tags=["models"], summary="Unload a model (admin)",
            openapi_extra=as_json(schemas.UnloadRequest), response_model=schemas.Unloaded,
            response_description="unloaded",
            responses=errors(400, 404, 408, 409, 413, why={409: "not loaded, or running a request"}))),
        ("/v1/audio/voices", _voices, "GET", "voices", False, dict(
            operation_id="listVoices", tags=["voices"], summary="Uploaded, preset, cached and stored voices",
            response_model=schemas.VoiceList, response_description="the voices", responses=errors(404))),
        ("/v1/audio/voices", _voice_create, "POST", "voices", False, dict(
            operation_id="createVoice", tags=["voices"], summary="Register a voice from reference audio",
            openapi_extra=uploads, status_code=201, response_model=schemas.VoiceEntry,
            response_description="the voice: cached on a model (and stored) or uploaded",
            responses=errors(400, 404, 408, 409, 413, 503, why={
                409: "the id is taken (a voice, a preset), or the server holds its voice limit",
                503: "every job slot is taken (decoding an upload takes one); retry shortly"}))),
        ("/v1/audio/voices/{voice_id}", _voice_delete, "DELETE", "voices.delete", True, dict(
            operation_id="deleteVoice", tags=["voices"], summary="Delete a voice (admin)",
            response_model=schemas.Deleted, response_description="deleted",
            responses=errors(404, 409, why={409: "that model is not loaded"}))),
        ("/health", _health, "GET", "health", None, dict(
            operation_id="health", tags=["operations"], summary="Liveness", response_model=schemas.Health,
            response_description="the process serves")),
        ("/ready", _ready, "GET", "ready", None, dict(
            operation_id="ready", tags=["operations"], summary="Readiness", response_model=schemas.Ready,
            response_description="a model is loaded and a new request would be admitted",
            responses={503: {"model": schemas.Ready,
                             "description": "no model loaded, every slot and queue place taken, or shutting down"}})),
        ("/metrics", _metrics, "GET", "metrics", None, dict(
            operation_id="metrics", tags=["operations"], summary="Prometheus metrics",
            response_description="Prometheus text exposition (OpenMetrics when its Accept asks)",
            response_class=PlainTextResponse,
            responses={200: {"content": {"application/openmetrics-text": {"schema": {"type": "string"}}}}})),
        ("/", page.index, "GET", "page", None, dict(
            operation_id="webPage", tags=["web"], summary="The try-a-voice page",
            response_description="the page", response_class=HTMLResponse)),
    ]


_COUNTED = {"speech", "models", "models.load", "models.unload", "voices", "voices.delete"}


def _document(app: FastAPI, state: ServerState) -> dict:
    """FastAPI's document, less what it adds for parameters it checks itself (this server answers 400, not 422),
    with the WebSocket described under an extension (OpenAPI has no WebSocket operations)."""
    if app.openapi_schema is None:
        doc = get_openapi(title="Mizuoto", version=__version__, routes=app.routes,
                          description="An OpenAI-style speech API over the Mizuoto runtime (docs/server.md).")
        for ops in doc["paths"].values():
            for op in ops.values():
                op["responses"].pop("422", None)
        components = doc.setdefault("components", {})
        schemas_ = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas_.pop(name, None)
        schemas_.setdefault("ErrorBody", schemas.ErrorBody.model_json_schema())
        key = [{"apiKey": []}, {"adminKey": []}] if state.config.api_key is not None else None
        doc["x-websockets"] = {p: {**d, **({"security": key} if key else {})} for p, d in WEBSOCKETS.items()}
        app.openapi_schema = doc
    return app.openapi_schema


def create_app(runtime: Any, config: ServerConfig | None = None, models: dict[str, Path] | None = None,
               preload: bool = True) -> FastAPI:
    """The ASGI app over `runtime`; `models` (name -> dir) are served, loaded at startup when `preload`."""
    state = ServerState(runtime, config or ServerConfig(), models)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tune_malloc(state.config.mmap_threshold, state.config.malloc_arenas)
        if preload:  # `mizuoto serve` loaded them before it started (listing.preload): nothing is left to load
            await in_fresh_thread(listing.preload, state)
        yield
        # Shutdown: uvicorn has let in-flight responses finish (up to its graceful timeout);
        # whatever still runs is cancelled and joined, then the models are released.
        await asyncio.to_thread(state.shutdown, SHUTDOWN_JOIN_SECONDS)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                      RequestValidationError: _invalid, ClientDisconnect: _client_gone})
    app.add_exception_handler(MizuotoError, _api_error)  # the runtime's errors, mapped as ApiError's are
    for path, handler, method, name, admin, doc in _routes(state):
        needs = [] if admin is None or (not admin and state.config.api_key is None) else [_authorize(admin)]
        auth = errors(401, 403) if admin else errors(401) if needs else {}
        # any request may be malformed HTTP (a bad Content-Length, say): uvicorn refuses it with the JSON 400
        doc["responses"] = {**errors(400), **doc.get("responses", {}), **auth}
        app.add_api_route(path, handler, methods=[method], name=name, dependencies=[Depends(d) for d in needs],
                          **{"response_class": JSONResponse, **doc})
    app.add_api_websocket_route("/v1/audio/speech/stream", _ws)
    app.mount("/web", StaticFiles(directory=page.WEB_DIR), name="web")  # the page's scripts and style
    app.add_middleware(_Answers)
    app.state.mizuoto = state
    app.openapi = lambda: _document(app, state)
    app.state.openapi = app.openapi()  # built now: a broken description fails here, not at the first GET
    return app
