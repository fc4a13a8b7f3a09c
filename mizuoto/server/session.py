"""One request of any transport (HTTP speech, WebSocket, Wyoming, Ray's loads): its lease, load, text in, audio out.

A Session's Lease (`runtime.lease`, deadline --request-timeout) is made when the session opens and
is the request's one context from then on: its model's load (`load`), its wait for a job slot and
its synthesis (a `Job`) all take it, so the client leaving or the deadline ends whichever of them
runs. Text goes in whole (`start`) or in pieces (`put`, `end_text`, `start_streamed`: the session's
own TextFeed); audio comes out with `next`, which also watches for the client leaving (an HTTP
request's disconnect, or a future the transport gives to `watch`). `close` ends whatever still runs.
The worker builds its SynthesisRequest from the checked speech fields (`build_request`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mizuoto.errors import MizuotoError
from mizuoto.runtime.engine import AudioChunk, Reference, SynthesisRequest
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.threads import in_thread
from mizuoto.server.audio import check_finite, decode_base64, decode_reference
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.jobs import Cancelled, ClientGone, Job, TextFeed, in_fresh_thread
from mizuoto.server.state import ServerState

log = logging.getLogger("mizuoto.server")
JOIN_SECONDS = 5.0  # how long a finished request waits for its worker to release the slot


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
    # a model that speaks reference audio has a clone mode; instruct alone may take presets only (Qwen3-TTS CustomVoice)
    if isinstance(voice, Reference) and not caps.modes & {"clone", "cross_lingual", "vc"}:
        raise ApiError(400, f"model {p.model} does not support mode 'clone' (voices from reference audio);"
                            f" it supports: {', '.join(sorted(caps.modes))}", "ref_audio" if reference else "voice")
    try:
        return SynthesisRequest(text=p.input if text is None else text, voice=voice, instruct=p.instructions,
                                speed=p.speed, stream=stream and caps.stream_out, seed=p.seed, options=p.options or {})
    except Exception as e:
        raise from_exception(e) from None


async def _disconnected(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Session:
    """One request: `p` its checked speech fields (None for a load alone), `stream` whether its audio streams;
    `request` (an HTTP request whose disconnect ends it) or `gone` (a future that ends when its client leaves)."""

    def __init__(self, state: ServerState, p: Any, *, stream: bool, request: Any = None,
                 gone: asyncio.Future | None = None):
        self.state, self.p, self.stream = state, p, stream
        self.model = p.model if p is not None else None
        self.lease = Lease(state.config.request_timeout)  # from the first byte: load, slot wait and synthesis
        self.feed = TextFeed(self.lease)  # streamed text; its wait for more ends with the lease too
        self.job: Job | None = None
        self.streamed = False  # the job reads the feed
        self.samples = 0
        self.rate = 0
        self.count = 0
        self.ended = False  # the job finished or failed: nothing left to cancel
        self._gone: asyncio.Future | None = None
        self.watch(asyncio.ensure_future(_disconnected(request)) if request is not None else gone)

    def watch(self, gone: asyncio.Future | None) -> None:
        """Watch `gone` (it ends when the client leaves) from now on, instead of what was watched (cancelled)."""
        if self._gone is not None and self._gone is not gone:
            self._gone.cancel()
        self._gone = gone

    async def load(self, name: str | None = None) -> None:
        """Load the session's model (or `name`) before its first text, under a slot and the session's lease
        (`ServerState.load_for_session`), in a thread that ends with it; the client leaving (the watched future
        ending, ClientGone, or this coroutine cancelled) cancels the lease, which ends the load's waits."""
        work = asyncio.ensure_future(in_fresh_thread(self.state.load_for_session, name or self.model, self.lease))
        waits = {work} if self._gone is None else {work, self._gone}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.lease.cancel("because its client left")
            work.cancel()
            raise
        if work not in done:
            self.lease.cancel("because its client left")
            work.cancel()
            raise ClientGone()
        work.result()

    # ---- text in ---------------------------------------------------------------------------------
    def start(self, text: str) -> None:
        """Start the synthesis of the whole `text`: a slot or a place in the queue (or 503), then a worker."""
        self._start(text)

    def put(self, piece: str) -> None:
        """Add a piece of streamed text (before or after `start_streamed`)."""
        self.feed.put(piece)

    def end_text(self) -> None:
        """The streamed text is complete."""
        self.feed.done()

    def cancel_text(self) -> None:
        """End the streamed text as failed: the job's read of it raises, as a client leaving would end it."""
        self.feed.cancel()

    def start_streamed(self) -> None:
        """Start the synthesis of the streamed text (`put` so far and from now on), as `start` does."""
        self._start(self.feed)

    def _start(self, text: str | Iterable[str]) -> None:
        """Take a slot or a place in the queue (or 503) and start the synthesis in a worker thread.

        The worker waits in the queue for its slot; the reference audio is decoded there too, off the
        event loop and bounded by the slots.
        """
        if self.job is not None:
            raise RuntimeError("a session runs one job")
        state, p, stream = self.state, self.p, self.stream
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

        self.streamed = text is self.feed
        self.job = Job(start, state.limiter, ticket, self.lease, on_finish=finished,
                       on_admit=state.metrics.queue_wait, retry_after=state.config.retry_after)
        state.jobs.add(self.job)
        self.job.run()

    # ---- audio out -------------------------------------------------------------------------------
    async def next(self) -> AudioChunk | None:
        """The next chunk (None at the end); ApiError for a failed job, ClientGone when the client left."""
        job = self.job
        get = asyncio.ensure_future(job.next())
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
            self.watch(None)
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
            self.watch(None)
            # the worker frees its slot as it ends: wait for that, so a client that sends its next
            # request on receiving this response finds the slot free
            await asyncio.to_thread(job.join, JOIN_SECONDS)
            wall = time.monotonic() - job.started
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
            self.state.metrics.first_chunk_latency(self.model, time.monotonic() - job.started)
        self.count += 1
        self.samples += chunk.samples.numel()
        self.rate = chunk.sample_rate
        return chunk

    # ---- the end ---------------------------------------------------------------------------------
    def cancel(self, reason: str = "because its client left") -> None:
        """End whatever still runs (client gone, an error, shutdown): the feed, the load or the job, the watch."""
        job = self.job
        if job is not None and not self.ended and not job.finished.is_set() and not job.cancelled.is_set():
            self.state.metrics.cancel()
        self.feed.cancel()
        self.lease.cancel(reason)
        if job is None:  # no job will release it: what the session's lease holds goes now
            self.lease.release()
        self.watch(None)

    def close(self) -> None:
        """End the session (idempotent): a finished one has nothing left; otherwise as `cancel`."""
        self.cancel()
