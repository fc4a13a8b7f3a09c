"""Streaming audio out: the frames so far decoded in chunks, each with the frames before it as left context.

Upstream (qwen-tts 0.1.1) returns whole waveforms only; its codec decodes long inputs in chunks of
300 frames, each after 25 frames of left context whose audio is dropped (the decoder is causal, so
a chunk's samples depend on the frames before it only through that context). A stream decodes the
same way, with smaller chunks as the frames come: the first FIRST_FRAMES frames (the first audio
soon), then every CHUNK_FRAMES. Its audio is therefore the codec's chunked decode at those chunk
sizes; its codes are the whole request's (the same draws), and a clone's reference codes are the
first chunk's left context, as they are in upstream's whole decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mizuoto.runtime.engine import AudioChunk

FIRST_FRAMES = 4  # 0.32 s at 12.5 Hz
CHUNK_FRAMES = 12  # ~1 s
LEFT_CONTEXT = 25  # upstream's chunked decode's left context


def stream_audio(model: Any, frames: Iterator[torch.Tensor], clone: Any, rate: int) -> Iterator[AudioChunk]:
    """AudioChunks of the frames as the talker draws them, the last one final (possibly empty)."""
    context = clone.ref_codes if clone is not None and clone.in_context else None
    codes = [] if context is None else list(context)
    done = len(codes)  # frames whose audio is out (a clone's reference: never spoken)
    index = 0
    pending: torch.Tensor | None = None  # a chunk held back until the next says whether it is the last
    want = FIRST_FRAMES
    for frame in frames:
        codes.append(frame)
        if len(codes) - done < want:
            continue
        audio = _decode(model, codes, done)
        done, want = len(codes), CHUNK_FRAMES
        if pending is not None:
            yield AudioChunk(pending, rate, index, False)
            index += 1
        pending = audio
    if len(codes) > done:
        audio = _decode(model, codes, done)
        if pending is not None:
            yield AudioChunk(pending, rate, index, False)
            index += 1
        pending = audio
    yield AudioChunk(pending if pending is not None else torch.zeros(0), rate, index, True)


def _decode(model: Any, codes: list[torch.Tensor], done: int) -> torch.Tensor:
    """The audio of codes[done:], decoded after up to LEFT_CONTEXT frames before them (their audio dropped)."""
    start = max(0, done - LEFT_CONTEXT)
    return model.decode_codes(torch.stack(codes[start:]), done - start).to(torch.float32).contiguous()
