"""POST /v1/audio/speech against a real server: whole files in every format, chunked audio and SSE, every engine.

CosyVoice (a fixture model, cloning the fixture clip) is seeded, so its responses must equal what
the engine gives in-process sample for sample; piper's VITS noise is not seedable, so its audio is
checked for level and plausible length.
"""

import base64
import io
import json
import re

import numpy as np
import pytest
import soundfile

from mizuoto.server.audio import available_formats

TEXT = "Hello there, this is a test of the server."
SEED = 7
# Long enough for several chunks: CosyVoice's LM speaks at least 2 tokens per text token, and this
# text's minimum passes its first streaming hop (at most 25 + 24 prompt pad + 3 lookahead tokens).
STREAM_TEXT = ("First sentence here. Second sentence there. Third one ends it, "
               "and a fourth one, longer than the others, closes the test.")


def _voice(h, model) -> dict:
    """Fields that pick the voice: a tone preset, piper's default voice, or a clone of the fixture clip."""
    if model == "tone":
        return {"voice": "high"}
    if model == "cosy":
        return {"ref_audio": h.clip_base64(), "ref_text": h.ref_text, "seed": SEED}
    return {}


def _speech(client, **body):
    return client.post("/v1/audio/speech", json=body)


def test_every_codec_of_the_installed_libsndfile_is_offered():
    """The per-format test below covers what available_formats() finds; it must find every codec the
    installed libsndfile has (FLAC always; MP3 since 1.1.0, Ogg Opus since 1.0.29), so none drops out
    of the test unseen."""
    version = tuple(int(p) for p in re.findall(r"\d+", soundfile.__libsndfile_version__)[:3])
    expected = {"wav", "pcm", "flac"} | ({"mp3"} if version >= (1, 1, 0) else set()) \
        | ({"opus"} if version >= (1, 0, 29) else set()) | {"aac"}  # aac: PyAV, installed by make test
    assert set(available_formats()) == expected


@pytest.mark.parametrize("fmt", available_formats())
def test_tone_every_format(client, h, fmt):
    """Each available response format decodes (pcm by hand) to the length the tone engine must give."""
    r = _speech(client, model="tone", input="abc def", voice="low", response_format=fmt, seed=3)
    assert r.status_code == 200, r.text
    assert r.headers["x-sample-rate"] == "16000"
    expected = h.tone_seconds("abc def")
    if fmt == "pcm":
        seconds = len(r.content) / 2 / 16000
    elif fmt == "aac":  # ADTS, which libsndfile does not read: decoded with PyAV
        import av

        with av.open(io.BytesIO(r.content)) as c:
            seconds = sum(f.samples for f in c.decode(audio=0)) / 16000
    else:
        audio, rate = h.read_audio(r.content)
        seconds = len(audio) / rate
    tolerance = 0.0 if fmt in ("wav", "pcm", "flac") else 0.2 if fmt == "aac" else 0.08  # lossy codecs pad frames
    assert abs(seconds - expected) <= tolerance + 1e-9, (fmt, seconds, expected)


def test_piper_whole_file(client, h):
    """piper speaks a non-silent wav of plausible length through the server."""
    r = _speech(client, model="piper", input=TEXT)
    assert r.status_code == 200, r.text
    audio, rate = h.read_audio(r.content)
    assert rate == 22050
    assert len(TEXT) / 25 < len(audio) / rate < len(TEXT) / 6
    assert np.sqrt(np.mean(audio ** 2)) > 0.01


def test_cosy_clone_whole_file(client, h, cosy_expected):
    """A CosyVoice clone (base64 reference + transcript) is the engine's own audio, as one WAV file."""
    r = _speech(client, model="cosy", input=TEXT, response_format="wav", **_voice(h, "cosy"))
    assert r.status_code == 200, r.text
    assert r.headers["x-sample-rate"] == "24000" and r.content[:4] == b"RIFF"
    assert r.content[44:] == cosy_expected(TEXT, SEED)
    # not silence (how loud a random-weight vocoder is depends on the tree's weights)
    assert np.sqrt(np.mean(h.read_audio(r.content)[0] ** 2)) > 0


@pytest.mark.parametrize("model", ["tone", "piper", "cosy"])
def test_chunked_audio_stream(client, h, cosy_expected, model):
    """stream_format=audio sends a streaming WAV header then PCM16 in several pieces, as produced."""
    text = {"tone": "abcdefghijklmnop", "piper": "First sentence here. Second sentence there."}.get(model, STREAM_TEXT)
    body = {"model": model, "input": text, "stream_format": "audio", "response_format": "wav", **_voice(h, model)}
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        pieces = [p for p in r.iter_raw() if p]
    data = b"".join(pieces)
    assert data[:4] == b"RIFF" and data[36:40] == b"data"
    rate = int(r.headers["x-sample-rate"])
    samples = np.frombuffer(data[44:], dtype="<i2")
    if model == "tone":
        assert len(samples) / rate == pytest.approx(h.tone_seconds(text))
    elif model == "cosy":
        assert data[44:] == cosy_expected(text, SEED, stream=True)
    else:
        assert len(text) / 25 < len(samples) / rate < len(text) / 6
    if model != "tone":  # not silence; a random-weight vocoder's loudness depends on the tree's weights
        assert np.sqrt(np.mean((samples / 32768.0) ** 2)) > (0.01 if model == "piper" else 0)
    assert len(pieces) >= 2


@pytest.mark.parametrize("model", ["tone", "piper", "cosy"])
def test_sse_stream(client, h, cosy_expected, model):
    """stream_format=sse gives speech.audio.delta events (base64 PCM16) and a final speech.audio.done."""
    text = {"tone": "abcdefghij", "piper": "One sentence. Another sentence."}.get(model, STREAM_TEXT)
    body = {"model": model, "input": text, "stream_format": "sse", "response_format": "pcm", **_voice(h, model)}
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and len(events) >= 3
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    seconds = len(pcm) / 2 / events[-1]["sample_rate"]
    assert seconds == pytest.approx(events[-1]["seconds"])
    if model == "tone":
        assert seconds == pytest.approx(h.tone_seconds(text))
    elif model == "cosy":
        assert pcm == cosy_expected(text, SEED, stream=True)


def test_clone_with_inline_reference(client, h):
    """ref_audio as base64 with ref_text clones (tone engine: pitch from the reference)."""
    r = _speech(client, model="tone", input="abc", ref_audio=h.wav_base64(), ref_text="a reference")
    assert r.status_code == 200, r.text
    audio, rate = h.read_audio(r.content)
    assert len(audio) / rate == pytest.approx(h.tone_seconds("abc"))


def test_default_voice_and_speed(client, h):
    """Without a voice the model's first preset speaks; speed shortens the audio."""
    slow = h.read_audio(_speech(client, model="tone", input="abcd", speed=0.5).content)[0]
    fast = h.read_audio(_speech(client, model="tone", input="abcd", speed=2.0).content)[0]
    assert len(slow) == pytest.approx(4 * len(fast), rel=0.01)


def test_models_listing(client):
    """GET /v1/models lists each served model with its engine, rate and voices."""
    data = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert data["piper"]["engine"] == "piper" and data["piper"]["sample_rate"] == 22050
    assert data["tone"]["voices"][:2] == ["low", "high"]
    assert data["cosy"]["engine"] == "cosyvoice" and data["cosy"]["variant"] == "cosyvoice2"
    assert data["cosy"]["sample_rate"] == 24000 and "clone" in data["cosy"]["modes"]
    assert all(m["object"] == "model" for m in data.values())


def test_health_ready_metrics(client):
    """/health, /ready and /metrics answer; metrics are Prometheus text with the documented families."""
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    _speech(client, model="tone", input="ab", voice="low")
    text = client.get("/metrics").text
    for family in ("mizuoto_requests_total", "mizuoto_requests_in_flight", "mizuoto_first_chunk_seconds_bucket",
                   "mizuoto_rtf_bucket", "mizuoto_memory_planned_bytes", "mizuoto_memory_used_bytes"):
        assert family in text, family
    from prometheus_client.parser import text_string_to_metric_families  # label order is the library's

    counted = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
               if f.name == "mizuoto_requests" for s in f.samples if s.name == "mizuoto_requests_total"}
    assert counted[("model", "tone"), ("route", "speech"), ("status", "200")] >= 1
