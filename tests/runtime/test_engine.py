"""The contract's types reject malformed values at construction, with clear errors."""

import numpy as np
import pytest
import torch

from mizuoto.runtime.engine import (MODES, AudioChunk, Capabilities, Reference, Stage, SynthesisRequest, Voice,
                                    load_audio, resolve_mode)
from mizuoto.errors import AudioError, InvalidRequest, MizuotoError

REF = (torch.zeros(160), 16000)


@pytest.mark.parametrize("fields,match", [
    (dict(text=""), "text is empty"),
    (dict(text="   \n"), "text is empty"),
    (dict(text=5), "text must be"),
    (dict(text=b"bytes"), "text must be"),
    (dict(text="hi", mode="karaoke"), "unknown mode"),
    (dict(text="hi", speed=0), "speed"),
    (dict(text="hi", speed=float("nan")), "speed"),
    (dict(text="hi", speed=9.0), "speed"),
    (dict(text="hi", seed=-1), "seed"),
    (dict(text="hi", seed=1.5), "seed"),
    (dict(text="hi", stream="yes"), "stream"),
    (dict(text="hi", voice=""), "voice id is empty"),
    (dict(text="hi", voice=3), "voice must be"),
    (dict(text="hi", instruct=" "), "instruct text is empty"),
    (dict(text="hi", mode="preset"), "needs a voice"),
    (dict(text="hi", mode="preset", voice=Reference(REF)), "preset voice id"),
    (dict(text="hi", mode="clone", voice=Reference(REF)), "needs the reference text"),
    (dict(text="hi", mode="instruct", voice="a"), "needs instruct text"),
    (dict(text="hi", mode="clone", voice="a", instruct="x"), "only for mode 'instruct'"),
    (dict(text="hi", mode="vc", voice="a", source_audio=REF), "takes no text"),
    (dict(mode="vc", voice="a"), "needs source_audio"),
    (dict(mode="clone", voice="a"), "needs text"),
    (dict(text="hi", mode="clone", voice="a", source_audio=REF), "only for mode 'vc'"),
])
def test_bad_requests(fields, match):
    with pytest.raises(InvalidRequest, match=match):
        SynthesisRequest(**fields)


def test_good_requests_and_mode_resolution():
    voices = [Voice("amy", "preset"), Voice("mine", "cached")]
    ref = Reference(REF, "hello")
    cases = [
        (SynthesisRequest("hi", voice="amy"), "preset"),
        (SynthesisRequest("hi", voice="mine"), "clone"),
        (SynthesisRequest("hi", voice=ref), "clone"),
        (SynthesisRequest("hi", voice=Reference(REF)), "cross_lingual"),
        (SynthesisRequest("hi", voice="amy", instruct="whisper"), "instruct"),
        (SynthesisRequest(voice=ref, source_audio=REF), "vc"),
        (SynthesisRequest("hi", mode="cross_lingual", voice="mine"), "cross_lingual"),
    ]
    for request, mode in cases:
        assert resolve_mode(request, voices).mode == mode
    with pytest.raises(InvalidRequest, match="unknown voice 'bob'; this model has: amy, mine"):
        resolve_mode(SynthesisRequest("hi", voice="bob"), voices)
    with pytest.raises(InvalidRequest, match="no voice"):
        resolve_mode(SynthesisRequest("hi"), voices)
    streamed = SynthesisRequest(iter(["a", "b"]), voice="amy")
    assert streamed.text_streamed and not SynthesisRequest("a").text_streamed


def test_reference_audio(tmp_path):
    with pytest.raises(AudioError, match="not found"):
        Reference(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="1-D"):
        Reference((torch.zeros(2, 3), 16000))
    with pytest.raises(AudioError, match="sample rate"):
        Reference((torch.zeros(3), 0))
    with pytest.raises(AudioError, match="expected a file path"):
        Reference(b"RIFF")
    import soundfile
    stereo = np.stack([np.full(100, 0.5), np.full(100, -0.25)], axis=1).astype(np.float32)
    soundfile.write(tmp_path / "s.wav", stereo, 8000, subtype="FLOAT")
    samples, rate = Reference(tmp_path / "s.wav").load()
    assert rate == 8000 and samples.dtype == torch.float32 and torch.allclose(samples, torch.full((100,), 0.125))
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    with pytest.raises(AudioError, match="cannot decode audio .*bad.wav"):
        load_audio(tmp_path / "bad.wav")
    assert issubclass(AudioError, MizuotoError)


def test_capabilities_chunks_stages_voices():
    caps = Capabilities(modes={"clone"}, sample_rate=24000, languages=["zh"])
    assert caps.modes == frozenset({"clone"}) and caps.languages == ("zh",)
    with pytest.raises(InvalidRequest, match="unknown modes"):
        Capabilities(modes={"sing"}, sample_rate=1)
    with pytest.raises(InvalidRequest, match="at least one mode"):
        Capabilities(modes=set(), sample_rate=1)
    with pytest.raises(InvalidRequest, match="sample_rate"):
        Capabilities(modes=set(MODES), sample_rate=0)
    AudioChunk(torch.zeros(4), 24000, 0, True)
    for samples in (torch.zeros(4, dtype=torch.float64), torch.zeros(1, 4), np.zeros(4, np.float32)):
        with pytest.raises(InvalidRequest, match="float32 1-D"):
            AudioChunk(samples, 24000, 0, True)
    with pytest.raises(InvalidRequest, match="index"):
        AudioChunk(torch.zeros(4), 24000, -1, True)
    lin = torch.nn.Linear(2, 2)
    stage = Stage("lm", "sequence", {"lin": lin}, memory=lambda r: 10)
    assert stage.working_memory(None) == 10 and stage.movable() == {"lin": lin}
    with pytest.raises(InvalidRequest, match="kind"):
        Stage("lm", "decoder", {})
    with pytest.raises(InvalidRequest, match="not among its modules"):
        Stage("lm", "sequence", {"lin": lin}, fixed={"other"})
    with pytest.raises(InvalidRequest, match="not a torch Module"):
        Stage("lm", "sequence", {"w": torch.zeros(2)})
    with pytest.raises(InvalidRequest, match="non-negative int"):
        Stage("lm", "sequence", {}, memory=lambda r: -1).working_memory(None)
    with pytest.raises(InvalidRequest, match="voice kind"):
        Voice("a", "borrowed")
