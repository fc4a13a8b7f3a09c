"""One Session per request, whatever the transport: its lease, made when the session opens, is the one its model's
load takes (the client leaving while the load waits cancels it at once) and the one its job runs under later.

Real servers on 127.0.0.1 (Wyoming on its own event loop in this process, WebSocket over uvicorn); the load is held
on an event and the 'gate' model holds its request until the test opens the gate: no sleeps decide anything.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import websockets.sync.client
from wyoming.client import AsyncTcpClient
from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from mizuoto.runtime.lease import Lease
from mizuoto.server.launch import free_port
from mizuoto.server.state import ServerConfig, ServerState
from mizuoto.server.wyoming import WyomingServer
from mizuoto.server.wyoming_service import WyomingService

CONFIG = ServerConfig(max_concurrent=1, max_queued=0, request_timeout=30.0)


class HeldLoads:
    """Stands in for `ServerState.load_for_session`: records each session's lease and holds the load until
    `release` is set (the lease's cancel ends the wait first, as a real load's waits end)."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, name: str, lease: Lease) -> None:
        self.leases.append(lease)
        self.entered.release()
        lease.wait(self.release, "while the test holds the load")


def _job_leases(state: ServerState) -> list[Lease]:
    return [job.lease for job in list(state.jobs)]


def _check_one_lease(state: ServerState, loads: HeldLoads, leave: Callable[[], None],
                     speak: Callable[[], list[Lease]], h) -> None:
    """A held load whose client `leave`s is cancelled within 1 s; a later session's job runs under the very lease
    its load took (`speak` runs that session and returns the leases of the jobs that ran while the gate held its
    job: a job leaves `state.jobs` once it ends)."""
    assert loads.entered.acquire(timeout=30), "the session's load never started"
    waiting = loads.leases[0]
    leave()
    assert waiting.event.wait(1.0), "the client left but its session's load went on waiting"
    assert waiting.reason == "because its client left"
    h.until(lambda: waiting.released, "the left session's lease to be released", 5.0)
    assert not state.jobs and state.limiter.active == 0, "a session that left before its text started no job"

    loads.release.set()  # loads pass from now on
    jobs = speak()
    assert len(loads.leases) == 2
    assert len(jobs) == 1 and jobs[0] is loads.leases[1], (jobs, loads.leases)


class _Loop:
    """An event loop in a background thread, for the Wyoming server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="session-test", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_wyoming_streams_load_and_job_take_its_one_lease(h, tmp_path, monkeypatch):
    """synthesize-start opens the session: its load, held, ends within 1 s of the client leaving."""
    gate, loads = h.new_gate(), HeldLoads()
    state = ServerState(h.make_runtime(), CONFIG, {"gate": h.write_gate_model(tmp_path / "gate")})
    monkeypatch.setattr(state, "load_for_session", loads)
    port, loop = free_port(), _Loop()
    server = WyomingServer(WyomingService(state), f"tcp://127.0.0.1:{port}")
    loop.run(server.start())
    voice = SynthesizeVoice("gate")

    async def connect() -> AsyncTcpClient:
        client = AsyncTcpClient("127.0.0.1", port, connect_timeout=5, read_timeout=30)
        await client.connect()
        return client

    async def first() -> AsyncTcpClient:
        client = await connect()
        await client.write_event(SynthesizeStart(voice=voice).event())
        return client

    async def speak() -> list[Lease]:
        client = await connect()
        await client.write_event(SynthesizeStart(voice=voice).event())
        await client.write_event(SynthesizeChunk("ab").event())
        assert await asyncio.to_thread(gate.entered.acquire, True, 30), "the stream's job never ran"
        jobs = _job_leases(state)  # read while the gate holds the job
        gate.open.set()
        await client.write_event(SynthesizeStop().event())
        while not SynthesizeStopped.is_type((await client.read_event()).type):
            pass
        await client.disconnect()
        return jobs

    try:
        a = loop.run(first())
        _check_one_lease(state, loads, lambda: loop.run(a.disconnect()), lambda: loop.run(speak()), h)
    finally:
        gate.open.set()
        loads.release.set()
        try:
            loop.run(server.stop(5), 30)
        finally:
            loop.close()


def test_a_websocket_sessions_load_and_job_take_its_one_lease(h, tmp_path):
    """session.start opens the session: its load, held, ends within 1 s of the client closing the socket."""
    gate, loads = h.new_gate(), HeldLoads()
    server = h.start_server({"gate": h.write_gate_model(tmp_path / "gate")}, CONFIG)
    state = server.server.state
    state.load_for_session = loads
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    start = json.dumps({"type": "session.start", "model": "gate", "voice": "low"})

    def speak() -> list[Lease]:
        with websockets.sync.client.connect(url, open_timeout=10, close_timeout=1) as ws:
            ws.send(start)
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
            ws.send(json.dumps({"type": "input_text.append", "text": "ab"}))
            assert gate.entered.acquire(timeout=30), "the session's job never ran"
            jobs = _job_leases(state)  # read while the gate holds the job
            gate.open.set()
            ws.send(json.dumps({"type": "input_text.done"}))
            while isinstance(message := ws.recv(timeout=30), bytes):
                pass
            assert json.loads(message)["type"] == "speech.audio.done"
            return jobs

    try:
        with websockets.sync.client.connect(url, open_timeout=10, close_timeout=1) as first:
            first.send(start)
            _check_one_lease(state, loads, first.close, speak, h)
    finally:
        gate.open.set()
        loads.release.set()
        server.stop()

