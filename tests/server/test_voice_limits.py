"""POST /v1/audio/voices against hostile clients: what a kept voice may cost, and one voice per id, however raced."""

from __future__ import annotations

import base64
import io
import json
import threading
import tracemalloc

import numpy as np
import pytest
import soundfile

from mizuoto.server import voices
from mizuoto.server.audio import MAX_VOICE_RATE, MAX_VOICE_SECONDS
from mizuoto.server.errors import ApiError
from mizuoto.server.state import ServerConfig, ServerState

WAIT = 30.0  # seconds any step may take before the test fails instead of hanging


@pytest.fixture
def make_state(tmp_path, h):
    """make_state(**config): a ServerState over a loaded tone model (which caches voices), voices stored in tmp."""
    runtimes = []

    def make(**config) -> ServerState:
        rt = h.make_runtime(voices=tmp_path / f"voices{len(runtimes)}")
        runtimes.append(rt)
        tone = h.write_model(tmp_path / f"tone{len(runtimes)}")
        rt.load(tone, name="tone")
        return ServerState(rt, ServerConfig(**config), {"tone": tone})

    yield make
    for rt in runtimes:
        rt.close()


def _flac(seconds: int, rate: int, channels: int, level: float) -> bytes:
    """A FLAC of a 220 Hz tone at `level` in the first channel (the others silent), written a second at a time."""
    block = np.zeros((rate, channels), np.float32)
    block[:, 0] = level * np.sin(2 * np.pi * 220 * np.arange(rate) / rate)
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds):
            f.write(block)
    return buf.getvalue()


def _register(state: ServerState, **body) -> dict:
    return voices.register(state, json.dumps(body).encode(), "application/json")


def _audio(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_long_high_rate_multichannel_flac_is_refused_from_its_header(make_state, monkeypatch):
    """60 s at 192 kHz in 8 channels (94 KB of FLAC, 368 MB decoded): a 400 naming the 30 s limit, no sample read."""
    state = make_state()
    hostile = _flac(60, 192000, 8, 0.0)
    assert len(hostile) < 200 << 10
    reads = []
    real_read = soundfile.SoundFile.read

    def read(self, *args, **kwargs):  # every sample decoded goes through here (soundfile.read, blocks)
        reads.append(args)
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(soundfile.SoundFile, "read", read)
    with pytest.raises(ApiError) as e:
        _register(state, id="bomb", audio=_audio(hostile))
    assert (e.value.status, e.value.param) == (400, "audio")
    assert f"between 0.5 and {MAX_VOICE_SECONDS:g} s" in e.value.message and "60.00 s" in e.value.message
    assert reads == []
    assert "bomb" not in state.voices and not state.creating


def test_kept_voice_is_mono_at_most_48khz(make_state):
    """The longest, widest upload allowed (30 s, 192 kHz, 8 channels) is kept as 30 s of mono float32 at 48 kHz,
    and decoding it never holds the 8 channels of the whole file."""
    state = make_state()
    data = _flac(int(MAX_VOICE_SECONDS), 192000, 8, 0.8)
    tracemalloc.start()  # numpy's buffers (what soundfile decodes into) are traced
    try:
        out = _register(state, id="wide", audio=_audio(data))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = state.voices["wide"]
    assert out["sample_rate"] == kept.rate == MAX_VOICE_RATE == 48000
    assert out["seconds"] == pytest.approx(MAX_VOICE_SECONDS)
    assert kept.samples.ndim == 1 and kept.samples.dtype.is_floating_point and kept.samples.element_size() == 4
    nbytes = kept.samples.numel() * kept.samples.element_size()
    assert nbytes <= MAX_VOICE_SECONDS * MAX_VOICE_RATE * 4  # 5.8 MB; it was 44 MB (mono at 192 kHz)
    # the body's JSON, base64 and bytes (2-3 MB each) and a decoded block, not 184 MB of 8-channel float32
    assert peak < 32 << 20, peak
    # the mixdown of one 0.8 tone among 8 channels: its level is 0.1, its pitch unchanged by the resampling
    middle = kept.samples[48000:96000].numpy()
    assert np.abs(middle).max() == pytest.approx(0.1, abs=2e-3)
    assert np.argmax(np.abs(np.fft.rfft(middle))) == 220


def test_kept_voice_below_48khz_keeps_its_rate_and_samples(make_state):
    """A 44.1 kHz stereo upload is kept at 44.1 kHz as the exact channel mean (engines resample it as if inline)."""
    state = make_state()
    stereo = np.stack([np.linspace(-0.5, 0.5, 44100), np.full(44100, 0.25)], axis=1).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, stereo, 44100, format="WAV", subtype="FLOAT")
    out = _register(state, id="cd", audio=_audio(buf.getvalue()))
    kept = state.voices["cd"]
    assert out["sample_rate"] == kept.rate == 44100
    assert np.array_equal(kept.samples.numpy(), stereo.mean(axis=1, dtype=np.float32))


def _race(monkeypatch, state: ServerState, bodies: dict[str, dict], order: list[str] | None = None) -> dict:
    """voices.register for each named JSON body in a thread of that name, all at once: name -> response or ApiError.

    The threads start together (a barrier). One that reaches decoding waits there until every thread
    has reached decoding or ended, so all checks made before decoding ran while the others were in
    flight (the race window held open); then the decoding ones go on one at a time, in `order`.
    """
    real = voices.decode_reference
    go = {name: threading.Event() for name in bodies}
    arrived, decoding, outcome = threading.Semaphore(0), set(), {}

    def decode(*args, **kwargs):
        name = threading.current_thread().name
        decoding.add(name)
        arrived.release()
        assert go[name].wait(WAIT), "the test never let this decode go on"
        return real(*args, **kwargs)

    monkeypatch.setattr(voices, "decode_reference", decode)
    start = threading.Barrier(len(bodies))

    def run(body: dict) -> None:
        name = threading.current_thread().name
        start.wait(WAIT)
        try:
            outcome[name] = _register(state, **body)
        except ApiError as e:
            outcome[name] = e
        finally:
            if name not in decoding:
                arrived.release()

    threads = {name: threading.Thread(target=run, args=(body,), name=name, daemon=True)
               for name, body in bodies.items()}
    for t in threads.values():
        t.start()
    for _ in bodies:
        assert arrived.acquire(timeout=WAIT), "a register call neither reached decoding nor ended"
    for name in order or list(bodies):
        go[name].set()
        threads[name].join(WAIT)
        assert not threads[name].is_alive(), f"{name} still running"
    assert set(outcome) == set(bodies)
    return outcome


def _conflicts(outcome: dict) -> list[str]:
    return sorted(n for n, r in outcome.items() if isinstance(r, ApiError) and r.status == 409)


def test_concurrent_uploads_of_one_id_create_it_once(make_state, monkeypatch, h):
    """Eight uploads of one id at once: one 201, seven 409s; none replaces another's voice."""
    state = make_state()
    bodies = {f"upload-{i}": {"id": "same", "audio": h.wav_base64(freq=100 + 20 * i), "text": str(i)}
              for i in range(8)}
    outcome = _race(monkeypatch, state, bodies)
    [won] = [n for n, r in outcome.items() if isinstance(r, dict)]
    assert _conflicts(outcome) == sorted(set(bodies) - {won})
    assert state.voices["same"].text == bodies[won]["text"] and not state.creating


@pytest.mark.parametrize("order", [["uploaded", "cached"], ["cached", "uploaded"]])
def test_an_uploaded_and_a_cached_voice_cannot_share_an_id(make_state, monkeypatch, h, order):
    """One upload and one cache on a model of the same id at once: one is created, the other is a 409."""
    state = make_state()
    bodies = {"uploaded": {"id": "twin", "audio": h.wav_base64()},
              "cached": {"id": "twin", "audio": h.wav_base64(), "model": "tone"}}
    outcome = _race(monkeypatch, state, bodies, order)
    assert len(_conflicts(outcome)) == 1 and sum(isinstance(r, dict) for r in outcome.values()) == 1
    cached = any(v.id == "twin" for v in state.runtime.voices("tone"))
    stored = any(s.id == "twin" for s in state.runtime.stored_voices())
    assert ("twin" in state.voices) + cached == 1 and stored == cached and not state.creating


def test_concurrent_uploads_cannot_pass_the_voice_limit(make_state, monkeypatch, h):
    """With room for 2 voices, 4 uploads of different ids at once: 2 are created, 2 are refused."""
    state = make_state(max_voices=2)
    outcome = _race(monkeypatch, state, {f"v{i}": {"id": f"v{i}", "audio": h.wav_base64()} for i in range(4)})
    assert len(_conflicts(outcome)) == 2 and len(state.voices) == 2
    assert all("limit of 2 voices" in r.message for r in outcome.values() if isinstance(r, ApiError))


def test_an_id_is_free_again_after_a_failed_creation(make_state, h):
    """A refused upload (silent audio) releases its reservation: the id can be created next."""
    state = make_state()
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(16000, np.float32), 16000, format="WAV")
    with pytest.raises(ApiError, match="silent"):
        _register(state, id="again", audio=_audio(buf.getvalue()))
    assert not state.creating
    assert _register(state, id="again", audio=h.wav_base64())["kind"] == "uploaded"
