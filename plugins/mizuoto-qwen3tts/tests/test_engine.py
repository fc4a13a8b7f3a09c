"""The engine through Mizuoto's runtime against upstream's recorded calls: the whole request, per CPU class.

Each case's call (`generate_voice_clone` / `generate_custom_voice` / `generate_voice_design` with its
keyword arguments) becomes one `Runtime.synthesize`: the text, the voice (a reference clip with or
without its transcript, a preset speaker, or VoiceDesign's one voice), the instruction, the seed,
and every other argument as a request option of the same name; an argument that is neither fails
the test. The audio must equal upstream's returned waveform, the codes the talker drew upstream's.
"""

import functools
import os

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


def test_no_frame_at_all_is_a_clear_error_and_an_icl_clone_gives_empty_audio(case):
    """max_new_tokens 1: the talker's one token never gets its frame. Upstream's decode then fails on no codes
    (here: an InvalidRequest saying why), unless a clone's reference codes are decoded ahead (then its audio is
    cut away whole: no samples)."""
    name = _loaded(case.model_dir)
    request = _request(case)
    text = request.pop("text")
    request["options"] = {**request["options"], "max_new_tokens": 1}
    if "ref_codes" in case.tensors():
        chunks = list(_runtime().synthesize(name, text, **request))
        assert len(chunks) == 1 and chunks[0].samples.numel() == 0
        return
    with pytest.raises(InvalidRequest, match="no audio frame"):
        list(_runtime().synthesize(name, text, **request))


def _copy_with_config(model_dir, tmp_path, **changes):
    """A copy of a model dir (weights linked) whose config.json has `changes` at its top level."""
    import json
    import shutil

    copy = tmp_path / model_dir.name
    shutil.copytree(model_dir, copy, copy_function=os.symlink)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({**config, **changes}), encoding="utf-8")
    return copy


def test_a_model_upstream_drops_instructions_for_takes_none(any_case, tmp_path):
    """Upstream's CustomVoice ignores an instruction when `tts_model_size in "0b6"`: Mizuoto refuses it instead."""
    custom = next((d for d in any_case.model_dir.parent.iterdir()
                   if _runtime().detect(d) == [("qwen3tts", "custom_voice")]), None)
    assert custom is not None, "the tree has no CustomVoice model"
    rt = _runtime()
    for size, instruct in (("0b6", False), ("1b7", True)):
        name = rt.load(str(_copy_with_config(custom, tmp_path / size, tts_model_size=size)), name=f"cv-{size}",
                       device="cpu")
        try:
            assert ("instruct" in rt.model(name).capabilities.modes) is instruct
            voice = next(v.id for v in rt.model(name).voices() if v.kind == "preset")
            if not instruct:
                with pytest.raises(InvalidRequest, match="does not support mode 'instruct'"):
                    rt.synthesize(name, "Hello.", voice=voice, instruct="Speak slowly.")
        finally:
            rt.unload(name)


@pytest.mark.parametrize("changes, says", [({"tokenizer_type": "qwen3_tts_tokenizer_25hz"}, "12 Hz"),
                                           ({"tts_model_type": "dubbing"}, "tts_model_type"),
                                           ({"model_type": "qwen3"}, "qwen3_tts")])
def test_a_directory_this_engine_cannot_run_is_refused_naming_why(any_case, tmp_path, changes, says):
    from mizuoto.errors import ModelLoadError
    from mizuoto_qwen3tts.engine import Qwen3TTSEngine
    from mizuoto_qwen3tts.layout import read_layout

    copy = _copy_with_config(any_case.model_dir, tmp_path, **changes)
    assert Qwen3TTSEngine().detect(copy) is False
    with pytest.raises(ModelLoadError, match=says):
        read_layout(copy)


def test_a_speed_other_than_one_is_refused_before_any_work(any_case):
    name = _loaded(any_case.model_dir)
    request = _request(any_case)
    with pytest.raises(InvalidRequest, match="speed must be 1"):
        list(_runtime().synthesize(name, request.pop("text"), speed=1.5, **request))


def test_a_voice_cached_with_its_transcript_clones_in_context_or_by_x_vector_as_asked(case):
    """The cached prompt equals the clip's own: in context (mode clone) it gives the case's audio; asked as
    cross_lingual it speaks by x-vector alone, as a clip given without its transcript does."""
    if case.spec["method"] != "generate_voice_clone" or case.kwargs.get("x_vector_only_mode"):
        return
    name = _loaded(case.model_dir)
    rt, request = _runtime(), _request(case)
    text, clip = request.pop("text"), request.pop("voice")
    rt.model(name).add_voice(f"cached-{case.name}", clip.audio, clip.text)
    try:
        cached = list(rt.synthesize(name, text, **{**request, "voice": f"cached-{case.name}"}))[0].samples
        case.cpu.assert_equal(cached, case.tensors()["wav"], "wav", f"{case.name} wav from the cached voice")
        by_xvector = list(rt.synthesize(name, text, **{**request, "voice": f"cached-{case.name}",
                                                        "mode": "cross_lingual"}))[0].samples
        from mizuoto.runtime.engine import Reference

        direct = list(rt.synthesize(name, text, **{**request, "voice": Reference(clip.audio),
                                                    "mode": "cross_lingual"}))[0].samples
        assert torch.equal(by_xvector, direct)
    finally:
        rt.model(name).remove_voice(f"cached-{case.name}")
