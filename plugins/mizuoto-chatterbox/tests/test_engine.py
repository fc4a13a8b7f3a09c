"""The engine through Mizuoto's runtime against upstream's recorded `generate`: the whole request, torch.equal.

Each case's text, seed and every recorded `generate` argument go through `Runtime.synthesize` (the
voice from `audio_prompt_path`, the rest as the model's declared request options; an argument the
model refuses by design must be refused with a clear error, any other one fails the test); the text
ids and T3 conditioning the engine fed T3, and the audio before the watermark, must equal upstream's.
A case upstream failed in must fail here with a clear error.
"""

import functools

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Reference

_RUNTIME: dict = {}


def _runtime() -> Runtime:
    if "rt" not in _RUNTIME:
        _RUNTIME["rt"] = Runtime()
    return _RUNTIME["rt"]


@functools.lru_cache(maxsize=None)
def _loaded(model_dir) -> str:
    return _runtime().load(str(model_dir), watermark=False)


def _refused(model) -> tuple[str, ...]:
    """The upstream `generate` arguments the model refuses by design (upstream takes and ignores them)."""
    from mizuoto_chatterbox.engine import TURBO_REFUSED

    return TURBO_REFUSED if model.turbo else ()


def _request(case) -> dict:
    """The case as `Runtime.synthesize` keywords: every recorded argument is the voice, a declared option or refused."""
    name = _loaded(case.model_dir)
    model = _runtime().model(name)
    declared = {o.name for o in model.capabilities.options}
    kw = dict(case.spec["generate_kwargs"])
    prompt = kw.pop("audio_prompt_path")
    assert (prompt is None) == (case.clip is None), "audio_prompt_path is the case's reference clip"
    dropped = set(kw) - declared - set(_refused(model))
    assert not dropped, f"upstream's generate arguments {sorted(dropped)} are neither taken nor refused"
    voice = "default" if case.clip is None else Reference(str(case.clip))
    return {"voice": voice, "seed": case.spec["seed"], "options": {k: v for k, v in kw.items() if k in declared}}


def test_every_recorded_argument_is_taken_or_refused_clearly(case):
    """A refused argument names itself; the request without it is what upstream computed (test below)."""
    name = _loaded(case.model_dir)
    model = _runtime().model(name)
    request = _request(case)
    for key in sorted(set(case.spec["generate_kwargs"]) & set(_refused(model))):
        value = case.spec["generate_kwargs"][key]
        with pytest.raises(InvalidRequest, match=f"no option '{key}'"):
            _runtime().synthesize(name, case.spec["text"], **{**request, "options": {key: value}})


def _t3_input(monkeypatch, model) -> dict:
    """Wrap the model's T3 call: what the engine fed it (conditioning rows, text ids) lands in the returned dict."""
    fed: dict = {}
    attr = "generate_turbo" if model.turbo else "generate"
    original = getattr(model.t3, attr)

    def observed(cond, text, *args, **kwargs):
        fed["cond"], fed["text"] = cond.clone(), text.clone()
        return original(cond, text, *args, **kwargs)
    monkeypatch.setattr(model.t3, attr, observed)
    return fed


def test_detected_without_naming_the_engine(case):
    found = _runtime().detect(case.model_dir)
    turbo = case.spec["class"] == "ChatterboxTurboTTS"
    assert found == [("chatterbox", "turbo" if turbo else "english")]


def test_a_request_equals_upstreams_audio(case, monkeypatch):
    """Preset and clone (the clip read and analysed here, as upstream's prepare_conditionals does); T3's input
    is compared too, as a random T3's draws hardly depend on the text."""
    name = _loaded(case.model_dir)
    if "expected_error" in case.spec:
        with pytest.raises(InvalidRequest, match="cfg_weight"):
            list(_runtime().synthesize(name, case.spec["text"], **_request(case)))
        return
    ref = case.tensors()
    fed = _t3_input(monkeypatch, _runtime().model(name))
    chunks = list(_runtime().synthesize(name, case.spec["text"], **_request(case)))
    assert torch.equal(fed["text"], ref["text_tokens"][0].long()), "the text ids T3 got differ from upstream's"
    case.assert_equal(fed["cond"], "t3_cond_emb", "the conditioning the engine fed T3")
    assert len(chunks) == 1 and chunks[0].final and chunks[0].sample_rate == 24000
    wav = chunks[0].samples
    assert wav.shape == ref["wav_pre_watermark"].shape
    case.assert_equal(wav, "wav_pre_watermark")


def test_streaming_speaks_the_same_tokens_in_growing_chunks(case):
    if "expected_error" in case.spec:
        return
    name = _loaded(case.model_dir)
    whole = list(_runtime().synthesize(name, case.spec["text"], **_request(case)))[0].samples
    chunks = list(_runtime().synthesize(name, case.spec["text"], stream=True, **_request(case)))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # the same T3 draws (the same seed), so the same number of samples: only S3Gen's noise differs
    assert sum(c.samples.numel() for c in chunks) == whole.numel()
    streamed = torch.cat([c.samples for c in chunks])
    assert not torch.equal(streamed, torch.zeros_like(streamed))


def test_an_option_the_model_does_not_take_is_refused_before_any_work(case):
    name = _loaded(case.model_dir)
    with pytest.raises(InvalidRequest, match="no option 'loudness'"):
        _runtime().synthesize(name, "Hello.", voice=_request(case)["voice"], options={"loudness": 2.0})
    option = _runtime().model(name).capabilities.options[0]
    with pytest.raises(InvalidRequest, match=option.name):
        _runtime().synthesize(name, "Hello.", voice=_request(case)["voice"], options={option.name: "high"})


def test_a_cloned_voice_is_cached_exported_and_imported_as_it_was(case):
    if case.clip is None or "expected_error" in case.spec:
        return
    rt = _runtime()
    name = _loaded(case.model_dir)
    text, request = case.spec["text"], _request(case)
    if "norm_loudness" in request["options"]:  # add_voice clones with upstream's default, the loudness gain on
        request["options"]["norm_loudness"] = True
    direct = list(rt.synthesize(name, text, **request))[0].samples
    voice_id, copy_id = f"clip-{case.name}", f"clip-{case.name}-copy"
    rt.add_voice(name, voice_id, str(case.clip))
    imported = False
    try:
        cached = list(rt.synthesize(name, text, **{**request, "voice": voice_id}))[0].samples
        assert torch.equal(cached, direct)
        model = rt.model(name)
        prompt = model.export_voice(voice_id)
        model.import_voice(copy_id, prompt)
        imported = True
        copied = list(rt.synthesize(name, text, **{**request, "voice": copy_id}))[0].samples
        assert torch.equal(copied, direct)
    finally:  # only what was made is removed, so a failure above is the one reported
        rt.remove_voice(voice_id, name)
        if imported:
            rt.model(name).remove_voice(copy_id)


class _Perth:
    """A stand-in for resemble-perth's module: its watermarker adds a recognisable offset."""

    class PerthImplicitWatermarker:
        def apply_watermark(self, wav, sample_rate):
            assert sample_rate == 24000 and wav.dtype.name == "float32"
            return wav + 0.25


def test_the_watermark_marks_every_output_when_installed_and_on(case, monkeypatch):
    import sys

    from mizuoto.runtime.options import parse_options
    from mizuoto_chatterbox.engine import ChatterboxEngine

    if "expected_error" in case.spec or case.clip is not None:
        return
    monkeypatch.setitem(sys.modules, "perth", _Perth)
    marked = ChatterboxEngine().load(case.model_dir, parse_options())
    plain = ChatterboxEngine().load(case.model_dir, parse_options(watermark=False))
    assert plain.watermarker is None and marked.watermarker is not None
    from mizuoto.runtime.engine import SynthesisRequest, check_request

    for stream in (False, True):
        req = check_request(SynthesisRequest(case.spec["text"], voice="default", seed=1, stream=stream), marked)
        with_mark = torch.cat([c.samples for c in marked.synthesize(req)])
        without = torch.cat([c.samples for c in plain.synthesize(req)])
        assert torch.equal(with_mark, without + 0.25)
    monkeypatch.setitem(sys.modules, "perth", None)  # not installed: nothing is marked, nothing fails
    assert ChatterboxEngine().load(case.model_dir, parse_options()).watermarker is None


def test_a_device_other_than_the_cpu_is_refused_at_load(case):
    from dataclasses import replace

    from mizuoto.errors import ModelLoadError
    from mizuoto.runtime.options import LoadOptions
    from mizuoto_chatterbox.engine import ChatterboxEngine

    with pytest.raises(ModelLoadError, match="runs on the CPU.*--device cpu"):
        ChatterboxEngine().load(case.model_dir, replace(LoadOptions(), device="cuda"))


def test_a_text_longer_than_the_position_tables_is_refused_with_its_length(case):
    name = _loaded(case.model_dir)
    model = _runtime().model(name)
    t3 = model.t3
    limit = t3.text_pos_emb.num_embeddings if t3.text_pos_emb is not None else t3.tfmr.config.max_positions
    words = "word " * limit  # more ids than any table holds (a word is at least one id)
    cut = model.text.max_length
    if cut is not None and cut < limit:  # Turbo's tokenizer cuts the text first, as upstream's does
        assert len(model.text.ids(words)) == cut
        with pytest.raises(InvalidRequest, match="too long for this model"):  # a prompt that overflows still fails
            model._check_length(limit, 1)
        return
    with pytest.raises(InvalidRequest, match="too long for this model"):
        list(_runtime().synthesize(name, words, voice=_request(case)["voice"], seed=1))


def test_a_foreign_or_preset_named_voice_prompt_is_refused(case):
    from mizuoto.runtime.engine import VoicePrompt

    model = _runtime().model(_loaded(case.model_dir))
    with pytest.raises(InvalidRequest, match="other Chatterbox model"):
        model.import_voice("x", VoicePrompt({}, {"turbo": str(not model.turbo), "exaggeration": "0.5"}))
    with pytest.raises(InvalidRequest, match="not a Chatterbox voice prompt"):
        model.import_voice("x", VoicePrompt({"pitch": torch.zeros(1)}, {"turbo": str(model.turbo),
                                                                        "exaggeration": "0.5"}))
    if model.presets:
        preset = next(iter(model.presets.values()))
        prompt = VoicePrompt({k: v for k, v in vars(preset).items() if isinstance(v, torch.Tensor)},
                             {"turbo": str(model.turbo), "exaggeration": "0.5"})
        with pytest.raises(InvalidRequest, match="preset voice's id"):
            model.import_voice(next(iter(model.presets)), prompt)
