"""POST /v1/audio/speech: whole files, chunked audio streams and SSE, each run as a Job."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch

from mizuoto.errors import MizuotoError
from mizuoto.runtime.engine import AudioChunk, Reference, SynthesisRequest
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.threads import in_thread
from mizuoto.server.audio import (MEDIA_TYPES, check_finite, decode_base64, decode_reference, encode, pcm16,
                                  wav_header)
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.jobs import Cancelled, Job, TextFeed, in_fresh_thread
from mizuoto.server.state import LOAD_WAIT_S, ServerState

log = logging.getLogger("mizuoto.server")
JOIN_SECONDS = 5.0  # how long a finished request waits for its worker to release the slot


class ClientGone(Exception):
    """The client disconnected; its job was cancelled."""


def inline_reference(state: ServerState, p: Any, lease: Lease | None = None) -> Reference | None:
    """The reference given in `ref_audio` (an uploaded voice id or base64 audio), checked now; the request's `lease`
    ends the wait for its decoding."""
    if p.ref_audio is None:
        return None
    stored = state.voices.get(p.ref_audio)  # one read: the voice may be deleted meanwhile
    if stored is not None:
        return Reference((stored.samples, stored.rate), p.ref_text or stored.text)
    # in a thread that ends with it: the job's own thread would keep the decode's OpenMP team
    # alive beside a batched model's compute thread for the whole request
    samples, rate = in_thread(lambda: decode_reference(decode_base64(p.ref_audio, "ref_audio"), "ref_audio"),
                              lease=lease)
    return Reference((samples, rate), p.ref_text)


def build_request(state: ServerState, p: Any, reference: Reference | None, stream: bool,
                  text: str | Iterable[str] | None = None, lease: Lease | None = None) -> SynthesisRequest:
    """The SynthesisRequest for a checked body; runs in the worker (the model may load first, and is
    pinned for the lease from then on: no other request can evict it before this one runs)."""
    state.ensure_loaded(p.model, lease)
    model = state.runtime.model(p.model)
    ids = [v.id for v in state.runtime.voices(p.model)]
    uploaded = state.voices.get(p.voice) if p.voice is not None else None  # one read, as above
    if reference is not None:
        voice: Any = reference
    elif p.voice is not None and p.voice in ids:
        voice = p.voice
    elif uploaded is not None:
        voice = uploaded.reference()
    elif p.voice is not None:
        foreign = state.runtime.foreign_voice(p.model, p.voice)  # a voice cached for another model: say so
        raise ApiError(400, foreign or f"unknown voice for model {p.model}; GET /v1/audio/voices lists them", "voice")
    else:
        presets = [v.id for v in state.runtime.voices(p.model) if v.kind == "preset"]
        if not presets:
            raise ApiError(400, f"field 'voice' is required: model {p.model} has no preset voice"
                                " (or give ref_audio to clone a voice)", "voice")
        voice = presets[0]
    caps = model.capabilities
    if isinstance(voice, Reference) and not caps.modes & {"clone", "cross_lingual", "instruct", "vc"}:
        raise ApiError(400, f"model {p.model} does not support mode 'clone' (voices from reference audio);"
                            f" it supports: {', '.join(sorted(caps.modes))}", "ref_audio" if reference else "voice")
    try:
        return SynthesisRequest(text=p.input if text is None else text, voice=voice, instruct=p.instructions,
                                speed=p.speed, stream=stream and caps.stream_out, seed=p.seed, options=p.options or {})
    except Exception as e:
        raise from_exception(e) from None


async def load_model(state: ServerState, name: str) -> None:
    """Load `name` for a session before its first request (WebSocket, Wyoming, Ray), in a thread that ends with it,
    under a slot and a lease as a request's own load is (`ServerState.load_for_session`); the awaiting client
    leaving (this coroutine cancelled) cancels the lease."""
    lease = Lease(state.config.request_timeout or LOAD_WAIT_S)
    try:
        await in_fresh_thread(state.load_for_session, name, lease)
    except asyncio.CancelledError:
        lease.cancel("because its client left")
        raise


def start_job(state: ServerState, p: Any, stream: bool, text: str | Iterable[str] | None = None) -> Job:
    """Take a slot or a place in the queue (or 503) and start the synthesis in a worker thread.

    The worker waits in the queue for its slot; the reference audio is decoded there too, off the
    event loop and bounded by the slots.
    """
    if state.closing:
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": str(state.config.retry_after)})
    ticket = state.limiter.enter()
    if ticket is None:
        raise state.overloaded()

    def start(lease: Lease) -> Iterator[AudioChunk]:
        reference = inline_reference(state, p, lease)
        request = build_request(state, p, reference, stream, text, lease)
        try:
            chunks = state.runtime.synthesize(p.model, request, lease=lease)
            try:
                first = next(chunks)  # the model is held from here on
            except StopIteration:
                return iter(())
        except MizuotoError as e:
            raise from_exception(e) from None
        return itertools.chain([first], chunks)

    loop = asyncio.get_running_loop()

    def finished(job: Job) -> None:  # called in the worker thread; the set belongs to the event loop
        try:
            loop.call_soon_threadsafe(state.jobs.discard, job)
        except RuntimeError:  # the loop is closed (server gone)
            pass

    job = Job(start, state.limiter, ticket, state.config.request_timeout, on_finish=finished,
              on_admit=state.metrics.queue_wait, retry_after=state.config.retry_after)
    state.jobs.add(job)
    if isinstance(text, TextFeed):  # streamed text: the job's lease ends its waits too
        text.follow(job.lease)
    return job.run()


async def _disconnected(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Pull:
    """Pulls a job's chunks while watching for the client leaving (an HTTP `request`'s disconnect, or `gone`, a
    future that ends when a WebSocket client leaves); records latency and RTF."""

    def __init__(self, state: ServerState, job: Job, model: str, request: Any | None,
                 gone: asyncio.Future | None = None):
        self.state, self.job, self.model = state, job, model
        self.samples = 0
        self.rate = 0
        self.count = 0
        self.ended = False  # the job finished or failed: nothing left to cancel
        self._gone = asyncio.ensure_future(_disconnected(request)) if request is not None else gone

    async def next(self) -> AudioChunk | None:
        """The next chunk (None at the end); ApiError for a failed job, ClientGone when the client left."""
        get = asyncio.ensure_future(self.job.next())
        waits = {get} if self._gone is None else {get, self._gone}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            get.cancel()
            self.cancel()
            raise
        if get not in done:
            get.cancel()
            self.cancel()
            raise ClientGone()
        try:
            chunk = get.result()
        except Cancelled:
            raise ClientGone() from None
        except Exception as e:
            self.ended = True
            self.close()
            error = from_exception(e)
            if error.status == 504:
                self.state.metrics.cancel()
            if error.status >= 500:
                log.log(logging.ERROR if error.status == 500 else logging.WARNING, "request on %s failed: %s",
                        self.model, e, exc_info=error.status == 500)
            if error.status == 507 and torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise error from None
        if chunk is None:
            self.ended = True
            self.close()
            # the worker frees its slot as it ends: wait for that, so a client that sends its next
            # request on receiving this response finds the slot free
            await asyncio.to_thread(self.job.join, JOIN_SECONDS)
            wall = time.monotonic() - self.job.started
            if self.rate:
                self.state.metrics.synthesis(self.model, wall, self.samples / self.rate)
            return None
        try:
            check_finite(chunk.samples)
        except ApiError:
            self.ended = True
            self.cancel()
            log.error("request on %s: the engine produced non-finite audio", self.model)
            raise
        if self.count == 0:
            self.state.metrics.first_chunk_latency(self.model, time.monotonic() - self.job.started)
        self.count += 1
        self.samples += chunk.samples.numel()
        self.rate = chunk.sample_rate
        return chunk

    def cancel(self) -> None:
        """Stop the job (client gone, shutdown) and the disconnect watch."""
        if not self.ended and not self.job.finished.is_set() and not self.job.cancelled.is_set():
            self.state.metrics.cancel()
        self.job.cancel()
        self.close()

    def close(self) -> None:
        """Stop watching for disconnect."""
        if self._gone is not None:
            self._gone.cancel()


def headers(p: Any, rate: int) -> dict:
    """Response headers that describe the audio."""
    return {"X-Sample-Rate": str(rate), "X-Mizuoto-Model": p.model}


async def whole(p: Any, pull: Pull) -> tuple[bytes, int]:
    """Every chunk, encoded as one file."""
    chunks = []
    while (chunk := await pull.next()) is not None:
        chunks.append(chunk.samples.detach().cpu())
    if not chunks:
        raise ApiError(500, "the engine produced no audio")
    return await in_fresh_thread(lambda: encode(torch.cat(chunks), pull.rate, p.response_format)), pull.rate


async def audio_stream(p: Any, pull: Pull, first: AudioChunk) -> AsyncIterator[bytes]:
    """Chunked audio: a WAV header of unknown length (for wav), then PCM16 as produced."""
    try:
        if p.response_format == "wav":
            yield wav_header(first.sample_rate)
        chunk = first
        while chunk is not None:
            yield pcm16(chunk.samples)
            chunk = await pull.next()
    except ClientGone:
        log.info("client left a stream on %s; its job is cancelled", p.model)
    except ApiError as e:
        log.warning("stream on %s ended early: %s", p.model, e.message)
    finally:
        pull.cancel()


def sse(event: dict) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def sse_stream(p: Any, pull: Pull, first: AudioChunk) -> AsyncIterator[bytes]:
    """SSE: speech.audio.delta events (base64 PCM16, or WAV for wav: the header rides on the first) then done."""
    try:
        chunk, prefix = first, wav_header(first.sample_rate) if p.response_format == "wav" else b""
        while chunk is not None:
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(prefix + pcm16(chunk.samples)).decode()})
            prefix = b""
            chunk = await pull.next()
        chars = len(p.input or "")
        yield sse({"type": "speech.audio.done", "sample_rate": pull.rate, "seconds": pull.samples / max(pull.rate, 1),
                   "usage": {"input_tokens": chars, "output_tokens": pull.count, "total_tokens": chars + pull.count}})
    except ApiError as e:
        yield sse({"type": "error", **e.body(pull.state.private_paths())})
    except ClientGone:
        pass
    finally:
        pull.cancel()


def media_type(p: Any) -> str:
    """Content type of the response."""
    return "text/event-stream" if p.stream_format == "sse" else MEDIA_TYPES[p.response_format]
