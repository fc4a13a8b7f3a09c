"""The engine through Mizuoto's runtime against upstream's recorded calls: the whole request, per CPU class.

Each case's call (`generate_voice_clone` / `generate_custom_voice` / `generate_voice_design` with its
keyword arguments) becomes one `Runtime.synthesize`: the text, the voice (a reference clip with or
without its transcript, a preset speaker, or VoiceDesign's one voice), the instruction, the seed,
and every other argument as a request option of the same name; an argument that is neither fails
the test. The audio must equal upstream's returned waveform, the codes the talker drew upstream's.
"""

import functools

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.api import Runtime

_RUNTIME: dict = {}


def _runtime() -> Runtime:
    if "rt" not in _RUNTIME:
        _RUNTIME["rt"] = Runtime()
    return _RUNTIME["rt"]


@functools.lru_cache(maxsize=None)
def _loaded(model_dir) -> str:
    return _runtime().load(str(model_dir), device="cpu")


def _request(case) -> dict:
    name = _loaded(case.model_dir)
    return case.request({o.name for o in _runtime().model(name).capabilities.options})


def test_detected_without_naming_the_engine(case):
    assert _runtime().detect(case.model_dir) == [("qwen3tts", case.spec["model"])]


def test_a_request_equals_upstreams_audio(case):
    name = _loaded(case.model_dir)
    request = _request(case)
    chunks = list(_runtime().synthesize(name, request.pop("text"), **request))
    assert len(chunks) == 1 and chunks[0].final and chunks[0].sample_rate == case.spec["sample_rate"]
    recorded = case.tensors()
    assert chunks[0].samples.shape == recorded["wav"].shape
    case.cpu.assert_equal(chunks[0].samples, recorded["wav"], "wav", f"{case.name} wav")


def test_streaming_speaks_the_same_frames_in_chunks(case):
    """A stream's frames are the whole request's (the same draws): as many samples, in ordered chunks."""
    name = _loaded(case.model_dir)
    request = _request(case)
    text = request.pop("text")
    whole = list(_runtime().synthesize(name, text, **request))[0].samples
    chunks = list(_runtime().synthesize(name, text, stream=True, **request))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(c.samples.numel() for c in chunks) == whole.numel()


def test_an_unknown_language_is_refused_with_the_choices(case):
    name = _loaded(case.model_dir)
    request = _request(case)
    with pytest.raises(InvalidRequest, match="must be one of auto"):
        _runtime().synthesize(name, request.pop("text"), **{**request, "options": {"language": "klingon"}})
