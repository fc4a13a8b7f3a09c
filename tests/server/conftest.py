"""Real servers on 127.0.0.1 (a random free port) over real Runtimes, and engines that misbehave on purpose."""

from __future__ import annotations

import dataclasses
import gc
import os
import io
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile

from mizuoto.runtime.api import Runtime
from mizuoto.server.app import create_app
from mizuoto.server.launch import ServerThread
from mizuoto.server.state import ServerConfig
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.fixtures import fixtures_root
from mizuoto.testing.toy import CONFIG, ToneEngine, ToneModel, write_model

# A transcript for the fixture clip: the clips are synthetic, and the random-weight models read any text.
REF_TEXT = "This is the reference speaker."


class SlowToneModel(ToneModel):
    """A tone model that takes `delay` s per 4 notes, and fails as told by the text: 'OOM' or 'CRASH'."""

    delay = 0.0

    def synthesize(self, request):
        text = request.text if isinstance(request.text, str) else ""
        if "OOM" in text:
            raise MemoryError("cannot allocate 64 GiB for the decoder")
        if "CRASH" in text:
            raise RuntimeError("engine bug")
        from mizuoto.testing.toy import CHUNK_NOTES, NOTE_SECONDS

        per_chunk = CHUNK_NOTES * int(NOTE_SECONDS * self.rate / request.speed)
        for chunk in super().synthesize(request):
            time.sleep(self.delay * chunk.samples.numel() / per_chunk)
            yield chunk


def tone_engine(kind: str, model_cls: type, description: str) -> type:
    """A tone engine for model dirs whose config says engine `kind`, loading `model_cls` (`delay` from the config)."""
    class KindToneEngine(ToneEngine):
        def detect(self, model_dir: Path) -> bool:
            try:
                return json.loads((Path(model_dir) / CONFIG).read_text()).get("engine") == kind
            except (OSError, ValueError):
                return False

        def load(self, model_dir: Path, options) -> ToneModel:
            base = super().load(model_dir, options)
            model = model_cls(base.config, base._m)
            if hasattr(model, "delay"):
                model.delay = float(base.config.get("delay", 0.0))
            return model
    KindToneEngine.name, KindToneEngine.description = kind, description
    return KindToneEngine


def write_tone_model(path: Path, kind: str, hidden: int = 16, **config) -> Path:
    """A tone model directory whose config names engine `kind` (and any more settings, e.g. delay)."""
    write_model(path, hidden=hidden)
    data = json.loads((path / CONFIG).read_text())
    data.update(engine=kind, **config)
    (path / CONFIG).write_text(json.dumps(data))
    return path


SlowToneEngine = tone_engine("slow", SlowToneModel, "tone engine that takes its time (server tests)")


class Gate:
    """Holds the requests of 'gate' models until `open` is set; `entered` counts, and `texts` lists, those let in."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)
        self.texts: list[str] = []


class GateToneModel(ToneModel):
    """A tone model whose requests wait for the current Gate (one is made per test with new_gate)."""

    gate = Gate()

    def synthesize(self, request):
        gate = GateToneModel.gate
        gate.texts.append(request.text)
        gate.entered.release()
        assert gate.open.wait(30), "the test never opened the gate"
        yield from super().synthesize(request)


GateToneEngine = tone_engine("gate", GateToneModel, "tone engine whose requests wait for a test's event (server tests)")


def new_gate() -> Gate:
    """A closed gate for the 'gate' models from now on."""
    GateToneModel.gate = Gate()
    return GateToneModel.gate


def write_gate_model(path: Path) -> Path:
    """A 'gate' model directory."""
    return write_tone_model(path, "gate")


def write_slow_model(path: Path, delay: float, hidden: int = 16) -> Path:
    """A 'slow' model directory."""
    return write_tone_model(path, "slow", hidden, delay=delay)


def make_runtime(**budgets) -> Runtime:
    """A Runtime with the installed plugins, plus the tone engines (whether or not the toy plugin is installed)."""
    rt = Runtime(**budgets)
    if "tone" not in rt.registry.names():
        rt.registry.add(ToneEngine)
    rt.registry.add(SlowToneEngine)
    rt.registry.add(GateToneEngine)
    return rt


FRESH = "MIZUOTO_FRESH_PROCESS"


def in_fresh_process(tmp_path: Path, module: str, test: str) -> None:
    """Run `test` of the test file `module` in a pytest process of its own; fail with its output unless it passes.

    Resident memory of a long suite process carries every earlier test's allocator state (the
    training and full-pipeline tests grow the heap by GBs), and threads every earlier test left;
    memory and threads are measured in a fresh one.
    """
    import re
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "bt"),
            f"{module}::{test}"]
    done = subprocess.run(argv, env={**os.environ, FRESH: "1"}, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and re.search(r"^1 passed", done.stdout, re.M), done.stdout[-4000:] + done.stderr[-2000:]


def pytest_collection_modifyitems(config, items):
    """`fresh_process` tests run only in the fresh process their wrapper starts (deselected, not skipped, here)."""
    if os.environ.get(FRESH):
        return
    fresh = [i for i in items if i.get_closest_marker("fresh_process")]
    if fresh:
        config.hook.pytest_deselected(items=fresh)
        items[:] = [i for i in items if not i.get_closest_marker("fresh_process")]


# The admin key of every test server (unless a test configures its own): model and voice
# administration is off on a server started without one.
ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def start_server(models: dict, config: ServerConfig | None = None, **runtime) -> ServerThread:
    """A started server; stop it with .stop()."""
    config = config or ServerConfig()
    if config.admin_key is None:
        config = dataclasses.replace(config, admin_key=ADMIN_KEY)
    return ServerThread(create_app(make_runtime(**runtime), config, models)).start()


def cosyvoice2_fixture_dir() -> Path:
    """The fixture model dir whose yaml is cosyvoice2.yaml (found by walking the tree)."""
    found = [d for d in sorted((fixtures_root() / "cosyvoice").glob("*/model")) if (d / "cosyvoice2.yaml").is_file()]
    assert found, f"no CosyVoice 2 model dir under {fixtures_root() / 'cosyvoice'}"
    return found[0]


def fixture_clip_base64() -> str:
    """A fixture reference clip as base64 of its file: the shortest of at least 2 s (else the longest)."""
    import base64

    base = fixtures_root() / "frontend"
    clips = json.loads((base / "manifest.json").read_text())["clips"].values()
    by_length = sorted(clips, key=lambda c: c["num_samples"] / c["sample_rate"])
    pick = next((c for c in by_length if c["num_samples"] >= 2 * c["sample_rate"]), by_length[-1])
    return base64.b64encode((base / pick["wav"]).read_bytes()).decode()


@pytest.fixture(scope="session")
def served_dirs(tmp_path_factory) -> dict:
    """The shared server's models: a tone model, a slow tone model, piper's default voice, a fixture CosyVoice 2."""
    import mizuoto_piper

    root = tmp_path_factory.mktemp("served")
    return {"tone": write_model(root / "tone"), "slow": write_slow_model(root / "slow", 0.02),
            "piper": mizuoto_piper.default_voice_dir(),
            "cosy": assemble_model_dir(cosyvoice2_fixture_dir(), root / "cosy")}


@pytest.fixture(scope="session")
def cosy_expected(served_dirs):
    """PCM16 bytes the CosyVoice engine itself gives, in this process, for a clone of the fixture clip.

    Called as expected(text, seed, stream); text is a string, or a tuple of pieces streamed in.
    Seeded CosyVoice requests are deterministic, so a server response must equal this byte for
    byte, whatever else runs beside it.
    """
    import base64

    from mizuoto.runtime.engine import Reference, SynthesisRequest
    from mizuoto.server.audio import decode_reference, pcm16

    samples, rate = decode_reference(base64.b64decode(fixture_clip_base64()), "ref_audio")
    rt = Runtime()
    name = rt.load(served_dirs["cosy"], name="cosy-direct")
    cache: dict = {}

    def expected(text: str | tuple, seed: int, stream: bool = False) -> bytes:
        if (text, seed, stream) not in cache:
            request = SynthesisRequest(text=text if isinstance(text, str) else iter(text),
                                       voice=Reference((samples, rate), REF_TEXT), stream=stream, seed=seed)
            cache[text, seed, stream] = b"".join(pcm16(c.samples) for c in rt.synthesize(name, request))
        return cache[text, seed, stream]

    yield expected
    rt.close()


@pytest.fixture(scope="session")
def server(served_dirs):
    """One server for the tests that do not change its models: max 8 concurrent, 60 s deadline."""
    s = start_server(served_dirs, ServerConfig(max_concurrent=8, request_timeout=60.0))
    yield s
    s.stop()


@pytest.fixture
def client(server):
    """An HTTP client of the shared server."""
    with httpx.Client(base_url=server.url, timeout=60.0, headers=ADMIN) as c:
        yield c


def read_audio(body: bytes) -> tuple[np.ndarray, int]:
    """Samples and rate of an encoded response body."""
    audio, rate = soundfile.read(io.BytesIO(body), dtype="float32")
    return audio, rate


def wav_base64(seconds: float = 2.0, rate: int = 16000, freq: float = 180.0) -> str:
    """A voiced-sounding reference clip as base64 WAV."""
    import base64

    t = np.arange(int(seconds * rate)) / rate
    wave = sum(np.sin(2 * np.pi * k * freq * t) / k for k in range(1, 5)) * 0.2
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def tone_seconds(text: str, speed: float = 1.0, rate: int = 16000) -> float:
    """The exact duration the tone engine gives `text`."""
    from mizuoto.testing.toy import NOTE_SECONDS

    return sum(not c.isspace() for c in text) * int(NOTE_SECONDS * rate / speed) / rate


def job_threads() -> int:
    """Worker threads alive now."""
    return sum(t.name == "mizuoto-job" for t in threading.enumerate())


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> None:
    """Wait until no job runs (workers notice cancellation at their next chunk) and no compute loop has work
    (a cancelled request's started call runs to its end, its working memory live until then)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = client.get("/metrics").text
        pending = [line for line in text.splitlines() if line.startswith("mizuoto_compute_pending{")]
        if "mizuoto_requests_in_flight 0" in text and job_threads() == 0 \
                and all(float(line.rsplit(" ", 1)[1]) == 0 for line in pending):
            return
        time.sleep(0.05)
    raise AssertionError(f"jobs still running after {timeout} s: {job_threads()} worker threads")


def until(check, what: str, timeout: float = 30.0) -> None:
    """Wait until check() is true, or fail naming `what`."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def resident_bytes() -> int:
    """Resident memory of this process after glibc returns its freed pages (so allocator caching is not growth)."""
    import ctypes
    import ctypes.util

    import psutil

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    return psutil.Process().memory_info().rss


def planned_memory(client: httpx.Client) -> dict:
    """mizuoto_memory_planned_bytes per model from /metrics."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("mizuoto_memory_planned_bytes{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = int(float(value))  # written as a float ('3.08e+06')
    return out


def health_during(url: str, attack, limit: float = 120.0, wait: float = 30.0) -> tuple[list[float], object]:
    """(the seconds each GET /health took, what attack() returned), asked one after another while attack() runs
    in a thread, and once after it ended; a /health still unanswered after `wait` s counts as `wait`."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = attack()
        except BaseException as e:  # re-raised in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="attack", daemon=True)
    seconds: list[float] = []
    with httpx.Client(base_url=url, timeout=wait) as probe:
        def ask() -> None:
            start = time.monotonic()
            try:
                assert probe.get("/health").status_code == 200
            except httpx.TimeoutException:
                pass
            seconds.append(time.monotonic() - start)

        ask()  # a kept-alive connection before the attack begins
        thread.start()
        end = time.monotonic() + limit
        while thread.is_alive() and time.monotonic() < end:
            ask()
            thread.join(0.02)
        assert not thread.is_alive(), f"the attack still ran after {limit} s"
        ask()
    if "error" in box:
        raise box["error"]
    return seconds, box.get("value")


def p99(seconds: list[float]) -> float:
    """The 99th percentile (nearest rank) of `seconds`."""
    ranked = sorted(seconds)
    return ranked[max(0, -(-99 * len(ranked) // 100) - 1)]


# Every error message a test server sends, with the model directories of every server (finding 6 of issue 50:
# an error never shows where a model lies); checked once the session's tests are done.
_SENT_ERRORS: list[str] = []
_SERVED_DIRS: set[str] = set()


@pytest.fixture(scope="session", autouse=True)
def errors_show_no_server_paths():
    """Records each error body a server sends and the served directories; at the end no message may name one."""
    from mizuoto.server import errors, state

    body, init = errors.ApiError.body, state.ServerState.__init__

    def recording_body(self, *hide):
        out = body(self, *hide)
        _SENT_ERRORS.append(out["error"]["message"])
        return out

    def recording_init(self, runtime, config, models=None):
        init(self, runtime, config, models)
        for d in (models or {}).values():
            _SERVED_DIRS.update({str(Path(d)), str(Path(d).resolve())})

    errors.ApiError.body, state.ServerState.__init__ = recording_body, recording_init
    yield
    errors.ApiError.body, state.ServerState.__init__ = body, init
    leaks = [(m[:300], d) for m in _SENT_ERRORS for d in _SERVED_DIRS if d in m]
    assert not leaks, f"error messages name a served model directory: {leaks[:5]}"


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """The helpers above, for test modules (conftest is not importable under --import-mode=importlib)."""
    return SimpleNamespace(admin=ADMIN, read_audio=read_audio, wav_base64=wav_base64, tone_seconds=tone_seconds,
                           clip_base64=fixture_clip_base64, ref_text=REF_TEXT,
                           job_threads=job_threads, wait_idle=wait_idle, until=until, resident_bytes=resident_bytes,
                           planned_memory=planned_memory, in_fresh_process=in_fresh_process,
                           cosyvoice2_dir=cosyvoice2_fixture_dir,
                           start_server=start_server, make_runtime=make_runtime, write_slow_model=write_slow_model,
                           write_model=write_model, write_gate_model=write_gate_model, new_gate=new_gate,
                           tone_engine=tone_engine, write_tone_model=write_tone_model, health_during=health_during,
                           p99=p99)
