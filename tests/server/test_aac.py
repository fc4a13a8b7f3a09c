"""response_format "aac": ADTS AAC through PyAV where it is installed, a 400 naming the extra where it is not."""

import io
import sys

import httpx
import numpy as np
import pytest


def test_aac_response(client, h):
    """An AAC (ADTS) body that decodes to the request's audio: same rate, the tone's length, its pitch."""
    import av

    r = client.post("/v1/audio/speech", json={"model": "tone", "input": "abc", "voice": "low", "seed": 1,
                                             "response_format": "aac"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/aac"
    assert r.content[:2] == b"\xff\xf1"  # an ADTS sync word, MPEG-4
    with av.open(io.BytesIO(r.content)) as c:
        stream = c.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.layout.name) == ("aac", 16000, "mono")
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    wav = client.post("/v1/audio/speech", json={"model": "tone", "input": "abc", "voice": "low", "seed": 1,
                                               "response_format": "pcm"}).content
    pcm = np.frombuffer(wav, "<i2").astype(np.float32) / 32767
    assert pcm.size <= decoded.size <= pcm.size + 3 * 1024  # encoder priming and the last frame's padding
    # the decoded signal matches the PCM once aligned on the encoder's delay (AAC is lossy: a correlation)
    lag = int(np.argmax(np.correlate(decoded[:pcm.size + 2048], pcm[:4000], "valid")))
    aligned = decoded[lag:lag + pcm.size]
    assert np.corrcoef(aligned, pcm[:aligned.size])[0, 1] > 0.95


def test_aac_without_pyav_is_a_clear_400(tmp_path, monkeypatch, h):
    """Without PyAV the server does not offer aac, and says what installs it and which formats it has."""
    from mizuoto.server.audio import available_formats

    monkeypatch.setitem(sys.modules, "av", None)
    assert "aac" not in available_formats()
    s = h.start_server({"tone": h.write_model(tmp_path / "tone")})
    try:
        r = httpx.post(f"{s.url}/v1/audio/speech", json={"model": "tone", "input": "ab", "voice": "low",
                                                         "response_format": "aac"}, timeout=30.0)
    finally:
        s.stop()
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    message = r.json()["error"]["message"]
    assert "pip install 'mizuoto-runtime[aac]'" in message and "available: wav, pcm" in message, message


@pytest.mark.parametrize("fmt", ["ogg", "AAC"])
def test_unknown_formats_list_the_available(client, fmt):
    """A format OpenAI does not list is refused with the list, aac in it."""
    r = client.post("/v1/audio/speech", json={"model": "tone", "input": "ab", "voice": "low", "response_format": fmt})
    assert r.status_code == 400 and "aac" in r.json()["error"]["message"]
