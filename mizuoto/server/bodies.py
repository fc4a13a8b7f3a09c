"""What a client sends, read and parsed within bounds: a body's size and time, and its JSON's count of values.

`json.loads` and pydantic hold the GIL for the whole of their work, so a worker thread would stall the event
loop just as parsing on it does: what a client sends is bounded before it is parsed instead.
"""

from __future__ import annotations

import json
import time
from typing import Any

from mizuoto.server.errors import ApiError
from mizuoto.server.jobs import in_time

# JSON values a body or message may hold. A speech request holds a few dozen; its text fields may hold a comma
# per character. 262,144 values parse in milliseconds; a body of 200,000 '[' is still refused as nested too
# deeply, as it always was.
MAX_JSON_VALUES = 1 << 18
REFERENCE_FILE_BYTES = 8 << 20  # a ref_audio file sent inline: 30 s of 48 kHz stereo 16-bit WAV is 5.8 MB


def speech_body_bytes(max_chars: int) -> int:
    """The largest speech body a request needs: its three texts at 12 JSON bytes a character (an escaped
    surrogate pair), a reference clip of REFERENCE_FILE_BYTES as base64, and 64 KiB for every other field."""
    return 3 * 12 * max_chars + 4 * -(-REFERENCE_FILE_BYTES // 3) + (64 << 10)


def parse_json(body: bytes | str, what: str = "request body", max_values: int = MAX_JSON_VALUES) -> Any:
    """The JSON value of a request body or message (its models say whether it must be an object), refused
    unparsed when it may hold more than `max_values` values (`what` names it in the 400)."""
    # every value but a container's first follows a ',', and every container opens with '[' or '{': their
    # count bounds the values, found at memchr speed (commas inside strings count too, which only errs safe)
    marks = (b",", b"[", b"{") if isinstance(body, bytes) else (",", "[", "{")
    if sum(body.count(m) for m in marks) > max_values:
        raise ApiError(400, f"{what} holds more than {max_values} JSON values")
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"{what} is not valid JSON: {e}") from None


async def read_body(request: Any, limit: int, idle: float, total: float) -> bytes:
    """The request body, refused (413) past `limit` bytes, and (408) when it stalls for `idle` s or takes longer
    than `total` s in all (a body trickled a byte at a time never stalls)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    parts, size = [], 0
    stream = request.stream().__aiter__()
    end = time.monotonic() + total
    while True:
        try:
            part = await in_time(stream.__anext__(), idle, end, f"the request body stalled for {idle:g} s",
                                 f"the request body took longer than {total:g} s")
        except StopAsyncIteration:
            break
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)
