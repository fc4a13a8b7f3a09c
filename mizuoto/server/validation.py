"""Request bodies checked field by field before any work: each problem is a 400 naming its field."""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass

from mizuoto.runtime.engine import SPEED_RANGE
from mizuoto.server.audio import missing_format
from mizuoto.server.errors import ApiError

STREAM_FORMATS = ("audio", "sse")
SEED_LIMIT = 2**63  # seeds lie in [0, SEED_LIMIT)
VOICE_CHARS = 128  # longest voice id a request may name
SPEECH_FIELDS = ("model", "input", "voice", "instructions", "response_format", "speed", "stream_format",
                 "ref_audio", "ref_text", "seed")


# Names a client chooses (model names, voice ids) appear in headers, metrics and logs: letters,
# digits and a few separators only ('/' and ':' for hub ids such as org/name). Matched whole
# (fullmatch): re's '$' alone would let a trailing newline through. The pattern is also the
# OpenAPI document's, where '$' means the end.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")


def parse_json(body: bytes) -> dict:
    """The JSON object of a request body."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def text_field(data: dict, name: str, required: bool = False, limit: int | None = None) -> str | None:
    """A string field: absent (None unless required), non-empty and at most `limit` characters."""
    value = data.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"field '{name}' is required", name)
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"field '{name}' must be a string, got {type(value).__name__}", name)
    if not value.strip():
        raise ApiError(400, f"field '{name}' is empty", name)
    if limit is not None and len(value) > limit:
        raise ApiError(400, f"field '{name}' has {len(value)} characters; the limit is {limit}", name)
    check_text(value, name)
    return value


def check_text(value: str, name: str) -> None:
    """A 400 for text that cannot be spoken or encoded: lone surrogates and NUL characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"field '{name}' is not valid Unicode (a lone surrogate at character {e.start})",
                       name) from None
    if "\x00" in value:
        raise ApiError(400, f"field '{name}' contains a NUL character", name)


def name_field(data: dict, name: str, required: bool = False) -> str | None:
    """A model name or voice id: `NAME`'s characters only, so it is safe in headers, metrics and logs."""
    value = text_field(data, name, required=required)
    if value is not None and not NAME.fullmatch(value):
        raise ApiError(400, f"field '{name}' must be 1-128 letters, digits or '_', '.', ':', '/', '-' "
                            "(starting with a letter or digit)", name)
    return value


@dataclass(frozen=True)
class SpeechParams:
    """A checked POST /v1/audio/speech body (or WebSocket session)."""

    model: str
    input: str | None
    voice: str | None
    instructions: str | None
    response_format: str
    speed: float
    stream_format: str | None
    ref_audio: str | None
    ref_text: str | None
    seed: int | None


def parse_speech(data: dict, formats: tuple[str, ...], max_chars: int, need_input: bool = True,
                 default_format: str = "wav") -> SpeechParams:
    """Check every field of a speech request; unknown fields are refused so typos do not pass silently."""
    unknown = sorted(set(data) - set(SPEECH_FIELDS))
    if unknown:
        raise ApiError(400, f"unknown field '{unknown[0]}'; known fields: {', '.join(SPEECH_FIELDS)}", unknown[0])
    fmt = data.get("response_format", default_format)
    if fmt not in formats:
        raise ApiError(400, missing_format(fmt, formats), "response_format")
    stream = data.get("stream_format")
    if stream is not None and stream not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format must be 'audio' or 'sse', got {stream!r}", "stream_format")
    if stream is not None and fmt not in ("wav", "pcm"):
        raise ApiError(400, f"response_format {fmt!r} cannot be streamed; use wav or pcm", "response_format")
    speed = data.get("speed", 1.0)
    lo, hi = SPEED_RANGE
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed) \
            or not lo <= speed <= hi:
        raise ApiError(400, f"speed must be a number between {lo:g} and {hi:g}, got {speed!r}", "speed")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
        raise ApiError(400, f"seed must be a non-negative integer, got {seed!r}", "seed")
    return SpeechParams(
        model=name_field(data, "model", required=True),
        input=text_field(data, "input", required=need_input, limit=max_chars),
        voice=voice_field(data),
        instructions=text_field(data, "instructions", limit=max_chars),
        response_format=fmt,
        speed=float(speed),
        stream_format=stream,
        ref_audio=text_field(data, "ref_audio"),
        ref_text=text_field(data, "ref_text", limit=max_chars),
        seed=seed,
    )


def voice_field(data: dict, name: str = "voice") -> str | None:
    """A voice id: up to VOICE_CHARS printable characters (any script: models ship voices such as 中文女)."""
    value = text_field(data, name)
    if value is not None and (len(value) > VOICE_CHARS
                              or any(unicodedata.category(c)[0] == "C" or c in "\u2028\u2029" for c in value)):
        raise ApiError(400, f"field '{name}' must be a voice id: at most {VOICE_CHARS} printable characters", name)
    return value


def field_of(message: str) -> str | None:
    """Best guess at the request field a runtime error message is about."""
    lower = message.lower()
    for key, param in (("voice", "voice"), ("instruct", "instructions"), ("speed", "speed"),
                       ("reference", "ref_audio"), ("text", "input"), ("mode", "voice")):
        if key in lower:
            return param
    return None
