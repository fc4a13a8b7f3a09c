"""POST /v1/audio/speech's answer: a whole file, a chunked audio stream or SSE, each from a Session's audio."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import torch

from mizuoto.runtime.engine import AudioChunk
from mizuoto.server.audio import MEDIA_TYPES, encode, pcm16, wav_header
from mizuoto.server.errors import ApiError
from mizuoto.server.jobs import ClientGone, in_fresh_thread
from mizuoto.server.session import Session

log = logging.getLogger("mizuoto.server")


def headers(p: Any, rate: int) -> dict:
    """Response headers that describe the audio."""
    return {"X-Sample-Rate": str(rate), "X-Mizuoto-Model": p.model}


async def whole(p: Any, session: Session) -> tuple[bytes, int]:
    """Every chunk, encoded as one file."""
    chunks = []
    while (chunk := await session.next()) is not None:
        chunks.append(chunk.samples.detach().cpu())
    if not chunks:
        raise ApiError(500, "the engine produced no audio")
    return await in_fresh_thread(lambda: encode(torch.cat(chunks), session.rate, p.response_format)), session.rate


async def audio_stream(p: Any, session: Session, first: AudioChunk) -> AsyncIterator[bytes]:
    """Chunked audio: a WAV header of unknown length (for wav), then PCM16 as produced."""
    try:
        if p.response_format == "wav":
            yield wav_header(first.sample_rate)
        chunk = first
        while chunk is not None:
            yield pcm16(chunk.samples)
            chunk = await session.next()
    except ClientGone:
        log.info("client left a stream on %s; its job is cancelled", p.model)
    except ApiError as e:
        log.warning("stream on %s ended early: %s", p.model, e.message)
    finally:
        session.close()


def sse(event: dict) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def sse_stream(p: Any, session: Session, first: AudioChunk) -> AsyncIterator[bytes]:
    """SSE: speech.audio.delta events (base64 PCM16, or WAV for wav: the header rides on the first) then done."""
    try:
        chunk, prefix = first, wav_header(first.sample_rate) if p.response_format == "wav" else b""
        while chunk is not None:
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(prefix + pcm16(chunk.samples)).decode()})
            prefix = b""
            chunk = await session.next()
        chars = len(p.input or "")
        count = session.count
        yield sse({"type": "speech.audio.done", "sample_rate": session.rate,
                   "seconds": session.samples / max(session.rate, 1),
                   "usage": {"input_tokens": chars, "output_tokens": count, "total_tokens": chars + count}})
    except ApiError as e:
        yield sse({"type": "error", **e.body(session.state.private_paths())})
    except ClientGone:
        pass
    finally:
        session.close()


def media_type(p: Any) -> str:
    """Content type of the response."""
    return "text/event-stream" if p.stream_format == "sse" else MEDIA_TYPES[p.response_format]
