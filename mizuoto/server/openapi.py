"""GET /openapi.json: an OpenAPI 3.1 document of the app's HTTP routes, built from its route table.

The route table (app.py) says which paths and methods exist and which key each needs (the
`auth` its endpoint carries); `operations` here says what each takes and answers. `document`
refuses a route without a description and a description without a route, so create_app fails
before the two can drift apart. Request bodies carry the limits validation.py enforces: its
field list, name pattern and speed range, this server's formats and length limit.

The schemas are the server's contract, so they are never stricter than the server: a body the
document refuses is always refused by the server too (a fuzz checks it). Some rules are looser
here than there (text that is only whitespace, NUL characters, a voice that is not the model's),
and those are still 400s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.routing import Mount, Route, WebSocketRoute

from mizuoto.runtime.engine import SPEED_RANGE
from mizuoto.runtime.voicestore import VOICE_ID
from mizuoto.server.audio import MEDIA_TYPES, STREAMABLE
from mizuoto.server.validation import NAME, SEED_LIMIT, SPEECH_FIELDS, STREAM_FORMATS, VOICE_CHARS

OPENAPI_VERSION = "3.1.0"
WEBSOCKETS = "x-websockets"  # OpenAPI has no WebSocket operations: they are described under this extension
JSON = "application/json"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
# Starlette answers HEAD on every GET route by itself: not a separate operation of the document.
IMPLICIT_METHODS = {"HEAD"}

_STATUS_TEXT = {
    400: "a field is invalid; `param` names it",
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
_HEADER_SCHEMAS = {"Retry-After": {"type": "integer", "minimum": 0}, "WWW-Authenticate": {"type": "string"}}


def errors(*codes: int, why: dict[int, str] | None = None) -> dict:
    """Error responses (the JSON error body) for `codes`; `why` replaces the description of some."""
    out = {}
    for code in codes:
        response: dict[str, Any] = {"description": (why or {}).get(code, _STATUS_TEXT[code]),
                                    "content": {JSON: {"schema": ERROR_REF}}}
        header = {503: "Retry-After", 401: "WWW-Authenticate"}.get(code)
        if header is not None:  # every 401 and every 503 of an operation carries it
            response["headers"] = {header: {"required": True, "schema": _HEADER_SCHEMAS[header]}}
        out[str(code)] = response
    return out


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _string_body(media: str, description: str) -> dict:
    """A response whose body is a string of `media` type (a page, a file, metrics)."""
    return {"description": description, "content": {media: {"schema": {"type": "string"}}}}


def _nullable(schema: dict) -> dict:
    """`schema` or JSON null: the server reads a null field as an absent one."""
    return {**schema, "type": [schema["type"], "null"]}


def _text(description: str, max_chars: int | None = None) -> dict:
    # Blank text, NUL characters and lone surrogates are 400s too; JSON Schema patterns cannot say
    # "not blank" the way Python's str.strip() means it, so they are left to the description.
    schema = {"type": "string", "minLength": 1, "description": description + " (not blank, no NUL)"}
    if max_chars is not None:
        schema["maxLength"] = max_chars
    return schema


def _name(description: str) -> dict:
    return {"type": "string", "pattern": NAME.pattern, "description": description}


def speech_request(formats: Iterable[str], max_chars: int) -> dict:
    """The POST /v1/audio/speech body as validation.parse_speech checks it."""
    lo, hi = SPEED_RANGE
    properties = {
        "model": _name("a served model's name (GET /v1/models lists them)"),
        "input": _text("text to speak", max_chars),
        "voice": _nullable({**_text("a preset voice of the model or a registered voice id; default: the model's "
                                    "first preset; ignored when ref_audio is given"), "maxLength": VOICE_CHARS}),
        "instructions": _nullable(_text("instruction text (models with mode instruct)", max_chars)),
        "response_format": {"type": "string", "enum": list(formats), "default": "wav",
                            "description": f"streaming takes {' or '.join(STREAMABLE)} only"},
        "speed": {"type": "number", "minimum": lo, "maximum": hi, "default": 1.0},
        "stream_format": {"enum": [*STREAM_FORMATS, None],
                          "description": "absent: one whole file; audio: chunked audio as produced; sse: "
                                         "server-sent events"},
        "ref_audio": _nullable(_text("reference audio to clone: base64 (or a data: URL) of a wav/flac/ogg/mp3 "
                                     "file, 16-192 kHz, 0.5-60 s; or a registered voice id")),
        "ref_text": _nullable(_text("transcript of ref_audio", max_chars)),
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": SEED_LIMIT - 1,
                 "description": "makes sampling repeatable (Mizuoto extension)"},
    }
    if list(properties) != list(SPEECH_FIELDS):  # validation's list is the truth: a field added there shows here
        raise LookupError(f"speech fields {list(properties)} differ from validation's {list(SPEECH_FIELDS)}")
    return {"type": "object", "required": ["model", "input"], "properties": properties,
            "additionalProperties": False}


def _voice_upload(max_chars: int) -> dict:
    """The POST /v1/audio/voices bodies: JSON with base64 audio, or a multipart form with the file."""
    common = {"id": {"type": "string", "pattern": VOICE_ID.pattern, "description": "the voice id"},
              "name": {"description": "an alias of id, read only when id is absent (then as id is)"},
              "text": _nullable(_text("transcript of the audio", max_chars)),
              "model": {"anyOf": [_name("cache the voice on this model (and store it); absent, null or empty: "
                                        "keep the audio"), {"const": ""}, {"type": "null"}]}}
    as_json = {"type": "object", "required": ["audio"],
               "properties": {**common, "audio": _text("base64 (or a data: URL) of a wav/flac/ogg/mp3 file, "
                                                        "16-192 kHz, 0.5-60 s")}}
    upload = {"type": "string", "format": "binary"}
    form = {"type": "object", "anyOf": [{"required": ["file"]}, {"required": ["audio"]}],
            "properties": {**{k: v for k, v in common.items() if k in ("id", "name")},
                           "text": _text("transcript of the audio", max_chars),
                           "model": {"anyOf": [_name("cache the voice on this model (and store it); absent or "
                                                     "empty: keep the audio"), {"const": ""}]},
                           "file": {**upload, "description": "the reference audio (a file part)"},
                           "audio": {**upload, "description": "the same, read when file is absent"}}}
    return {"required": True, "content": {JSON: {"schema": as_json}, "multipart/form-data": {"schema": form}}}


_MODEL = {"type": "object", "required": ["id", "object", "loaded", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                         "loaded": {"type": "boolean"}, "path": {"type": "string"}, "owned_by": {"type": "string"},
                         "engine": {"type": "string"}, "variant": {"type": ["string", "null"]},
                         "device": {"type": "string"}, "state": {"enum": ["device", "host"]},
                         "strategy": {"type": "string"}, "sample_rate": {"type": "integer"},
                         "modes": {"type": "array", "items": {"type": "string"}},
                         "stream_out": {"type": "boolean"}, "stream_in": {"type": "boolean"},
                         "languages": {"type": "array", "items": {"type": "string"}},
                         "voices": {"type": "array", "items": {"type": "string"}}}}
_VOICE = {"type": "object", "required": ["id", "object", "kind"],
          "properties": {"id": {"type": "string"}, "object": {"const": "voice"},
                         "kind": {"enum": ["uploaded", "preset", "cached"]}, "model": {"type": ["string", "null"]},
                         "sample_rate": {"type": "integer"}, "seconds": {"type": "number"},
                         "stored": {"type": "boolean"}, "loaded": {"type": "boolean"},
                         "has_text": {"type": "boolean"}, "description": {"type": "string"}}}
_ERROR_BODY = {"type": "object", "required": ["message", "type", "param", "code"],
               "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                              "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}
# One server-sent event of a speech stream (OpenAPI 3.1: `schema` of text/event-stream describes each event).
_SPEECH_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "contentMediaType": JSON, "contentSchema": {"oneOf": [
        {"type": "object", "required": ["type", "audio"],
         "properties": {"type": {"const": "speech.audio.delta"},
                        "audio": {"type": "string", "contentEncoding": "base64",
                                  "description": "PCM16 (for wav the first delta starts with a WAV header)"}}},
        {"type": "object", "required": ["type", "sample_rate", "seconds", "usage"],
         "properties": {"type": {"const": "speech.audio.done"}, "sample_rate": {"type": "integer"},
                        "seconds": {"type": "number"},
                        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                                  "properties": {k: {"type": "integer"}
                                                 for k in ("input_tokens", "output_tokens", "total_tokens")}}}},
        {"type": "object", "required": ["type", "error"],
         "properties": {"type": {"const": "error"}, "error": _ERROR_BODY}}]}}}}
_MODEL_NAME_BODY = {"required": True, "content": {JSON: {"schema": {
    "type": "object", "required": ["model"], "properties": {"model": _name("a model's name")}}}}}
_MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                "description": "a served model's name"}
_READY = {"type": "object", "required": ["status"],
          "properties": {"status": {"enum": ["ready", "busy", "no model loaded", "shutting down"]},
                         "models": {"type": "array", "items": {"type": "string"}},
                         "in_flight": {"type": "integer"}, "queued": {"type": "integer"}}}


def operations(formats: Iterable[str], max_chars: int) -> dict[tuple[str, str], dict]:
    """Each HTTP operation's description by (method, path); the keys (401/403) come from the route table."""
    formats = list(formats)
    audio = {MEDIA_TYPES[f].split(";")[0]: {"schema": {"type": "string", "format": "binary"}} for f in formats}
    speech_headers = {"X-Sample-Rate": {"required": True, "schema": {"type": "integer"}},
                      "X-Mizuoto-Model": {"required": True, "schema": {"type": "string"}}}
    return {
        ("POST", "/v1/audio/speech"): {
            "operationId": "createSpeech", "tags": ["speech"], "summary": "Speak a text",
            "requestBody": {"required": True, "content": {JSON: {"schema": speech_request(formats, max_chars)}}},
            "responses": {
                "200": {"description": "the audio (a whole file, a chunked stream, or server-sent events)",
                        "headers": speech_headers,
                        "content": {**audio, "text/event-stream": {"schema": _SPEECH_EVENT}}},
                **errors(400, 404, 408, 413, 500, 503, 504, 507,
                         why={413: "request body over the limit, or a request whose memory figure exceeds the "
                                   "budget"})}},
        ("GET", "/v1/models"): {
            "operationId": "listModels", "tags": ["models"], "summary": "The served models",
            "responses": {"200": _json({"type": "object", "required": ["object", "data"],
                                        "properties": {"object": {"const": "list"},
                                                       "data": {"type": "array", "items": _MODEL}}},
                                       "loaded models in full; catalogue models not loaded now with loaded: false")}},
        ("POST", "/v1/models/load"): {
            "operationId": "loadModel", "tags": ["models"], "summary": "Load a model (admin)",
            "requestBody": {"required": True, "content": {JSON: {"schema": {
                "type": "object", "required": ["model"],
                "properties": {"model": _name("the name to load it under"),
                               "path": _nullable(_text("a served model directory, or one inside a --model-root; "
                                                       "absent: the catalogue's directory of that name")),
                               "engine": _nullable(_text("the engine to load it with; absent: detected"))}}}}},
            "responses": {"200": _json({**_MODEL, "properties": {**_MODEL["properties"], "evicted": {
                              "type": "array", "items": {"type": "string"}}}},
                              "the loaded model; evicted lists models the planner evicted to make room"),
                          **errors(400, 404, 408, 409, 413, 507,
                                   why={409: "already loaded, or that directory is loaded under another name",
                                        507: "the model cannot fit the memory budget"})}},
        ("POST", "/v1/models/unload"): {
            "operationId": "unloadModel", "tags": ["models"], "summary": "Unload a model (admin)",
            "requestBody": _MODEL_NAME_BODY,
            "responses": {"200": _json({"type": "object", "required": ["id", "object", "loaded"],
                                        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                                       "loaded": {"const": False}}}, "unloaded"),
                          **errors(400, 404, 408, 409, 413, why={409: "not loaded, or running a request"})}},
        ("GET", "/v1/audio/voices"): {
            "operationId": "listVoices", "tags": ["voices"], "summary": "Uploaded, preset, cached and stored voices",
            "parameters": [{**_MODEL_QUERY, "description": "only uploaded voices and this model's"}],
            "responses": {"200": _json({"type": "object", "required": ["object", "data"],
                                        "properties": {"object": {"const": "list"},
                                                       "data": {"type": "array", "items": _VOICE}}}, "the voices"),
                          **errors(404)}},
        ("POST", "/v1/audio/voices"): {
            "operationId": "createVoice", "tags": ["voices"], "summary": "Register a voice from reference audio",
            "requestBody": _voice_upload(max_chars),
            "responses": {"201": _json(_VOICE, "the voice: cached on a model (and stored) or uploaded"),
                          **errors(400, 404, 408, 409, 413, 503,
                                   why={409: "the id is taken (a voice, a preset), or the server holds its voice "
                                             "limit",
                                        503: "every job slot is taken (decoding an upload takes one); retry "
                                             "shortly"})}},
        ("DELETE", "/v1/audio/voices/{voice_id}"): {
            "operationId": "deleteVoice", "tags": ["voices"], "summary": "Delete a voice (admin)",
            "parameters": [{"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}},
                           {**_MODEL_QUERY, "description": "delete it from this (loaded) model only"}],
            "responses": {"200": _json({"type": "object", "required": ["id", "object", "deleted"],
                                        "properties": {"id": {"type": "string"}, "object": {"const": "voice"},
                                                       "deleted": {"const": True}}}, "deleted"),
                          **errors(404, 409, why={409: "that model is not loaded"})}},
        ("GET", "/health"): {
            "operationId": "health", "tags": ["operations"], "summary": "Liveness",
            "responses": {"200": _json({"type": "object", "required": ["status"],
                                        "properties": {"status": {"const": "ok"}}}, "the process serves")}},
        ("GET", "/ready"): {
            "operationId": "ready", "tags": ["operations"], "summary": "Readiness",
            "responses": {"200": _json(_READY, "a model is loaded and a new request would be admitted"),
                          "503": _json(_READY, "no model loaded, every slot and queue place taken, "
                                               "or shutting down")}},
        ("GET", "/metrics"): {
            "operationId": "metrics", "tags": ["operations"], "summary": "Prometheus metrics",
            "responses": {"200": _string_body("text/plain", "Prometheus text exposition")}},
        ("GET", "/openapi.json"): {
            "operationId": "openapi", "tags": ["operations"], "summary": "This document",
            "responses": {"200": _json({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3.1")}},
        ("GET", "/"): {
            "operationId": "webPage", "tags": ["web"], "summary": "The try-a-voice page",
            "responses": {"200": _string_body("text/html", "the page")}},
        ("GET", "/web/{path}"): {
            "operationId": "webFiles", "tags": ["web"], "summary": "The page's scripts and style",
            "parameters": [{"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _string_body("*/*", "the file"),
                          **errors(404, why={404: "no such file"})}},
    }


_WEBSOCKETS = {
    "/v1/audio/speech/stream": {
        "summary": "Text in as it arrives, audio (PCM16 mono binary frames) out as it is produced",
        "description": "client: session.start {speech fields except input and stream_format; response_format pcm}, "
                       "then input_text.append {text} messages and input_text.done; server: session.created "
                       "{model, sample_rate, format, stream_in}, binary audio, speech.audio.done; errors as "
                       "{type: error, error: {...}} and the socket closes (1008 bad input, 1011 server error)",
    },
}


def _mounted_path(path: str) -> str:
    return path.rstrip("/") + "/{path}"


def route_operations(routes: Iterable[Any]) -> tuple[dict[tuple[str, str], str | None], list[str]]:
    """({(method, path): the key it needs ("api", "admin" or None)}, [websocket paths]) of a route table."""
    http, sockets = {}, []
    for route in routes:
        if isinstance(route, WebSocketRoute):
            sockets.append(route.path)
        elif isinstance(route, Mount):  # static files: read-only
            http["GET", _mounted_path(route.path)] = None
        elif isinstance(route, Route):
            for method in sorted(set(route.methods or ()) - IMPLICIT_METHODS):
                http[method, route.path] = getattr(route.endpoint, "auth", None)
        else:
            raise TypeError(f"the OpenAPI document cannot describe route {route!r}")
    return http, sockets


def _security(auth: str | None, api_key: bool) -> tuple[list | None, dict]:
    """(the operation's security requirement, its 401/403 responses) for the key its route needs."""
    if auth == "admin":
        return [{"adminKey": []}], errors(401, 403)
    if auth == "api" and api_key:
        return [{"apiKey": []}, {"adminKey": []}], errors(401)
    return None, {}


def document(routes: Iterable[Any], formats: Iterable[str], max_chars: int, api_key: bool,
             version: str = "") -> dict:
    """The OpenAPI document of `routes`; a LookupError when a route and the descriptions disagree."""
    http, sockets = route_operations(routes)
    described = operations(formats, max_chars)
    missing = sorted(set(http) - set(described))
    stale = sorted(set(described) - set(http))
    ghosts = sorted(set(_WEBSOCKETS).symmetric_difference(sockets))
    if missing or stale or ghosts:
        raise LookupError(f"routes without an OpenAPI description: {missing}; descriptions without a route: "
                          f"{stale}; websockets that differ: {ghosts}")
    paths: dict[str, dict] = {}
    for (method, path), auth in http.items():
        op = dict(described[method, path])
        security, responses = _security(auth, api_key)
        if security is not None:
            op["security"] = security
        op["responses"] = {**op["responses"], **responses}
        paths.setdefault(path, {})[method.lower()] = op
    schemes = {"adminKey": {"type": "http", "scheme": "bearer",
                            "description": "the --admin-key (model and voice administration; also works as the "
                                           "API key)"}}
    if api_key:
        schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "the --api-key (every /v1 route)"}
    error = {"type": "object", "required": ["error"], "properties": {"error": _ERROR_BODY}}
    return {"openapi": OPENAPI_VERSION,
            "info": {"title": "Mizuoto", "version": version,
                     "description": "An OpenAI-style speech API over the Mizuoto runtime (docs/server.md)."},
            "paths": paths,
            "components": {"schemas": {"Error": error}, "securitySchemes": schemes},
            WEBSOCKETS: {p: {**_WEBSOCKETS[p], **({"security": [{"apiKey": []}, {"adminKey": []}]} if api_key else {})}
                         for p in sockets}}
