"""`mizuoto wyoming` as a process, driven by the `wyoming` package's own async client on 127.0.0.1.

One server serves Piper's default voice and the CosyVoice 2 fixture (as "cosy", cloning the
fixture clip registered with --voice, seeded by --seed so its audio can be compared byte for byte
with what the engine gives in this process).
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from mizuoto.server.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
# the checkout's own plugins come first, as its mizuoto/ does (an installed copy may be of another version)
PLUGINS = [str(p.parent) for p in sorted(ROOT.glob("plugins/*/pyproject.toml"))]
SEED = 5
READ_TIMEOUT = 120.0  # seconds for any one event: the fixture CosyVoice runs on a few busy cores


class Served:
    """The running server: its port and log."""

    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log

    def client(self) -> AsyncTcpClient:
        return AsyncTcpClient("127.0.0.1", self.port, connect_timeout=5, read_timeout=READ_TIMEOUT)


async def _describe(port: int) -> Info:
    async with AsyncTcpClient("127.0.0.1", port, connect_timeout=2, read_timeout=10) as c:
        await c.write_event(Describe().event())
        event = await c.read_event()
        assert event is not None and Info.is_type(event.type), event
        return Info.from_event(event)


@pytest.fixture(scope="module")
def wyoming_server(served_dirs, h, tmp_path_factory):
    """`mizuoto wyoming` in a subprocess (models from MIZUOTO_MODELS, the rest as flags); stopped by SIGTERM."""
    import base64

    tmp = tmp_path_factory.mktemp("wyoming")
    clip = tmp / "ref.wav"
    clip.write_bytes(base64.b64decode(h.clip_base64()))
    (tmp / "ref.txt").write_text(h.ref_text + "\n")
    port, log = free_port(), tmp / "server.log"
    env = {**os.environ, "MIZUOTO_MODELS": f"piper={served_dirs['piper']}{os.pathsep}cosy={served_dirs['cosy']}",
           "MIZUOTO_DEVICE": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), *PLUGINS, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mizuoto.cli", "wyoming", "--uri", f"tcp://127.0.0.1:{port}",
           "--voice", f"ref={clip}", "--seed", str(SEED), "--max-input-chars", "500",
           "--idle-timeout", str(READ_TIMEOUT)]  # a stream test waits for audio before its last chunk
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 180
        while True:  # the port opens once the models are loaded
            assert proc.poll() is None, f"server exited: {log.read_text()}"
            try:
                asyncio.run(_describe(port))
                break
            except (OSError, asyncio.TimeoutError):
                assert time.monotonic() < end, f"server did not come up: {log.read_text()}"
                time.sleep(0.2)
        yield Served(port, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _audio(client: AsyncTcpClient) -> tuple[AudioStart, bytes]:
    """Read audio-start, audio-chunks and audio-stop; an error event fails the test with its text."""
    start, pcm = None, b""
    while True:
        event = await client.read_event()
        assert event is not None, "the server closed the connection"
        assert not Error.is_type(event.type), Error.from_event(event).text
        if AudioStart.is_type(event.type):
            assert start is None, "two audio-start events"
            start = AudioStart.from_event(event)
        elif AudioChunk.is_type(event.type):
            assert start is not None, "audio-chunk before audio-start"
            chunk = AudioChunk.from_event(event)
            assert (chunk.rate, chunk.width, chunk.channels) == (start.rate, 2, 1)
            pcm += chunk.audio
        elif AudioStop.is_type(event.type):
            assert start is not None
            return start, pcm
        else:
            raise AssertionError(f"unexpected {event.type} event")


async def _error(client: AsyncTcpClient) -> str:
    event = await client.read_event()
    assert event is not None and Error.is_type(event.type), event
    return Error.from_event(event).text


def _rms(pcm: bytes) -> float:
    samples = np.frombuffer(pcm, dtype="<i2") / 32768.0
    return float(np.sqrt(np.mean(samples ** 2))) if samples.size else 0.0


def _voice_names(info: Info) -> list[str]:
    return [v.name for v in info.tts[0].voices]


def test_describe_lists_every_model_voice(wyoming_server):
    """info: one tts program that streams, with each model's voices, languages and engine."""
    info = asyncio.run(_describe(wyoming_server.port))
    (program,) = info.tts
    assert program.name == "mizuoto" and program.supports_synthesize_streaming is True
    voices = {v.name: v for v in program.voices}
    piper = [v for n, v in voices.items() if n.startswith("piper/")]
    assert len(piper) == 1 and piper[0].languages and "piper engine" in piper[0].description
    cosy = voices["cosy/ref"]  # CosyVoice 2 has no presets: it offers the clip registered with --voice
    assert "cosyvoice engine" in cosy.description and {"zh", "en"} <= set(cosy.languages)
    assert not any(n.startswith("piper/ref") for n in voices), "piper cannot clone, so it offers no clip voice"


def test_start_line_reads_as_the_docs_quote_it(wyoming_server):
    """Once it serves: `mizuoto wyoming: serving N voice(s) on URI: model/voice, ...`, the shape docs/wyoming.md quotes
    (the logger's prefix said once)."""
    shape = r"mizuoto wyoming: serving (\d+) voice\(s\) on (tcp://\S+): (.+)"
    quoted = re.search(rf"^# {shape}$", (ROOT / "docs" / "wyoming.md").read_text(), re.M)
    assert quoted is not None and int(quoted[1]) == len(quoted[3].split(", "))
    end = time.monotonic() + 10  # the line follows the listener's opening
    while not (found := re.search(rf"^{shape}$", wyoming_server.log.read_text(), re.M)):
        assert time.monotonic() < end, wyoming_server.log.read_text()
        time.sleep(0.1)
    assert found[2] == f"tcp://127.0.0.1:{wyoming_server.port}"
    # the served voices: these two, and any a model cached in the session's voice store before
    listed = found[3].split(", ")
    assert {"piper/joe", "cosy/ref"} <= set(listed) and int(found[1]) == len(listed)


def test_synthesize_piper_and_cosy(wyoming_server, cosy_expected):
    """synthesize gives audio-start, PCM16 chunks, audio-stop; CosyVoice's audio is the engine's own."""
    async def run():
        async with wyoming_server.client() as c:
            info = await _describe(wyoming_server.port)
            piper = next(n for n in _voice_names(info) if n.startswith("piper/"))
            await c.write_event(Synthesize("Hello from Home Assistant.", voice=SynthesizeVoice(piper)).event())
            start, pcm = await _audio(c)
            assert start.rate == 22050 and len(pcm) / 2 / start.rate > 0.5 and _rms(pcm) > 0.01
            await c.write_event(Synthesize("A cloned voice speaks.", voice=SynthesizeVoice("cosy/ref")).event())
            start, cloned = await _audio(c)
            assert start.rate == 24000 and cloned == cosy_expected("A cloned voice speaks.", SEED, stream=True)
            # a model name and a speaker, as Home Assistant's options give them, name the same voice
            await c.write_event(Synthesize("A cloned voice speaks.", voice=SynthesizeVoice("cosy", speaker="ref"))
                                .event())
            assert (await _audio(c))[1] == cloned
    asyncio.run(run())


async def _stream(client: AsyncTcpClient, voice: str, pieces: list[str], wait_before_last: bool):
    """Send a text stream; returns (audio-start, pcm, whether audio came before the last chunk was sent)."""
    events: asyncio.Queue = asyncio.Queue()

    async def read():
        while (event := await client.read_event()) is not None:
            await events.put(event)
            if SynthesizeStopped.is_type(event.type) or Error.is_type(event.type):
                return

    reader = asyncio.ensure_future(read())
    try:
        await client.write_event(SynthesizeStart(voice=SynthesizeVoice(voice)).event())
        for piece in pieces[:-1]:
            await client.write_event(SynthesizeChunk(piece).event())
        got: list = []
        if wait_before_last:  # the event we wait for is the first audio, while the text is not all sent
            while not any(AudioChunk.is_type(e.type) for e in got):
                got.append(await asyncio.wait_for(events.get(), READ_TIMEOUT))
                assert not Error.is_type(got[-1].type), Error.from_event(got[-1]).text
        early = any(AudioChunk.is_type(e.type) for e in got)
        await client.write_event(SynthesizeChunk(pieces[-1]).event())
        # clients repeat the whole text as a plain synthesize for servers that cannot stream: ignored
        await client.write_event(Synthesize("".join(pieces), voice=SynthesizeVoice(voice)).event())
        await client.write_event(SynthesizeStop().event())
        await asyncio.wait_for(reader, 3 * READ_TIMEOUT)
    finally:
        reader.cancel()
    while not events.empty():
        got.append(events.get_nowait())
    types = [e.type for e in got]
    assert "error" not in types, Error.from_event(got[types.index("error")]).text
    assert types[0] == "audio-start" and types[-2:] == ["audio-stop", "synthesize-stopped"], types
    assert types.count("audio-start") == 1 and set(types[1:-2]) == {"audio-chunk"}, types
    pcm = b"".join(AudioChunk.from_event(e).audio for e in got if AudioChunk.is_type(e.type))
    return AudioStart.from_event(got[0]), pcm, early


def test_streaming_piper_speaks_sentence_by_sentence(wyoming_server):
    """Piper speaks each sentence as soon as it is complete: audio arrives before the text ends."""
    async def run():
        async with wyoming_server.client() as c:
            piper = next(n for n in _voice_names(await _describe(wyoming_server.port)) if n.startswith("piper/"))
            # the engine holds one sentence back (its last chunk is marked final): three sentences show the flow
            pieces = ["The first sentence ", "is done. ", "The second one ", "is done too. ", "A third", " follows."]
            start, pcm, early = await _stream(c, piper, pieces, wait_before_last=True)
            assert early and start.rate == 22050 and _rms(pcm) > 0.01
            await c.write_event(Synthesize("".join(pieces), voice=SynthesizeVoice(piper)).event())
            whole = (await _audio(c))[1]
            assert len(pcm) == len(whole)  # the repeated plain synthesize inside the stream was not spoken
    asyncio.run(run())


def test_streaming_cosyvoice2_feeds_the_lm_as_text_arrives(wyoming_server, cosy_expected, h):
    """CosyVoice 2: the first audio arrives before the last text chunk is sent; the audio is the engine's own."""
    # The LM speaks only once the reference's speech tokens (25 a second) went in, 15 per 5 text
    # tokens: a longer clip needs more text before a first hop can come out early.
    seconds = soundfile.info(io.BytesIO(base64.b64decode(h.clip_base64()))).duration
    pieces = [w + " " for w in ("one two three four five six seven eight nine ten " * (2 + math.ceil(seconds))).split()]

    async def run():
        async with wyoming_server.client() as c:
            start, pcm, early = await _stream(c, "cosy/ref", pieces, wait_before_last=True)
            assert early and start.rate == 24000
            assert pcm == cosy_expected(tuple(pieces), SEED, stream=True)
    asyncio.run(run())


def test_errors_are_events_and_the_connection_stays_usable(wyoming_server):
    """Each bad request is answered by one error event; the next request on the same connection works."""
    async def run():
        async with wyoming_server.client() as c:
            await c.write_event(Synthesize("Hello.", voice=SynthesizeVoice("nobody")).event())
            assert "unknown voice 'nobody'" in await _error(c)
            await c.write_event(Synthesize("   ", voice=SynthesizeVoice("cosy/ref")).event())
            assert "empty" in await _error(c)
            await c.write_event(Synthesize("x" * 501).event())
            assert "limit is 500" in await _error(c)
            await c.write_event(SynthesizeChunk("no stream yet").event())
            assert "synthesize-start first" in await _error(c)
            # a stream whose start fails: one error, its chunks and stop are dropped silently
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(language="xx")).event())
            assert "language 'xx'" in await _error(c)
            await c.write_event(SynthesizeChunk("dropped").event())
            await c.write_event(SynthesizeStop().event())
            # a stream that goes over the limit mid-way
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice("cosy/ref")).event())
            await c.write_event(SynthesizeChunk("y" * 501).event())
            assert "limit is 500" in await _error(c)
            await c.write_event(SynthesizeStop().event())
            await c.write_event(Describe().event())
            event = await c.read_event()
            assert event is not None and Info.is_type(event.type), f"expected info, got {event}"
            await c.write_event(Synthesize("Still here.", voice=SynthesizeVoice(language="en")).event())
            start, pcm = await _audio(c)
            assert _rms(pcm) > 0.01
    asyncio.run(run())


def test_bad_flags_are_one_line_errors(served_dirs, tmp_path, capsys):
    """No model, a malformed --voice, a missing clip or an unknown URI scheme: exit 1 with the reason."""
    from mizuoto.cli.main import main

    piper = f"piper={served_dirs['piper']}"
    for argv, words in [([], "at least one model"),
                        (["-m", piper, "--voice", "noequals"], "use ID=CLIP"),
                        (["-m", piper, "--voice", f"v={tmp_path / 'none.wav'}"], "reference clip not found"),
                        (["-m", piper, "--uri", "http://127.0.0.1:1"], "--uri"),
                        (["-m", piper, "--max-concurrent", "0"], "--max-concurrent"),
                        (["-m", piper, "--idle-timeout", "0"], "--idle-timeout")]:
        assert main(["wyoming", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_needs_only_its_extra():
    """Without the wyoming package the command says which extra to install; it needs no HTTP stack."""
    import subprocess

    code = ("import sys; sys.modules['wyoming'] = None\n"
            "from mizuoto.cli.main import main\n"
            "sys.exit(main(['wyoming', '-m', '.']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "needs the wyoming extra: pip install 'mizuoto-runtime[wyoming]'" in r.stderr, r.stderr
    code = ("import sys; sys.modules['starlette'] = None; sys.modules['uvicorn'] = None\n"
            "import mizuoto.server.wyoming\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
