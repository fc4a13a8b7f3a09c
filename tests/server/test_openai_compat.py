"""What costs nothing for OpenAI's clients: mp3 when a request names no format, model and voice aliases (tts-1,
alloy), /docs said to be off, and languages as BCP 47 tags. Through the official `openai` client where it applies."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest
import soundfile
from websockets.sync.client import connect

from mizuoto.errors import InvalidRequest
from mizuoto.server.listing import language_tag
from mizuoto.server.state import ServerConfig, ServerState

TEXT = "An alias speaks for the model."
ALIASES = ("tts-1=piper", "tts-1-hd=tone")
VOICE_ALIASES = ("alloy=piper/joe", "alloy=tone/high", "echo=low")


def _is_mp3(body: bytes) -> bool:
    """An ID3 tag, or an MPEG audio frame's sync word (11 set bits)."""
    return body[:3] == b"ID3" or (len(body) > 1 and body[0] == 0xFF and body[1] & 0xE0 == 0xE0)


@pytest.fixture(scope="module")
def aliased(served_dirs, h):
    """Piper and the tone model, with OpenAI's default format and OpenAI's names for them and their voices."""
    config = ServerConfig(default_format="mp3", model_aliases=ALIASES, voice_aliases=VOICE_ALIASES,
                          request_timeout=60.0)
    s = h.start_server({"piper": served_dirs["piper"], "tone": served_dirs["tone"]}, config)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(aliased):
    with openai.OpenAI(base_url=aliased.url + "/v1", api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


def test_models_list_shows_each_alias_and_its_target(oai):
    """An alias is an entry of its own (alias_of: its model); a model lists its aliases and voice aliases."""
    models = {m.id: m.model_extra | {"owned_by": m.owned_by} for m in oai.models.list()}
    assert models["tts-1"]["alias_of"] == "piper" and models["tts-1"]["owned_by"] == "piper"
    assert models["tts-1-hd"]["alias_of"] == "tone" and models["tts-1"]["loaded"] is True
    assert models["piper"]["aliases"] == ["tts-1"] and models["piper"]["voice_aliases"] == {"alloy": "joe",
                                                                                            "echo": "low"}
    assert models["tone"]["voice_aliases"] == {"alloy": "high", "echo": "low"}
    assert models["piper"]["languages"] == ["en-US"]  # Piper's config says en_US


def test_no_format_is_mp3_through_aliases(oai):
    """The client's plain call (no response_format) gets mp3, OpenAI's default, from the model the alias names."""
    r = oai.audio.speech.with_raw_response.create(model="tts-1", input=TEXT, voice="alloy")
    body = r.content
    assert _is_mp3(body), body[:8]
    assert r.headers["content-type"] == "audio/mpeg" and r.headers["x-mizuoto-model"] == "piper"
    audio, rate = soundfile.read(io.BytesIO(body), dtype="float32")
    assert rate == 22050 and len(TEXT) / 25 < len(audio) / rate < len(TEXT) / 6


def test_voice_alias_per_model_and_for_every_model(aliased):
    """alloy is high on tone (its own alias), echo low on every model; a name that is no alias is used as is."""
    def pitch_of(voice: str) -> bytes:
        r = httpx.post(aliased.url + "/v1/audio/speech", timeout=60, json={
            "model": "tts-1-hd", "input": "la la", "voice": voice, "response_format": "pcm", "seed": 1})
        assert r.status_code == 200, r.text
        return r.content
    assert pitch_of("alloy") == pitch_of("high") != pitch_of("low") == pitch_of("echo")
    r = httpx.post(aliased.url + "/v1/audio/speech", timeout=60,
                   json={"model": "tts-1-hd", "input": "la", "voice": "nova"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice"


def test_a_stream_without_a_format_is_wav(aliased):
    """mp3 cannot be streamed: a stream that names no format is wav."""
    with httpx.stream("POST", aliased.url + "/v1/audio/speech", timeout=60,
                      json={"model": "tts-1", "input": TEXT, "voice": "alloy", "stream_format": "audio"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        assert r.read()[:4] == b"RIFF"


def test_websocket_and_voice_listing_take_aliases(aliased):
    """session.start and GET /v1/audio/voices?model= read an alias as the model it names."""
    with connect(aliased.url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.start", "model": "tts-1", "voice": "alloy"}))
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "session.created" and created["model"] == "piper", created
        ws.send(json.dumps({"type": "input_text.append", "text": "Hello."}))
        ws.send(json.dumps({"type": "input_text.done"}))
        audio = b""
        while isinstance(message := ws.recv(timeout=60), bytes):
            audio += message
        assert json.loads(message)["type"] == "speech.audio.done" and len(audio) > 2000
    listed = httpx.get(aliased.url + "/v1/audio/voices", params={"model": "tts-1"}, timeout=30).json()["data"]
    assert {v["id"] for v in listed if v["model"] is not None} == {"joe"}


def test_docs_is_off_and_says_where_the_api_is_described(aliased):
    """No Swagger UI (it would load its scripts from a CDN): /docs is a 404 that names /openapi.json."""
    for path in ("/docs", "/redoc"):
        r = httpx.get(aliased.url + path, timeout=10)
        assert r.status_code == 404 and "/openapi.json" in r.json()["error"]["message"]
    assert httpx.get(aliased.url + "/openapi.json", timeout=10).status_code == 200


@pytest.mark.parametrize("model_aliases, voice_aliases, message", [
    (("tts-1=nope",), (), "no served model is named 'nope'"),
    (("tone=piper",), (), "'tone' is a served model's name"),
    (("tts-1",), (), "use ALIAS=MODEL"),
    (("a=tone", "a=piper"), (), "'a' already stands for 'tone'"),
    ((), ("alloy=nope/joe",), "no served model is named 'nope'"),
    ((), ("alloy=piper/",), "use ALIAS=VOICE"),
    ((), ("al loy=joe",), "use ALIAS=VOICE"),
])
def test_bad_aliases_are_refused_at_start(h, tmp_path, model_aliases, voice_aliases, message):
    """A bad alias is a clear error before the server starts, naming the flag."""
    models = {"tone": h.write_model(tmp_path / "tone"), "piper": h.write_model(tmp_path / "piper")}
    with pytest.raises(InvalidRequest, match="--(voice-)?alias") as e:
        ServerState(h.make_runtime(), ServerConfig(model_aliases=model_aliases, voice_aliases=voice_aliases), models)
    assert message in str(e.value)


def test_voice_alias_on_a_model_alias(h, tmp_path):
    """alloy=tts-1/joe is an alias on the model tts-1 stands for."""
    state = ServerState(h.make_runtime(), ServerConfig(model_aliases=("tts-1=tone",),
                                                       voice_aliases=("alloy=tts-1/high",)),
                        {"tone": h.write_model(tmp_path / "tone")})
    assert state.aliases.voices_of("tone") == {"alloy": "high"}
    assert state.aliases.voice(state.aliases.model("tts-1"), "alloy") == "high"


def test_a_default_format_without_its_encoder_is_refused(h, monkeypatch):
    """ServerConfig(default_format=...) must name a format this machine encodes."""
    import mizuoto.server.state as state_module

    monkeypatch.setattr(state_module, "available_formats", lambda: ("wav", "pcm"))
    with pytest.raises(InvalidRequest, match="default format 'mp3' has no encoder here; available: wav, pcm"):
        ServerState(h.make_runtime(), ServerConfig(default_format="mp3"), {})


@pytest.mark.parametrize("name, tag", [("en_US", "en-US"), ("en", "en"), ("EN", "en"), ("zh-cn", "zh-CN"), ("yue", "yue"),
                                       ("es_419", "es-419"), ("any", "any"), ("x-klingon", "x-klingon")])
def test_languages_are_bcp47_tags(name, tag):
    """Engines name languages their own way (Piper en_US, CosyVoice en): /v1/models gives BCP 47 tags."""
    assert language_tag(name) == tag
