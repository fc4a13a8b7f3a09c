"""Qwen3-TTS (the mizuoto-qwen3tts plugin's fixture models, found by the engine's detect) served by every transport.

One server hosts the Base, CustomVoice and VoiceDesign directories under their kinds' names. Each
model's modes (a preset with and without an instruction, VoiceDesign's instruction, a clone of a
reference clip with its transcript, one without) are asked over HTTP (a whole WAV, chunked PCM and
SSE), the voice routes (an uploaded and a cached voice), the WebSocket, Wyoming and Ray Serve, each
seeded and with the engine option `language`; every answer is PCM16 (or WAV) of the same request run
through `Runtime.synthesize` in this process, sample for sample (a seeded Qwen3-TTS request is
deterministic). A language outside the model's choices is refused in each transport's error shape.
The web page lists the three models with their modes, presets and options.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from websockets.sync.client import connect
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.server.audio import decode_reference, pcm16
from mizuoto.server.launch import free_port
from mizuoto.server.state import ServerConfig, ServerState, StoredVoice
from mizuoto.server.wyoming import WyomingServer
from mizuoto.server.wyoming_service import WyomingService

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "qwen3tts"
TEXT = "Hello there, this is a short test."
INSTRUCT = "Speak slowly, in a calm and deep voice."
SEED = 11
OPTIONS = {"language": "english"}
BAD = {"language": "klingon"}
WAIT = 120.0  # seconds for any one answer: the fixture models run on a few busy cores


def _qwen_dirs() -> dict[str, Path]:
    """The plugins' fixture model dirs the qwen3tts engine detects, by the kind detect names."""
    found = {}
    with Runtime() as rt:
        for d in sorted((ROOT / "plugins").glob("*/tests/fixtures/models/*")):
            found.update({kind: d for engine, kind in rt.detect(d) if engine == ENGINE})
    assert set(found) == {"base", "custom_voice", "voice_design"}, found
    return found


@pytest.fixture(scope="module")
def dirs() -> dict[str, Path]:
    return _qwen_dirs()


@pytest.fixture(scope="module")
def direct(dirs, h):
    """(cases: label -> a mode's speech fields, expected(label, stream, options) -> (PCM16, chunks), the clip)."""
    clip_b64 = h.clip_base64()
    clip = decode_reference(base64.b64decode(clip_b64), "ref_audio")  # as the server decodes it
    rt = Runtime()
    cases: dict[str, dict] = {}
    for name, d in dirs.items():
        rt.load(d, name=name)
        modes = rt.model(name).capabilities.modes
        presets = [v.id for v in rt.voices(name) if v.kind == "preset"]
        if "preset" in modes:
            cases[f"{name}/preset"] = {"model": name, "voice": presets[-1]}
        if "instruct" in modes:
            cases[f"{name}/instruct"] = {"model": name, "voice": presets[0], "instructions": INSTRUCT}
        if "clone" in modes:
            cases[f"{name}/clone"] = {"model": name, "ref_audio": clip_b64, "ref_text": h.ref_text}
        if "cross_lingual" in modes:
            cases[f"{name}/cross_lingual"] = {"model": name, "ref_audio": clip_b64}
    cache: dict = {}

    def expected(label: str, stream: bool, options: dict = OPTIONS) -> tuple[bytes, int]:
        key = (label, stream, tuple(sorted(options.items())))
        if key not in cache:
            case = cases[label]
            voice = Reference(clip, case.get("ref_text")) if "ref_audio" in case else case["voice"]
            request = SynthesisRequest(text=TEXT, voice=voice, instruct=case.get("instructions"), stream=stream,
                                       seed=SEED, options=dict(options))
            chunks = list(rt.synthesize(case["model"], request))
            cache[key] = b"".join(pcm16(c.samples) for c in chunks), len(chunks)
        return cache[key]

    yield cases, expected, clip
    rt.close()


def test_the_cases_cover_every_mode_of_every_model(direct):
    """Each model is asked in each of its modes, and the engine option changes the audio (so it is checked)."""
    cases, expected, _ = direct
    assert set(cases) == {"base/clone", "base/cross_lingual", "custom_voice/preset", "custom_voice/instruct",
                          "voice_design/instruct"}
    for label in cases:
        audio, _ = expected(label, False)
        assert audio and audio != expected(label, False, {})[0], f"{label}: the language option changed nothing"


@pytest.fixture(scope="module")
def served(dirs, h):
    s = h.start_server(dict(dirs), ServerConfig(max_concurrent=4, request_timeout=WAIT))
    yield s
    s.stop()


@pytest.fixture
def client(served, h):
    with httpx.Client(base_url=served.url, timeout=WAIT, headers=h.admin) as c:
        yield c


def _body(case: dict, **more) -> dict:
    return {**case, "input": TEXT, "seed": SEED, "options": OPTIONS, **more}


def test_http_speech_every_mode_whole_chunked_and_sse(client, direct):
    """/v1/audio/speech: a whole WAV equals the engine's whole audio; chunked PCM and SSE its streamed audio."""
    cases, expected, _ = direct
    for label, case in cases.items():
        whole, _ = expected(label, False)
        streamed, chunks = expected(label, True)
        r = client.post("/v1/audio/speech", json=_body(case, response_format="wav"))
        assert r.status_code == 200, (label, r.text)
        assert r.headers["x-sample-rate"] == "24000" and r.content[:4] == b"RIFF", label
        assert r.content[44:] == whole, f"{label}: the WAV differs from Runtime.synthesize"
        with client.stream("POST", "/v1/audio/speech",
                           json=_body(case, response_format="pcm", stream_format="audio")) as r:
            assert r.status_code == 200, label
            assert b"".join(r.iter_raw()) == streamed, f"{label}: the chunked PCM differs"
        with client.stream("POST", "/v1/audio/speech",
                           json=_body(case, response_format="pcm", stream_format="sse")) as r:
            assert r.status_code == 200, label
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert events[-1]["type"] == "speech.audio.done" and len(deltas) == chunks == len(events) - 1, label
        assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == streamed, f"{label}: the SSE audio differs"


def test_http_bad_option_is_a_400_naming_the_choices(client, direct):
    """A language outside the model's choices: 400 on `options`, the message listing every choice."""
    cases, _, _ = direct
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    for label, case in cases.items():
        choices = next(o["enum"] for o in listed[case["model"]]["options"] if o["name"] == "language")
        assert "english" in choices, choices
        r = client.post("/v1/audio/speech", json=_body(case, options=BAD))
        assert r.status_code == 400, (label, r.text)
        error = r.json()["error"]
        assert error["param"] == "options" and "klingon" in error["message"], (label, error)
        assert all(c in error["message"] for c in choices), (label, error)


def test_http_uploaded_and_cached_voices_clone(client, direct):
    """A clip uploaded as JSON with its transcript, and one cached on Base by a form without, speak as the clip."""
    cases, expected, _ = direct
    base = next(c["model"] for label, c in cases.items() if label.endswith("/clone"))
    clip = base64.b64decode(cases[f"{base}/clone"]["ref_audio"])
    up = client.post("/v1/audio/voices", json={"id": "qwen-up", "audio": base64.b64encode(clip).decode(),
                                                "text": cases[f"{base}/clone"]["ref_text"]})
    kept = client.post("/v1/audio/voices", data={"id": "qwen-kept", "model": base},
                       files={"file": ("clip.wav", clip, "audio/wav")})
    try:
        assert up.status_code == 201 and kept.status_code == 201, (up.text, kept.text)
        assert kept.json()["kind"] == "cached"
        for voice, label in (("qwen-up", f"{base}/clone"), ("qwen-kept", f"{base}/cross_lingual")):
            r = client.post("/v1/audio/speech", json=_body({"model": base, "voice": voice}, response_format="pcm"))
            assert r.status_code == 200, (voice, r.text)
            assert r.content == expected(label, False)[0], f"voice {voice} differs from {label}"
    finally:
        client.delete("/v1/audio/voices/qwen-up")
        client.delete(f"/v1/audio/voices/qwen-kept?model={base}")


def test_a_clip_on_a_model_that_cannot_clone_is_a_400_on_ref_audio(client, direct):
    """A clip sent to a model whose modes speak none (instruct on presets only) is refused before any work."""
    cases, _, _ = direct
    clip = next(c["ref_audio"] for c in cases.values() if "ref_audio" in c)
    for label, case in cases.items():
        if "instructions" not in case:
            continue
        r = client.post("/v1/audio/speech", json=_body({k: v for k, v in case.items() if k != "voice"},
                                                       ref_audio=clip))
        assert r.status_code == 400, (label, r.text)
        error = r.json()["error"]
        assert error["param"] == "ref_audio" and "does not support mode 'clone'" in error["message"], error


def _ws_session(url: str, start: dict) -> tuple[dict, list[bytes], dict]:
    """(session.created or the error, audio frames, the last message) of one WebSocket session."""
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.start", **start}))
        created = json.loads(ws.recv(timeout=WAIT))
        if created["type"] == "error":
            return created, [], created
        ws.send(json.dumps({"type": "input_text.append", "text": TEXT}))
        ws.send(json.dumps({"type": "input_text.done"}))
        frames = []
        while isinstance(msg := ws.recv(timeout=WAIT), bytes):
            frames.append(msg)
        return created, frames, json.loads(msg)


def test_websocket_every_mode_and_a_bad_option(served, direct):
    """Each mode's session streams the engine's audio frame for chunk; a bad language is an error, then close 1008."""
    cases, expected, _ = direct
    for label, case in cases.items():
        created, frames, done = _ws_session(served.url, {**case, "seed": SEED, "options": OPTIONS})
        assert created["type"] == "session.created" and created["sample_rate"] == 24000, (label, created)
        assert done["type"] == "speech.audio.done", (label, done)
        audio, chunks = expected(label, True)
        assert len(frames) == done["chunks"] == chunks and b"".join(frames) == audio, f"{label}: audio differs"
    case = cases["custom_voice/preset"]
    with connect(served.url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.start", **case, "seed": SEED, "options": BAD}))
        assert json.loads(ws.recv(timeout=WAIT))["type"] == "session.created"
        ws.send(json.dumps({"type": "input_text.append", "text": TEXT}))
        ws.send(json.dumps({"type": "input_text.done"}))
        error = json.loads(ws.recv(timeout=WAIT))
        assert error["type"] == "error" and "klingon" in error["error"]["message"], error
        assert "english" in error["error"]["message"] and error["error"]["param"] == "options", error
        with pytest.raises(Exception) as closed:
            ws.recv(timeout=WAIT)
        assert getattr(closed.value, "rcvd", None) is not None and closed.value.rcvd.code == 1008, closed.value


# ---- Wyoming -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _wyoming(service: WyomingService):
    """The service served on 127.0.0.1 from an event loop in a background thread; yields its port."""
    port = free_port()
    server = WyomingServer(service, f"tcp://127.0.0.1:{port}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="wyoming-qwen", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(WAIT)
        yield port
    finally:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(5), loop).result(30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


async def _wy_describe(port: int) -> Info:
    async with AsyncTcpClient("127.0.0.1", port, connect_timeout=5, read_timeout=WAIT) as c:
        await c.write_event(Describe().event())
        event = await c.read_event()
        assert event is not None and Info.is_type(event.type), event
        return Info.from_event(event)


async def _wy_speak(port: int, voice: str | SynthesizeVoice) -> tuple[bytes, Error | None]:
    """(PCM16 of the audio-chunk events, the error event if one came instead) of one synthesize."""
    voice = SynthesizeVoice(name=voice) if isinstance(voice, str) else voice
    async with AsyncTcpClient("127.0.0.1", port, connect_timeout=5, read_timeout=WAIT) as c:
        await c.write_event(Synthesize(text=TEXT, voice=voice).event())
        audio = b""
        while True:
            event = await c.read_event()
            assert event is not None, "the server closed the connection"
            if Error.is_type(event.type):
                return audio, Error.from_event(event)
            if AudioChunk.is_type(event.type):
                chunk = AudioChunk.from_event(event)
                assert chunk.rate == 24000 and chunk.width == 2 and chunk.channels == 1
                audio += chunk.audio
            elif AudioStop.is_type(event.type):
                return audio, None
            else:
                assert AudioStart.is_type(event.type), event.type


def test_wyoming_every_voice_it_offers_speaks_and_a_bad_option_is_an_error(dirs, direct, h):
    """Every voice describe offers speaks the engine's audio, and only those that can; a bad --param is an error."""
    # seed and options as --seed and --param give them, the clips as --voice registers them; a request carries no
    # instruction, so VoiceDesign offers nothing, and CustomVoice (instruct on presets only) no clip
    cases, expected, clip = direct
    state = ServerState(h.make_runtime(), ServerConfig(request_timeout=WAIT), dict(dirs))
    ref_text = cases["base/clone"]["ref_text"]
    state.voices["ref"] = StoredVoice("ref", clip[0], clip[1], ref_text)
    state.voices["ref-x"] = StoredVoice("ref-x", clip[0], clip[1], None)
    with _wyoming(WyomingService(state, seed=SEED, params=tuple(f"{k}={v}" for k, v in OPTIONS.items()))) as port:
        info = [v for p in asyncio.run(_wy_describe(port)).tts for v in p.voices]
        offered = {v.name for v in info}
        presets = [v.id for v in state.runtime.voices("custom_voice")]
        assert offered == {f"custom_voice/{p}" for p in presets} | {"base/ref", "base/ref-x"}, offered
        # languages as codes, as Home Assistant matches them (its "en" against en, en_US)
        assert all("en" in v.languages and "zh" in v.languages for v in info), [v.languages for v in info]
        first = info[0].name
        speaks_en = asyncio.run(_wy_speak(port, SynthesizeVoice(language="en")))
        assert speaks_en == asyncio.run(_wy_speak(port, first)) and speaks_en[0], f"language en is not {first}"
        speaks = {"base/ref": "base/clone", "base/ref-x": "base/cross_lingual",
                  f"custom_voice/{cases['custom_voice/preset']['voice']}": "custom_voice/preset"}
        for voice, label in speaks.items():
            audio, error = asyncio.run(_wy_speak(port, voice))
            assert error is None, (voice, error)
            assert audio == expected(label, True)[0], f"{voice} differs from {label}"
        audio, error = asyncio.run(_wy_speak(port, "voice_design/design"))
        assert error is not None and "unknown voice" in error.text, error
    bad = ServerState(h.make_runtime(), ServerConfig(request_timeout=WAIT), {"custom_voice": dirs["custom_voice"]})
    with _wyoming(WyomingService(bad, seed=SEED, params=tuple(f"{k}={v}" for k, v in BAD.items()))) as port:
        audio, error = asyncio.run(_wy_speak(port, f"custom_voice/{cases['custom_voice/preset']['voice']}"))
        assert not audio and error is not None and error.code == "invalid_request", error
        assert "klingon" in error.text and "english" in error.text and "chinese" in error.text, error.text


# ---- the web page --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    """Headless Chromium from the system, as test_web.py drives it."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in ("/usr/bin/chromium", "/usr/bin/chromedriver"):
        assert shutil.which(path), f"{path} is missing: apt-get install -y chromium chromium-driver (make test does)"
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--autoplay-policy=no-user-gesture-required", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def test_web_page_lists_models_modes_presets_and_options(browser, served, client, dirs):
    """Each model's modes, voices, clone and instruction fields and option fields as listed; VoiceDesign speaks."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    # what the page shows of other engines (test_web.py), asserted of these: the listing's modes, voices and options
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    browser.get(served.url + "/")
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "status").text in ("ready", "no models"))
    assert browser.find_element(By.ID, "status").text == "ready", browser.find_element(By.ID, "error").text
    assert {o.get_attribute("value") for o in Select(browser.find_element(By.ID, "model")).options} == set(listed)
    for name, entry in listed.items():
        Select(browser.find_element(By.ID, "model")).select_by_value(name)
        WebDriverWait(browser, 60).until(
            lambda d: d.find_element(By.ID, "model-info").text.endswith("modes: " + ", ".join(entry["modes"])))
        voices = [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "voice")).options]
        assert voices == (entry["voices"] or [""]), (name, voices)
        clones = bool({"clone", "cross_lingual"} & set(entry["modes"]))
        assert browser.find_element(By.ID, "clone").is_displayed() == clones, name
        assert browser.find_element(By.ID, "instruct-row").is_displayed() == ("instruct" in entry["modes"]), name
        fields = {f.get_attribute("data-option"): f for f in browser.find_elements(By.CSS_SELECTOR,
                                                                                     "#options [data-option]")}
        assert list(fields) == [o["name"] for o in entry["options"]], name
        for o in entry["options"]:  # each field starts at the model's default
            field = fields[o["name"]]
            shown = field.is_selected() if o["type"] == "boolean" else field.get_attribute("value")
            assert shown == o["default"] if o["type"] in ("boolean", "string") else float(shown) == o["default"], o
        language = Select(fields["language"])
        assert [o.get_attribute("value") for o in language.options] == next(
            o["enum"] for o in entry["options"] if o["name"] == "language"), name
        assert "english" in [o.get_attribute("value") for o in language.options]
        assert "en" in entry["languages"], entry["languages"]  # the listing's languages are codes
    # the presets are every speaker of the model's config (upstream's get_supported_speakers)
    speakers = json.loads((dirs["custom_voice"] / "config.json").read_text())["talker_config"]["spk_id"]
    assert sorted(listed["custom_voice"]["voices"]) == sorted(k.lower() for k in speakers) and len(speakers) > 1
    Select(browser.find_element(By.ID, "model")).select_by_value("voice_design")
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "instruct-row").is_displayed())
    browser.find_element(By.ID, "instruct").send_keys(INSTRUCT)
    browser.find_element(By.ID, "seed").send_keys(str(SEED))
    box = browser.find_element(By.ID, "text")
    box.clear()
    box.send_keys(TEXT)
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "status").text in ("done", "failed"))
    assert browser.find_element(By.ID, "status").text == "done", browser.find_element(By.ID, "error").text
    stats = browser.execute_script("return window.mizuotoStats")
    assert stats["rate"] == 24000 and stats["seconds"] > 0, stats


# ---- Ray Serve -----------------------------------------------------------------------------------
RAY_START_SECONDS = 240


@pytest.fixture(scope="module")
def ray_url(dirs, tmp_path_factory):
    """`mizuoto ray-serve` over the three models (one replica holding all three), as test_ray_serve.py runs it."""
    tmp = tmp_path_factory.mktemp("ray-qwen")
    port = free_port()
    config = {"models": {k: str(v) for k, v in dirs.items()}, "replicas": 1, "models_per_replica": 3,
              "max_ongoing_requests": 2, "max_queued_requests": 8, "num_cpus": 2, "cluster_cpus": 2, "port": port,
              "options": {"device": "cpu"}}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    ready = tmp / "ready"
    plugin = str(dirs["base"].parents[3])  # the plugin's package root: this checkout's, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), plugin, os.environ.get("PYTHONPATH", "")]),
           "MIZUOTO_HOME": str(tmp / "home"), "RAY_USAGE_STATS_ENABLED": "0"}
    with open(tmp / "ray.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mizuoto.cli", "ray-serve", str(tmp / "config.yaml"),
                                 "--ready-file", str(ready)], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RAY_START_SECONDS
            while not ready.exists():
                assert proc.poll() is None, (tmp / "ray.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "Ray Serve did not start:\n" + (tmp / "ray.log").read_text()[-3000:]
                time.sleep(0.5)
            yield ready.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                raise
    assert code == 0, (tmp / "ray.log").read_text()[-3000:]


def test_ray_serve_every_mode_and_a_bad_option(ray_url, direct):
    """Through Ray's proxy each mode is the engine's audio, whole and streamed; a bad language is the 400."""
    cases, expected, _ = direct
    with httpx.Client(base_url=ray_url, timeout=WAIT) as c:
        for label, case in cases.items():
            r = c.post("/v1/audio/speech", json=_body(case, response_format="pcm"))
            assert r.status_code == 200, (label, r.text)
            assert r.content == expected(label, False)[0], f"{label}: differs over Ray"
            with c.stream("POST", "/v1/audio/speech",
                          json=_body(case, response_format="pcm", stream_format="audio")) as s:
                assert s.status_code == 200, label
                assert b"".join(s.iter_raw()) == expected(label, True)[0], f"{label}: the stream differs over Ray"
        r = c.post("/v1/audio/speech", json=_body(cases["custom_voice/preset"], options=BAD))
        assert r.status_code == 400 and r.json()["error"]["param"] == "options", r.text
        assert "klingon" in r.json()["error"]["message"] and "english" in r.json()["error"]["message"], r.text
