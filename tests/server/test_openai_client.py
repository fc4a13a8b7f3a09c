"""The official `openai` Python client against a real server: models, whole files and streamed audio, both engines.

CosyVoice speaks with the fixture clip registered as a voice (the client requires `voice`) and a
seed in `extra_body`, so its audio must equal the engine's own; piper's must be plausible speech.
"""

import base64
import json

import numpy as np
import openai
import pytest

TEXT = "The official client speaks through the server."
SEED = 3
VOICE = "openai-clip"


@pytest.fixture(scope="module")
def oai(server):
    """An OpenAI client of the shared server (no retries: a failure must show)."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def voices(server, oai, h):
    """model -> (voice, extra_body) for the calls: piper's first listed voice, the fixture clip for cosy."""
    import httpx

    listed = {m.id: m for m in oai.models.list()}
    with httpx.Client(base_url=server.url, timeout=60, headers=h.admin) as c:
        r = c.post("/v1/audio/voices", json={"id": VOICE, "audio": h.clip_base64(), "text": h.ref_text})
        assert r.status_code == 201, r.text
        yield {"piper": (listed["piper"].model_extra["voices"][0], {}), "cosy": (VOICE, {"seed": SEED})}
        assert c.delete(f"/v1/audio/voices/{VOICE}").status_code == 200


def _check(model, pcm: bytes, rate: int, expected, stream: bool) -> None:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
    assert np.sqrt(np.mean(samples ** 2)) > 0.01
    if model == "cosy":
        assert rate == 24000 and pcm == expected(TEXT, SEED, stream)
    else:
        assert len(TEXT) / 25 < len(samples) / rate < len(TEXT) / 6


def test_models_list(oai):
    """models.list() parses the server's listing."""
    models = {m.id: m for m in oai.models.list()}
    assert {"piper", "cosy"} <= set(models)
    assert models["cosy"].owned_by == "cosyvoice" and models["piper"].owned_by == "piper"


@pytest.mark.parametrize("model", ["piper", "cosy"])
def test_whole_file(oai, voices, cosy_expected, model):
    """audio.speech.create returns a whole WAV file."""
    voice, extra = voices[model]
    r = oai.audio.speech.create(model=model, input=TEXT, voice=voice, response_format="wav", extra_body=extra)
    body = r.content
    assert body[:4] == b"RIFF"
    _check(model, body[44:], int.from_bytes(body[24:28], "little"), cosy_expected, stream=False)


@pytest.mark.parametrize("model", ["piper", "cosy"])
def test_streamed_audio(oai, voices, cosy_expected, model):
    """with_streaming_response with stream_format=audio gives raw PCM16 as it is produced."""
    voice, extra = voices[model]
    with oai.audio.speech.with_streaming_response.create(model=model, input=TEXT, voice=voice, response_format="pcm",
                                                         stream_format="audio", extra_body=extra) as r:
        rate = int(r.headers["x-sample-rate"])
        pcm = b"".join(r.iter_bytes())
    _check(model, pcm, rate, cosy_expected, stream=True)


@pytest.mark.parametrize("model", ["piper", "cosy"])
def test_streamed_sse(oai, voices, cosy_expected, model):
    """stream_format=sse gives speech.audio.delta events and a speech.audio.done the client can read line by line."""
    voice, extra = voices[model]
    with oai.audio.speech.with_streaming_response.create(model=model, input=TEXT, voice=voice, response_format="pcm",
                                                         stream_format="sse", extra_body=extra) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    _check(model, pcm, events[-1]["sample_rate"], cosy_expected, stream=True)


def test_errors_surface(oai):
    """A 4xx from the server becomes the client's typed error, with the server's message."""
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.audio.speech.create(model="no-such-model", input=TEXT, voice="x")
    with pytest.raises(openai.BadRequestError, match="voice"):
        oai.audio.speech.create(model="piper", input=TEXT, voice="no-such-voice")
