"""Wyoming server (Home Assistant's voice protocol) over the Runtime, on the `wyoming` package.

Events handled:
  describe                                   -> info: every served model's voices (tts program "mizuoto")
  synthesize                                 -> audio-start, audio-chunk..., audio-stop
  synthesize-start, synthesize-chunk..., synthesize-stop
                                             -> audio-start, audio-chunk... as made, audio-stop, synthesize-stopped
A model that takes text in pieces (CosyVoice 2/3: the LM reads tokens as they arrive; Piper:
sentence by sentence) starts speaking before synthesize-stop; others speak once it arrives.
Every failure is an `error` event; the connection stays open for the next request, except after
an event that cannot be read (malformed, or declaring more data than a request may hold) or
--idle-timeout seconds without an event (a stream then ends and frees its job): those are closed.
A stream takes a job slot only once it has text to speak.

Each request (a synthesize, or a stream from its synthesize-start: its model's load, a client
leaving during it cancels it, then its job) is one Session (session.py); sessions, limits,
deadlines and uploaded voices are the HTTP server's (ServerState), so both front ends behave alike.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.server import AsyncEventHandler, AsyncServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from mizuoto.errors import InvalidRequest
from mizuoto.nn.dsp.wav import to_pcm16
from mizuoto.server.errors import ApiError, from_exception
from mizuoto.server.jobs import ClientGone, in_fresh_thread, in_time
from mizuoto.runtime.lease import POLL_S
from mizuoto.runtime.malloc import tune_malloc
from mizuoto.server.session import Session
from mizuoto.server.bodies import parse_json
from mizuoto.server.wyoming_service import WyomingService

log = logging.getLogger("mizuoto.wyoming")
SAMPLES_PER_CHUNK = 1024  # as wyoming-piper: small audio-chunk events keep a player's buffer short
LAST_WORD_S = 5.0  # how long the error event before a close may wait for a client that reads nothing
LINGER_BYTES = 1 << 20  # what a client may still send after that error before it is cut off


def _data(event: Event) -> dict:
    return event.data if isinstance(event.data, dict) else {}


def _text_of(event: Event) -> Any:
    return _data(event).get("text")


def _voice_of(event: Event) -> SynthesizeVoice | None:
    voice = _data(event).get("voice") or {}
    if not isinstance(voice, dict) or not all(isinstance(v, str) for v in voice.values()):
        raise ApiError(400, "voice must be an object of strings: {\"name\": ..., \"speaker\": ..., \"language\": ...}")
    return SynthesizeVoice.from_dict(voice)


class _Stream:
    """One synthesize-start ... synthesize-stop (one Session): text goes into the job as it arrives, audio out as
    it is made."""

    def __init__(self, handler: WyomingHandler, session: Session, stream_in: bool):
        self.handler, self.session, self.stream_in = handler, session, stream_in
        self.pieces: list[str] = []
        self.chars = 0
        self.pump: asyncio.Task | None = None
        self.end: float | None = None  # from its first text, the stream's text has --body-timeout in all

    def add(self, text: str) -> None:
        """Take one synthesize-chunk."""
        self.chars += len(self.handler.service.check_text(text, self.chars))
        if not text:
            return
        if self.end is None:
            self.end = time.monotonic() + self.handler.service.state.config.body_timeout
        if not self.stream_in:
            self.pieces.append(text)
            return
        self.session.put(text)
        if self.pump is None:  # the job (and its slot) starts with the first text: a silent stream holds none
            self.pump = asyncio.ensure_future(self.handler.speak(self.session))

    async def finish(self) -> bool:
        """Speak what is left; True when every chunk of audio went out."""
        if self.pump is not None:
            self.session.end_text()
            return await self.pump
        text = "".join(self.pieces)
        if not text.strip():
            raise ApiError(400, "no text was sent between synthesize-start and synthesize-stop")
        return await self.handler.speak(self.session, text)

    def cancel(self) -> None:
        """End the stream's session (stop, error, disconnect)."""
        self.session.close()
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()


class WyomingHandler(AsyncEventHandler):
    """One client connection."""

    def __init__(self, service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__(reader, writer)
        self.service = service
        self.stream: _Stream | None = None
        self.dropping = False  # a stream failed: ignore its remaining chunks until its stop

    async def run(self) -> None:
        """Answer events until the client leaves; one that cannot be read, or silence, closes the connection."""
        self._is_running = True
        try:
            while self._is_running:
                try:
                    event = await self.read_event()
                except ApiError as e:  # what follows cannot be read, or the client went silent: say why, close
                    self._drop_stream()
                    await self._last_word(e)
                    break
                if event is None or not await self.handle_event(event):
                    break
        finally:
            await self.disconnect()
            self.writer.close()

    async def read_event(self) -> Event | None:
        """The next event (None once the client left), its lengths checked before any data is read.

        The `wyoming` package's reader buffers whatever data_length a header declares; here a header
        past max_event_bytes is refused unread, and each read waits at most --idle-timeout.
        """
        config, limit = self.service.state.config, self.service.max_event_bytes()
        end = self.stream.end if self.stream is not None else None

        async def within(awaitable: Any) -> bytes:
            return await in_time(awaitable, config.idle_timeout, end,
                                 f"the connection sent no event for {config.idle_timeout:g} s",
                                 f"the stream's text took longer than {config.body_timeout:g} s")

        async def read(n: int) -> bytes:  # readexactly(0) is b"" at once
            return await within(self.reader.readexactly(n))

        try:
            line = await within(self.reader.readline())  # at most the reader's limit, 64 KiB
            if not line:
                return None
            header = json.loads(line)
            if not isinstance(header, dict) or not isinstance(header.get("type"), str) \
                    or not isinstance(data := header.get("data") or {}, dict):
                raise ApiError(400, "an event header must be a JSON object with a 'type' string")
            sizes = {key: header.get(key) or 0 for key in ("data_length", "payload_length")}
            for key, size in sizes.items():
                if type(size) is not int or not 0 <= size <= limit:
                    raise ApiError(413, f"{key} must be a number of bytes up to {limit}, got "
                                        f"{size if type(size) is int else type(size).__name__}")
            more = parse_json(await read(sizes["data_length"]) or b"{}", "an event's data")  # its values counted first
            if not isinstance(more, dict):
                raise ApiError(400, "an event's data must be a JSON object")
            payload = await read(sizes["payload_length"]) or None
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        except (ValueError, RecursionError) as e:  # not JSON, nested too deeply, or a line past the reader's limit
            raise ApiError(400, f"unreadable event: {e}") from None
        return Event(type=header["type"], data={**data, **more}, payload=payload)

    async def write_event(self, event: Event) -> None:
        """Send one event; a client that takes none of it for --idle-timeout is dropped, and its job with it
        (it would hold the connection, and the job its slot, for as long as it reads nothing)."""
        idle = self.service.state.config.idle_timeout
        try:
            await asyncio.wait_for(super().write_event(event), idle)
        except asyncio.TimeoutError:
            self.writer.transport.abort()
            raise ConnectionError(f"the client read nothing for {idle:g} s") from None

    async def _last_word(self, e: ApiError) -> None:
        """Send the error, then end our side and discard what the client still sends (at most LAST_WORD_S).

        Closing a socket with unread input sends a reset, and a reset can destroy the error event in the
        client's buffers before it reads it (a client still writing, dripping text, is the common case);
        a half-close first lets it read the error and then the end, as servers linger before closing.
        """
        try:
            await asyncio.wait_for(self.report(e), LAST_WORD_S)
            if self.writer.can_write_eof():
                self.writer.write_eof()
            await asyncio.wait_for(self._discard_until_end(), LAST_WORD_S)
        except (asyncio.TimeoutError, ConnectionError):
            self.writer.transport.abort()  # the client reads nothing, or still sends: a plain close would wait

    async def _discard_until_end(self) -> None:
        """Read and drop the client's bytes until it closes its side; one sending more than LINGER_BYTES is cut
        off (a client sending what a refused header declared is not read on)."""
        left = LINGER_BYTES
        while data := await self.reader.read(min(left, 1 << 16)):
            left -= len(data)
            if left <= 0:
                raise ConnectionError("the client goes on sending after the error")

    async def handle_event(self, event: Event) -> bool:
        """Answer one event; failures become error events and the connection stays open."""
        try:
            await self._handle(event)
        except (ConnectionError, ClientGone):
            return False
        except Exception as e:
            await self.report(e)
        return True

    async def _handle(self, event: Event) -> None:
        service = self.service
        if Describe.is_type(event.type):
            await self.write_event(service.info().event())
        elif Synthesize.is_type(event.type):
            if self.stream is not None or self.dropping:
                return  # clients send the whole text again inside a stream, for servers that cannot stream
            voice = service.resolve(_voice_of(event))
            text = service.check_text(_text_of(event))
            if not text.strip():
                raise ApiError(400, "the text to speak is empty")
            session = Session(service.state, service.params(voice), stream=True)
            try:
                await self.speak(session, text)
            finally:
                session.close()
        elif SynthesizeStart.is_type(event.type):
            self._drop_stream()
            self.dropping = True  # until the stream is open: a bad start drops what follows it
            voice = service.resolve(_voice_of(event))
            session = Session(service.state, service.params(voice), stream=True,
                              gone=asyncio.ensure_future(self._left()))  # the client leaving ends its load
            try:
                await session.load()  # under a slot and the session's lease, as a request's own load
                session.watch(None)
                stream_in = service.state.runtime.model(voice.model).capabilities.stream_in
            except BaseException:
                session.close()
                raise
            self.stream, self.dropping = _Stream(self, session, stream_in), False
        elif SynthesizeChunk.is_type(event.type):
            if self.dropping:
                return
            if self.stream is None:
                raise ApiError(400, "synthesize-chunk outside a stream: send synthesize-start first")
            try:
                self.stream.add(_text_of(event))
            except BaseException:
                self._drop_stream(failed=True)
                raise
        elif SynthesizeStop.is_type(event.type):
            if self.dropping:
                self.dropping = False
                return
            if self.stream is None:
                raise ApiError(400, "synthesize-stop outside a stream: send synthesize-start first")
            stream, self.stream = self.stream, None
            try:
                complete = await stream.finish()
            finally:
                stream.cancel()
            if complete:
                await self.write_event(SynthesizeStopped().event())
        else:
            log.debug("ignored a %s event", event.type)

    def _drop_stream(self, failed: bool = False) -> None:
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
            self.dropping = failed

    async def _left(self) -> None:
        """Returns once the client has left (its end read and nothing left unread, or the connection lost): polled,
        as a StreamReader has no wait for its end that leaves what is unread in place."""
        while not (self.reader.at_eof() or self.writer.transport.is_closing()):
            await asyncio.sleep(POLL_S)

    async def speak(self, session: Session, text: str | None = None) -> bool:
        """Run the session's job (on `text`, or on its streamed text) and send its audio; False (after an error
        event) when it failed."""
        session.start_streamed() if text is None else session.start(text)
        started = False
        try:
            while (chunk := await session.next()) is not None:
                rate = chunk.sample_rate
                if not started:
                    await self.write_event(AudioStart(rate=rate, width=2, channels=1).event())
                    started = True
                pcm = to_pcm16(chunk.samples)
                step = SAMPLES_PER_CHUNK * 2
                for at in range(0, len(pcm), step):
                    await self.write_event(AudioChunk(rate=rate, width=2, channels=1, audio=pcm[at:at + step]).event())
            if not started:
                raise ApiError(500, "the engine produced no audio")
            await self.write_event(AudioStop().event())
            return True
        except (ConnectionError, ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:
            if session.streamed:  # a failed stream: its remaining chunks are ignored until its stop
                session.close()
                if self.stream is not None and self.stream.session is session:
                    self.stream, self.dropping = None, True
            await self.report(e)
            return False
        finally:
            session.close()

    async def report(self, e: BaseException) -> None:
        """Send an error event with a one-line text (engine bugs are logged in full)."""
        error = from_exception(e)
        if error.status >= 500:
            log.log(logging.ERROR if error.status == 500 else logging.WARNING, "wyoming request failed: %s", e,
                    exc_info=error.status == 500)
        code = {400: "invalid_request", 404: "not_found", 408: "timeout", 413: "invalid_request", 503: "overloaded",
                504: "timeout", 507: "out_of_memory"}.get(error.status, "server_error")
        text = error.body(self.service.state.private_paths())["error"]["message"]
        await self.write_event(Error(text=text, code=code).event())

    async def disconnect(self) -> None:
        """The client left: cancel what it started."""
        self._drop_stream()


class WyomingServer:
    """Serves a WyomingService on a `tcp://HOST:PORT` (or `unix://PATH`) URI until stopped."""

    def __init__(self, service: WyomingService, uri: str):
        try:
            self.server = AsyncServer.from_uri(uri)
        except ValueError as e:
            raise InvalidRequest(f"--uri {uri!r}: {e}") from None
        self.service, self.uri = service, uri

    async def start(self) -> None:
        """Tune malloc as the HTTP server does, load the models, then accept connections."""
        config = self.service.state.config
        tune_malloc(config.mmap_threshold, config.malloc_arenas)  # else bursts leave ~1 GB resident (see malloc.py)
        await in_fresh_thread(self.service.load_all)
        await self.server.start(lambda reader, writer: WyomingHandler(self.service, reader, writer))
        names = [v.name for v in self.service.voices()]
        log.info("serving %d voice(s) on %s: %s", len(names), self.uri, ", ".join(names) or "none")

    async def stop(self, timeout: float = 10.0) -> None:
        """Close every connection, cancel running jobs (waiting up to `timeout` s for them) and free the models."""
        state = self.service.state
        state.closing = True
        await self.server.stop()
        await asyncio.to_thread(state.shutdown, timeout)
