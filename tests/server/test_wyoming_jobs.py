"""The Wyoming server's jobs and connections, in this process: the concurrency limit is an error event, a client
that leaves frees its job, and hostile clients (huge declared lengths, bad text, silence, empty streams) are refused."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import async_read_event, async_write_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from mizuoto.server.launch import free_port
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.server.wyoming import WyomingServer
from mizuoto.server.wyoming_service import WyomingService


class WyomingThread:
    """A WyomingServer on its own event loop in a background thread."""

    def __init__(self, server: WyomingServer):
        self.server, self.loop = server, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="wyoming-test", daemon=True)

    def __enter__(self) -> WyomingThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(5), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _idle(state: ServerState, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while state.jobs or state.limiter.active:
        assert time.monotonic() < end, f"{len(state.jobs)} job(s) still running after {timeout} s"
        time.sleep(0.02)


@contextlib.contextmanager
def _serving(h, tmp_path, **fields):
    """A 'slow' tone model (0.2 s per chunk of 4 notes), a 'gate' one and a fast 48 kHz 'wide' one; at most one
    job at a time and none queued."""
    port = free_port()
    config = ServerConfig(**{"max_concurrent": 1, "max_queued": 0, "request_timeout": 30, **fields})
    models = {"slow": h.write_slow_model(tmp_path / "slow", 0.2), "gate": h.write_gate_model(tmp_path / "gate"),
              "wide": h.write_model(tmp_path / "wide", sample_rate=48000)}
    state = ServerState(h.make_runtime(), config, models)
    with WyomingThread(WyomingServer(WyomingService(state), f"tcp://127.0.0.1:{port}")):
        yield port, state
    assert not state.runtime.models(), "stopping the server frees its models"


@pytest.fixture
def slow_server(h, tmp_path):
    """The models of _serving with its default limits."""
    with _serving(h, tmp_path) as served:
        yield served


def _client(port: int) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", port, connect_timeout=5, read_timeout=30)


def test_limit_is_an_error_and_a_leaving_client_frees_its_job(slow_server):
    port, state = slow_server

    async def run():
        async with _client(port) as b:
            a = _client(port)
            await a.connect()
            await a.write_event(Synthesize("abcd" * 10, voice=SynthesizeVoice("slow")).event())  # 10 chunks, ~2 s
            assert AudioStart.is_type((await a.read_event()).type)
            assert AudioChunk.is_type((await a.read_event()).type)
            await b.write_event(Synthesize("ab", voice=SynthesizeVoice("slow")).event())
            event = await b.read_event()
            assert Error.is_type(event.type), event
            error = Error.from_event(event)
            assert "limit of 1 concurrent" in error.text and error.code == "overloaded"
            await a.disconnect()  # mid-synthesis: the server notices at its next write and cancels the job
            await asyncio.to_thread(_idle, state)
            await b.write_event(Synthesize("ab", voice=SynthesizeVoice("slow")).event())
            types = []
            while not types or not AudioStop.is_type(types[-1]):
                types.append((await b.read_event()).type)
            assert types[0] == "audio-start" and "audio-chunk" in types
    asyncio.run(run())


def test_a_client_that_leaves_mid_stream_frees_its_job(slow_server):
    """Text still coming, audio flowing: the client goes; its job is cancelled and the slot is free again."""
    from wyoming.tts import SynthesizeChunk, SynthesizeStart

    port, state = slow_server

    async def run():
        a = _client(port)
        await a.connect()
        await a.write_event(SynthesizeStart(voice=SynthesizeVoice("slow")).event())
        await a.write_event(SynthesizeChunk("abcd" * 10).event())
        assert AudioStart.is_type((await a.read_event()).type)
        assert state.jobs, "the stream's job runs while its text is still open"
        await a.disconnect()
        await asyncio.to_thread(_idle, state)
    asyncio.run(run())


async def _events_until_closed(reader: asyncio.StreamReader, timeout: float = 10.0) -> list:
    """Every event the server sends until it closes the connection (within `timeout` s)."""
    events = []
    while (event := await asyncio.wait_for(async_read_event(reader), timeout)) is not None:
        events.append(event)
    return events


@pytest.mark.parametrize("header", ['{"type": "synthesize", "data_length": 2000000000}',
                                   '{"type": "synthesize", "payload_length": 2000000000}',
                                   '{"type": "synthesize", "data_length": "64"}'])
def test_an_event_declaring_too_much_is_refused_before_its_bytes_are_read(slow_server, header):
    """A header declaring 2 GB (or a length that is not a number) is answered by an error and a close, at once:
    the server does not wait for, nor buffer, the declared bytes."""
    port, state = slow_server

    async def run():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(header.encode() + b"\n")
            await writer.drain()
            events = await _events_until_closed(reader)
        finally:
            writer.close()
        assert [e.type for e in events] == ["error"], events
        error = Error.from_event(events[0])
        assert error.code == "invalid_request" and f"up to {WyomingService(state).max_event_bytes()}" in error.text
    asyncio.run(run())
    assert WyomingService(state).max_event_bytes() < 1 << 20, "the bound follows the text limit, not 2 GB"


def test_a_client_still_writing_after_the_error_reads_the_error_and_the_end(slow_server):
    """The server's last word survives a client that goes on writing: the bytes that follow a refused header are
    already in the server's buffers when it closes, and a close with unread input resets the connection (the
    client's next write broke its reader, the error unread). The server ends its side and drains instead."""
    port, _ = slow_server

    async def run():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b'{"type": "synthesize", "data_length": "64"}\n' + b" " * 4096)
            await writer.drain()
            await asyncio.sleep(0.5)  # the server has answered and ended its side by now
            for _ in range(3):  # a reset by then would make these writes fail, and the reader with them
                writer.write(b" " * 4096)
                await writer.drain()
                await asyncio.sleep(0.05)
            events = await _events_until_closed(reader)
        finally:
            writer.close()
        assert [e.type for e in events] == ["error"], events
    asyncio.run(run())


def test_the_bytes_a_huge_header_declares_are_not_buffered(slow_server):
    """A client that goes on sending what its 2 GB header declared is cut off: the server reads none of it, and its
    resident memory does not grow by what was sent (the `wyoming` package's reader kept it all: +300 MB)."""
    import psutil

    port, _ = slow_server
    mib = b"x" * (1 << 20)

    async def run() -> int:
        before = psutil.Process().memory_info().rss
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b'{"type": "synthesize", "data_length": 2000000000}\n')
            with pytest.raises(ConnectionError):
                for _ in range(64):  # loopback socket buffers hold a few MiB at most
                    writer.write(mib)
                    await asyncio.wait_for(writer.drain(), 10)
        finally:
            writer.close()
        return psutil.Process().memory_info().rss - before
    assert asyncio.run(run()) < 32 << 20


def test_nul_and_lone_surrogates_are_invalid_requests_plain_and_streamed(slow_server):
    """Text with NUL or a lone surrogate (sent JSON-escaped, as a client may) is refused as HTTP refuses it, in
    synthesize and in synthesize-chunk alike; the connection then serves the next request."""
    port, _ = slow_server
    voice = '"voice": {"name": "slow"}'

    async def run():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for text in (r'"a\u0000b"', r'"a\ud800b"'):
                for lines in ([f'{{"type": "synthesize", "data": {{"text": {text}, {voice}}}}}'],
                              [f'{{"type": "synthesize-start", "data": {{{voice}}}}}',
                               f'{{"type": "synthesize-chunk", "data": {{"text": {text}}}}}',
                               '{"type": "synthesize-stop"}']):
                    writer.write("".join(line + "\n" for line in lines).encode())
                    event = await asyncio.wait_for(async_read_event(reader), 10)
                    assert Error.is_type(event.type), (lines, event)
                    error = Error.from_event(event)
                    assert error.code == "invalid_request", (lines, error)
                    assert "NUL" in error.text or "surrogate" in error.text, error.text
            await async_write_event(Synthesize("ab", voice=SynthesizeVoice("slow")).event(), writer)
            types = []
            while not types or types[-1] != "audio-stop":
                types.append((await asyncio.wait_for(async_read_event(reader), 10)).type)
            assert types[0] == "audio-start", types
        finally:
            writer.close()
    asyncio.run(run())


def test_a_silent_connection_is_closed_and_a_silent_stream_frees_its_job(h, tmp_path):
    """--idle-timeout: a connection that sends nothing, or a stream whose next chunk does not come, gets an error
    event and is closed; the stream's job is cancelled and its slot is free again."""
    gate = h.new_gate()

    async def run(port, state):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            events = await _events_until_closed(reader)
        finally:
            writer.close()
        assert [e.type for e in events] == ["error"] and Error.from_event(events[0]).code == "timeout", events
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await async_write_event(SynthesizeStart(voice=SynthesizeVoice("gate")).event(), writer)
            await async_write_event(SynthesizeChunk("ab").event(), writer)  # then silence
            assert await asyncio.to_thread(gate.entered.acquire, True, 10), "the stream's job did not start"
            (job,) = state.jobs
            events = await _events_until_closed(reader)
        finally:
            writer.close()
        assert [e.type for e in events] == ["error"] and Error.from_event(events[0]).code == "timeout", events
        assert await asyncio.to_thread(job.cancelled.wait, 10), "the silent stream's job was not cancelled"
        gate.open.set()
        await asyncio.to_thread(_idle, state)

    with _serving(h, tmp_path, idle_timeout=1.0) as (port, state):
        asyncio.run(run(port, state))


def test_a_stream_dripping_text_ends_at_the_body_timeout(h, tmp_path):
    """Chunks sent a little at a time, each below the idle timeout, still end at --body-timeout from the first:
    an error event, the connection closed, the stream's job cancelled and its slot free again."""
    gate = h.new_gate()

    async def run(port, state):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await async_write_event(SynthesizeStart(voice=SynthesizeVoice("gate")).event(), writer)
            await async_write_event(SynthesizeChunk("ab").event(), writer)
            assert await asyncio.to_thread(gate.entered.acquire, True, 10), "the stream's job did not start"
            (job,) = state.jobs

            async def drip() -> None:
                for _ in range(100):
                    await asyncio.sleep(0.2)
                    await async_write_event(SynthesizeChunk(" a").event(), writer)
            dripping = asyncio.ensure_future(drip())
            events = await _events_until_closed(reader)
            dripping.cancel()
        finally:
            writer.close()
        assert [e.type for e in events] == ["error"] and "took longer" in Error.from_event(events[0]).text, events
        assert await asyncio.to_thread(job.cancelled.wait, 10), "the dripping stream's job was not cancelled"
        gate.open.set()
        await asyncio.to_thread(_idle, state)

    with _serving(h, tmp_path, idle_timeout=2.0, body_timeout=1.0) as (port, state):
        asyncio.run(run(port, state))


def test_a_client_that_reads_no_audio_is_dropped_and_frees_its_job(h, tmp_path):
    """A client that asks for minutes of audio and reads none of it: once the socket's buffers are full and it has
    taken nothing for --idle-timeout, the connection is dropped and the job cancelled, its slot free again."""
    async def run(port, state):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await async_write_event(Synthesize("a" * 4000, voice=SynthesizeVoice("wide")).event(), writer)
            end = time.monotonic() + 30
            while not state.jobs and time.monotonic() < end:  # the job starts, then stalls on the full socket
                await asyncio.sleep(0.02)
            assert state.jobs, "the job did not start"
            await asyncio.to_thread(_idle, state, 30)
        finally:
            writer.close()

    with _serving(h, tmp_path, idle_timeout=1.0) as (port, state):
        asyncio.run(run(port, state))


def test_a_stream_takes_its_job_slot_only_once_it_has_text(slow_server):
    """With one slot: a client that sent synthesize-start and nothing more does not keep another from being served;
    its text, when it comes, is spoken; a stream stopped without text is an error."""
    port, state = slow_server

    async def audio(client: AsyncTcpClient) -> list[str]:
        types: list[str] = []
        while not types or types[-1] not in ("audio-stop", "error"):
            types.append((await client.read_event()).type)
        return types

    async def run():
        async with _client(port) as a, _client(port) as b:
            await a.write_event(SynthesizeStart(voice=SynthesizeVoice("slow")).event())
            await a.write_event(Describe().event())  # answered after the start was handled
            assert Info.is_type((await a.read_event()).type)
            assert not state.jobs and not state.limiter.active, "a stream without text holds a job slot"
            await b.write_event(Synthesize("ab", voice=SynthesizeVoice("slow")).event())
            assert (await audio(b))[0] == "audio-start"
            await asyncio.to_thread(_idle, state)
            await a.write_event(SynthesizeChunk("ab").event())
            await a.write_event(SynthesizeStop().event())
            assert (await audio(a))[0] == "audio-start"
            assert SynthesizeStopped.is_type((await a.read_event()).type)
            await a.write_event(SynthesizeStart(voice=SynthesizeVoice("slow")).event())
            await a.write_event(SynthesizeStop().event())
            event = await a.read_event()
            assert Error.is_type(event.type) and "no text" in Error.from_event(event).text, event
    asyncio.run(run())


def test_start_tunes_malloc_as_the_http_server_does(h, tmp_path, monkeypatch):
    """Serving Wyoming applies ServerConfig's malloc tuning (else resident memory stays up after bursts)."""
    import mizuoto.server.wyoming as wyoming

    calls = []
    monkeypatch.setattr(wyoming, "tune_malloc", lambda *args: calls.append(args) or True)
    with _serving(h, tmp_path, mmap_threshold=3 << 20, malloc_arenas=3):
        assert calls == [(3 << 20, 3)]
