"""The HTTP contract as pydantic models: each field declared once (type, range, default, description), checked
by its validator with a 400 naming it, and turned into /openapi.json's schemas by FastAPI.

The schemas are never stricter than the server: a body they refuse is refused by the server too (the
fuzz checks it). Some rules are stricter in the server than in the document (blank text, NUL, a voice
that is not the model's), and those are still 400s.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, create_model,
                      model_validator)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from mizuoto.errors import quoted
from mizuoto.runtime.engine import SPEED_RANGE
from mizuoto.runtime.voicestore import VOICE_ID
from mizuoto.server.audio import STREAMABLE, missing_format
from mizuoto.server.errors import ApiError

STREAM_FORMATS = ("audio", "sse")
SEED_LIMIT = 2**63  # seeds lie in [0, SEED_LIMIT)
VOICE_CHARS = 128  # longest voice id a request may name
MAX_OPTIONS = 64  # engine request options a request may give (engines declare a handful)
# Names a client chooses (model names, voice ids) appear in headers, metrics and logs: letters, digits and a
# few separators only ('/' and ':' for hub ids such as org/name). Matched whole (fullmatch): re's '$' alone
# would let a trailing newline through. The pattern is also the document's, where '$' means the end.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")
# Strict: no silent coercion ("1" is not a speed, 1.0 not a seed); unknown fields are refused (typos).
STRICT = ConfigDict(extra="forbid", strict=True)
# A field that may be left out but is never null when given (the document says so; the server reads a null as absent)
Omitted = SkipJsonSchema[None]


def _fail(message: str, field: str | None = None) -> PydanticCustomError:
    """The server's own words for a problem (`field`: for a check of several fields, the one it names)."""
    return PydanticCustomError("mizuoto", "{message}", {"message": message, "field": field})


def check_text(value: str, name: str, limit: int | None = None, so_far: int = 0) -> None:
    """A 400 for text that cannot be spoken or encoded (lone surrogates, NUL characters), or that takes the
    characters sent so far (`so_far`, of a text sent in pieces) past `limit`."""
    if limit is not None and so_far + len(value) > limit:
        raise ApiError(400, f"field '{name}' has {so_far + len(value)} characters; the limit is {limit}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"field '{name}' is not valid Unicode (a lone surrogate at character {e.start})",
                       name) from None
    if "\x00" in value:
        raise ApiError(400, f"field '{name}' contains a NUL character", name)


def _text(value: Any, info: ValidationInfo, limit: int | None = None) -> Any:
    name = info.field_name
    if value is None:
        return None
    if not isinstance(value, str):
        raise _fail(f"field '{name}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _fail(f"field '{name}' is empty")
    try:
        check_text(value, name, limit)
    except ApiError as e:
        raise _fail(e.message) from None
    return value


def _name(value: Any, info: ValidationInfo) -> Any:
    if _text(value, info) is not None and not NAME.fullmatch(value):
        raise _fail(f"field '{info.field_name}' must be 1-128 letters, digits or '_', '.', ':', '/', '-' "
                    "(starting with a letter or digit)")
    return value


def _voice(value: Any, info: ValidationInfo) -> Any:
    if _text(value, info) is not None and (len(value) > VOICE_CHARS or any(
            unicodedata.category(c)[0] == "C" or c in "\u2028\u2029" for c in value)):
        raise _fail(f"field '{info.field_name}' must be a voice id: at most {VOICE_CHARS} printable characters")
    return value


def _speed(value: Any) -> Any:
    if value is None:  # null is absent, as for every optional field
        return 1.0
    lo, hi = SPEED_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise _fail(f"speed must be a number between {lo:g} and {hi:g}, got {quoted(value)}")
    return float(value)


def _seed(value: Any) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT):
        raise _fail(f"seed must be a non-negative integer, got {quoted(value)}")
    return value


def _stream_format(value: Any) -> Any:
    if value is not None and value not in STREAM_FORMATS:
        raise _fail(f"stream_format must be 'audio' or 'sse', got {quoted(value)}")
    return value


def Text(description: str, limit: int | None = None) -> Any:  # noqa: N802 (a type, as typing's are)
    """A string field: not blank, no NUL or lone surrogate, at most `limit` characters."""
    # the Field first: its constraints then apply to the string the validator has passed
    return Annotated[str, Field(min_length=1, max_length=limit, description=description + " (not blank, no NUL)"),
                     BeforeValidator(functools.partial(_text, limit=limit))]


def Name(description: str) -> Any:  # noqa: N802
    """A model name: `NAME`'s characters only, so it is safe in headers, metrics and logs."""
    return Annotated[str, Field(pattern=NAME.pattern, description=description), BeforeValidator(_name)]


def _options(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(f"options must be an object of option names to values, got {type(value).__name__}")
    if len(value) > MAX_OPTIONS:
        raise _fail(f"options has {len(value)} entries; at most {MAX_OPTIONS} are read")
    for name, v in value.items():  # every option is a number, a string or a flag: nothing nested
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise _fail(f"option {quoted(name)} must be a number, a string or true/false, got {quoted(v)}")
    return value


def engine_options(engines: dict[str, type]) -> str:
    """The request options each engine declares, as the JSON text `speech_model` takes (engines without any left out)."""
    out = {}
    for name, cls in sorted(engines.items()):
        declared = cls.capabilities.options if cls.capabilities is not None else ()
        if declared:
            out[name] = {o.name: o.schema() for o in declared}
    return json.dumps(out, sort_keys=True)


def _options_schema(per_engine: dict[str, dict]) -> dict:
    """The `options` field's schema: an object of one engine's options (the model's engine decides which)."""
    variants = [{"title": f"{engine} options", "type": "object", "properties": props, "additionalProperties": False}
                for engine, props in per_engine.items()]
    schema: dict[str, Any] = {"description": "settings the model's engine declares beyond the common fields (GET "
                                             "/v1/models lists each model's); checked against the model: an unknown "
                                             "name or a value out of range is a 400"}
    if variants:
        schema["anyOf"] = variants
    return schema


@functools.cache
def speech_model(formats: tuple[str, ...], max_chars: int, need_input: bool = True,
                 default_format: str = "wav", options: str = "{}") -> type[BaseModel]:
    """The POST /v1/audio/speech body (and a WebSocket or Wyoming session's fields) of a server.

    `options`: `engine_options(...)` of the engines the server may load, for the document.
    """

    def response_format(value: Any) -> Any:
        if value is None:  # null is absent, as for every optional field
            return default_format
        if not isinstance(value, str) or value not in formats:
            raise _fail(missing_format(value, formats))
        return value

    def stream_default(cls: type, data: Any) -> Any:
        # a stream without a response_format is wav (an mp3 default cannot be streamed)
        if isinstance(data, dict) and data.get("response_format") is None and default_format not in STREAMABLE \
                and data.get("stream_format") in STREAM_FORMATS:
            return {**data, "response_format": STREAMABLE[0]}
        return data

    def streamable(self: BaseModel) -> BaseModel:
        if self.stream_format is not None and self.response_format not in STREAMABLE:
            raise _fail(f"response_format {self.response_format!r} cannot be streamed; use wav or pcm",
                        "response_format")
        return self

    lo, hi = SPEED_RANGE
    text = Text("text to speak", max_chars)
    fields = {
        "model": (Name("a served model's name (GET /v1/models lists them)"), ...),
        "input": (text, ...) if need_input else (text | None, None),
        "voice": (Annotated[str, Field(min_length=1, max_length=VOICE_CHARS, description=(
            "a preset voice of the model or a registered voice id; default: the model's first preset; ignored when "
            "ref_audio is given")), BeforeValidator(_voice)] | None, None),
        "instructions": (Text("instruction text (models with mode instruct)", max_chars) | None, None),
        "response_format": (Annotated[Literal[formats], Field(description=(
            f"absent: {default_format}, or {STREAMABLE[0]} when streamed; streaming takes {' or '.join(STREAMABLE)} "
            "only")), BeforeValidator(response_format)], default_format),
        "speed": (Annotated[float, Field(ge=lo, le=hi), BeforeValidator(_speed)], 1.0),
        "stream_format": (Annotated[Literal[STREAM_FORMATS] | None, Field(
            description="absent: one whole file; audio: chunked audio as produced; sse: server-sent events"),
            BeforeValidator(_stream_format)], None),
        "ref_audio": (Text("reference audio to clone: base64 (or a data: URL) of a wav/flac/ogg/mp3 file, "
                           "16-192 kHz, 0.5-30 s; or a registered voice id") | None, None),
        "ref_text": (Text("transcript of ref_audio", max_chars) | None, None),
        "seed": (Annotated[int, Field(ge=0, lt=SEED_LIMIT), BeforeValidator(_seed)] | None,
                 Field(None, description="makes sampling repeatable (Mizuoto extension)")),
        "options": (Annotated[dict[str, Any], BeforeValidator(_options)] | Omitted,
                    Field(None, json_schema_extra=_options_schema(json.loads(options)))),
    }
    return create_model("SpeechRequest", __config__=STRICT,
                        __validators__={"stream_default": model_validator(mode="before")(classmethod(stream_default)),
                                        "streamable": model_validator(mode="after")(streamable)}, **fields)


# the annotated types of the fixed models' fields (type checkers take names in annotations, not calls)
_LoadName = Name("the name to load it under")
_LoadPath = Text("a served model directory, or one inside a --model-root; absent: the catalogue's directory of "
                 "that name")
_LoadEngine = Text("the engine to load it with; absent: detected")
_ModelName = Name("a model's name")


class LoadRequest(BaseModel):
    """POST /v1/models/load."""

    model_config = STRICT
    model: _LoadName
    path: _LoadPath | None = None
    engine: _LoadEngine | None = None


class UnloadRequest(BaseModel):
    """POST /v1/models/unload."""

    model_config = STRICT
    model: _ModelName


def _voice_id(value: Any, info: ValidationInfo) -> Any:
    if _text(value, info) is not None and not VOICE_ID.fullmatch(value):
        raise _fail(f"voice id {quoted(value)} must be 1-64 letters, digits, '_', '.' or '-'")
    return value


def _no_model(value: Any) -> Any:
    return None if value == "" else value  # a form's empty field: no model


VoiceId = Annotated[str, Field(pattern=VOICE_ID.pattern, description="the voice id"), BeforeValidator(_voice_id)]
_ON_MODEL = "cache the voice on this model (and store it); absent, null or empty: keep the audio"
VoiceModel = Annotated[Name(_ON_MODEL) | Literal[""] | None, BeforeValidator(_no_model)]
FormModel = Annotated[Name(_ON_MODEL) | Literal[""] | Omitted, BeforeValidator(_no_model)]  # a form has no null


@functools.cache
def voice_models(max_chars: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(the JSON, the form) bodies of POST /v1/audio/voices: base64 audio, or a multipart form with the file."""
    b64_audio = Text("base64 (or a data: URL) of a wav/flac/ogg/mp3 file, 16-192 kHz, 0.5-30 s")
    transcript = Text("transcript of the audio", max_chars)

    class VoiceJson(BaseModel):
        model_config = ConfigDict(strict=True)  # other fields are ignored, as they always were
        id: VoiceId | Omitted = None
        name: VoiceId | Omitted = Field(None, description="an alias of id, read only when id is absent")
        audio: b64_audio
        text: transcript | None = None
        model: VoiceModel = None

    class VoiceForm(BaseModel):
        model_config = ConfigDict(strict=True, json_schema_extra={"anyOf": [{"required": ["file"]},
                                                                               {"required": ["audio"]}]})
        id: VoiceId | Omitted = None
        name: VoiceId | Omitted = Field(None, description="an alias of id, read only when id is absent")
        text: transcript | Omitted = None
        model: FormModel = None
        file: Annotated[bytes | Omitted, Field(description="the reference audio (a file part)")] = None
        audio: Annotated[bytes | Omitted, Field(description="the same, read when file is absent")] = None

    return VoiceJson, VoiceForm


def checked(model: type[BaseModel], data: Any) -> Any:
    """`data` (a parsed JSON body) as `model`, or the first problem as a 400 naming its field."""
    if isinstance(data, dict) and model.model_config.get("extra") == "forbid":
        # the first unknown field now: pydantic would build an error for each of thousands
        unknown = next((k for k in data if k not in model.model_fields), None)
        if unknown is not None:
            try:
                unknown.encode("utf-8")
                error = {"type": "extra_forbidden", "loc": (unknown,), "msg": "", "input": None}
            except UnicodeEncodeError:  # a lone surrogate: pydantic's own complaint, about the name
                error = {"type": "string_unicode", "loc": (), "msg": "", "input": unknown}
            raise problem([error], list(model.model_fields))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise problem(e.errors(include_url=False), list(model.model_fields)) from None


def problem(errors: list[dict], known: list[str]) -> ApiError:
    """The 400 of pydantic's first error, in the server's words."""
    error = errors[0]
    field = next((str(x) for x in error["loc"] if x != "body" and isinstance(x, str)), None)
    kind = error["type"]
    if kind == "mizuoto":
        message, field = error["ctx"]["message"], error["ctx"]["field"] or field
    elif kind == "missing":
        message = f"field '{field}' is required"
    elif kind == "extra_forbidden":
        message = f"unknown field {quoted(field)}; known fields: {', '.join(known)}"
        field = field if field is None or len(field) <= 64 else None  # a name too long to be one is not echoed
    elif kind == "string_unicode" and not error["loc"]:  # a key, not a value
        message = f"a field name is not valid Unicode: {quoted(error['input'])}"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        field = None
        message = f"request body must be a JSON object, got {type(error['input']).__name__}"
    else:
        message = f"field '{field}': {error['msg']}" if field else error["msg"]
    return ApiError(400, message, field)


# ---- responses (for the document; the handlers build the same bodies) ------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class Error(BaseModel):
    """Every error answer: OpenAI's error body."""

    error: ErrorBody


class ModelEntry(BaseModel):
    """A served model: loaded ones in full, catalogue ones not loaded now with loaded: false."""

    id: str
    object: Literal["model"]
    created: int | Omitted = None
    loaded: bool
    path: str | Omitted = Field(None, description="the model's directory (shown with the admin key only)")
    owned_by: str
    engine: str | Omitted = None
    variant: str | None = None
    device: str | Omitted = None
    state: Literal["device", "host"] | Omitted = None
    strategy: str | Omitted = None
    sample_rate: int | Omitted = None
    modes: list[str] | Omitted = None
    stream_out: bool | Omitted = None
    stream_in: bool | Omitted = None
    languages: list[str] | Omitted = None
    voices: list[str] | Omitted = None
    options: list[dict[str, Any]] | Omitted = Field(None, description="the request options the model takes: each "
                                                                      "a JSON schema with its name")
    aliases: list[str] | Omitted = Field(None, description="the model aliases (--alias) that stand for it")
    voice_aliases: dict[str, str] | Omitted = Field(None, description="voice aliases (--voice-alias) on it: alias "
                                                                       "-> voice")
    alias_of: str | Omitted = Field(None, description="an alias's entry: the served model it stands for")


class LoadedModel(ModelEntry):
    evicted: list[str] = Field(description="models the planner evicted to make room")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


class Unloaded(BaseModel):
    id: str
    object: Literal["model"]
    loaded: Literal[False]


class VoiceEntry(BaseModel):
    """A voice: uploaded, a model's preset, or cached on a model (and stored)."""

    id: str
    object: Literal["voice"]
    kind: Literal["uploaded", "preset", "cached"]
    model: str | None = None
    sample_rate: int | Omitted = None
    seconds: float | Omitted = None
    stored: bool | Omitted = None
    loaded: bool | Omitted = None
    has_text: bool | Omitted = None
    description: str | Omitted = None


class VoiceList(BaseModel):
    object: Literal["list"]
    data: list[VoiceEntry]


class Deleted(BaseModel):
    id: str
    object: Literal["voice"]
    deleted: Literal[True]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready", "busy", "no model loaded", "shutting down"]
    models: list[str] | Omitted = None
    in_flight: int | Omitted = None
    queued: int | Omitted = None
    loop_failures: dict[str, int] | Omitted = Field(None, description="each model's compute loop failures, if any")


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class AudioDelta(BaseModel):
    type: Literal["speech.audio.delta"]
    audio: str = Field(json_schema_extra={"contentEncoding": "base64"},
                       description="PCM16 (for wav the first delta starts with a WAV header)")


class AudioDone(BaseModel):
    type: Literal["speech.audio.done"]
    sample_rate: int
    seconds: float
    usage: Usage


class ErrorEvent(BaseModel):
    type: Literal["error"]
    error: ErrorBody


class SpeechEvent(BaseModel):
    """One server-sent event of a speech stream: its data is one of these as JSON."""

    data: str = Field(json_schema_extra={"contentMediaType": "application/json"})
    # the data's JSON schema, for clients: a speech.audio.delta, a speech.audio.done or an error
    model_config = ConfigDict(json_schema_extra=lambda schema, model: schema["properties"]["data"].update(
        contentSchema={"oneOf": [_inline(m) for m in (AudioDelta, AudioDone, ErrorEvent)]}))


def _inline(model: type[BaseModel]) -> dict:
    """`model`'s schema with its nested models written in place (a `$ref` inside an event's data could not
    point into the document)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return walk(defs[x["$ref"].rsplit("/", 1)[1]]) if "$ref" in x else {k: walk(v) for k, v in x.items()}
        return [walk(v) for v in x] if isinstance(x, list) else x
    return walk(schema)
