"""The Wyoming server's jobs, in this process: the concurrency limit is an error event, a client that leaves frees its job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.tts import Synthesize, SynthesizeVoice

from mizuoto.server.launch import free_port
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.server.wyoming import WyomingServer, WyomingService


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


@pytest.fixture
def slow_server(h, tmp_path):
    """One 'slow' tone model (0.2 s per chunk of 4 notes), at most one job at a time and none queued."""
    port = free_port()
    state = ServerState(h.make_runtime(), ServerConfig(max_concurrent=1, max_queued=0, request_timeout=30),
                        {"slow": h.write_slow_model(tmp_path / "slow", 0.2)})
    with WyomingThread(WyomingServer(WyomingService(state), f"tcp://127.0.0.1:{port}")):
        yield port, state
    assert not state.runtime.models(), "stopping the server frees its models"


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
