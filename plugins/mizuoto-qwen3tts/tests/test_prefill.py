"""The talker's prompt, trailing text rows and pad row equal upstream's, built from each case's own call.

Clones take the recorded x-vector (`speaker_embedding`) and, for ICL, the recorded reference codes
(`ref_codes`): the speaker encoder and the codec encoder are checked elsewhere.
"""

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto_qwen3tts.code_predictor import load_code_predictor
from mizuoto_qwen3tts.ids import ModelIds
from mizuoto_qwen3tts.prefill import PrefillBuilder, language_id
from mizuoto_qwen3tts.prompt import Prompts
from mizuoto_qwen3tts.talker import load_talker

# upstream's wrapper defaults per method when the call leaves non_streaming_mode out
STREAMING_DEFAULT = {"generate_voice_clone": False, "generate_custom_voice": True, "generate_voice_design": True}


def builder(model_dir) -> PrefillBuilder:
    """A prefill builder over the model dir's talker, code predictor, ids and tokenizer."""
    return PrefillBuilder(load_talker(model_dir), load_code_predictor(model_dir), ModelIds.from_dir(model_dir),
                          Prompts(model_dir))


def request(case, recorded) -> dict:
    """`PrefillBuilder.build`'s arguments for the case's call (clones: the recorded voice)."""
    kwargs = case.kwargs
    out = {"text": kwargs["text"], "language": kwargs.get("language"), "speaker": kwargs.get("speaker"),
           "instruct": kwargs.get("instruct"),
           "non_streaming_mode": kwargs.get("non_streaming_mode", STREAMING_DEFAULT[case.spec["method"]])}
    if case.spec["method"] == "generate_voice_clone":
        out["speaker_embedding"] = recorded["speaker_embedding"]
        if not kwargs.get("x_vector_only_mode", False):
            out["ref_text"], out["ref_codes"] = kwargs["ref_text"], recorded["ref_codes"]
    return out


@torch.inference_mode()
def test_the_prefill_equals_upstreams(case):
    recorded = case.tensors()
    ours = builder(case.model_dir).build(**request(case, recorded))
    for key, tensor in (("talker_inputs_embeds", ours.inputs_embeds), ("trailing_text_hidden", ours.trailing),
                        ("tts_pad_embed", ours.pad)):
        assert tensor.shape == recorded[key].shape, (case.name, key, tensor.shape, recorded[key].shape)
        case.cpu.assert_equal(tensor, recorded[key], key, f"{case.name} {key}")


@torch.inference_mode()
def test_the_prefill_from_ids_equals_the_prefill_from_texts(case):
    """`embed` over the recorded ids is what `build` makes of the texts (the engine may tokenize itself)."""
    recorded = case.tensors()
    b, args = builder(case.model_dir), request(case, recorded)
    from_texts = b.build(**args)
    from_ids = b.embed(recorded["input_ids"], args["language"], args["speaker"],
                       instruct_ids=recorded.get("instruct_ids"), ref_ids=recorded.get("ref_ids"),
                       speaker_embedding=args.get("speaker_embedding"), ref_codes=args.get("ref_codes"),
                       non_streaming_mode=args["non_streaming_mode"])
    assert torch.equal(from_ids.inputs_embeds, from_texts.inputs_embeds)
    assert torch.equal(from_ids.trailing, from_texts.trailing)


def test_an_unknown_language_is_refused_naming_the_supported_ones(any_case):
    b = builder(any_case.model_dir)
    with pytest.raises(InvalidRequest, match=r"unsupported language 'Klingon'.*'auto'") as info:
        b.build("hello", language="Klingon")
    for language in b.ids.supported_languages:
        assert repr(language) in str(info.value)


def test_a_dialect_is_no_language_of_its_own(any_case):
    """Upstream leaves every `*dialect*` language id out of what a request may name."""
    ids = ModelIds.from_dir(any_case.model_dir)
    dialects = [name for name in ids.languages if "dialect" in name] or ["sichuan_dialect"]
    with pytest.raises(InvalidRequest, match="unsupported language"):
        builder(any_case.model_dir).build("hello", language=dialects[0])


def test_an_unknown_speaker_is_refused_naming_the_known_ones(case):
    b = builder(case.model_dir)
    with pytest.raises(InvalidRequest, match="unsupported speaker 'Nobody'") as info:
        b.build("hello", language="auto", speaker="Nobody")
    for speaker in b.ids.supported_speakers:
        assert repr(speaker) in str(info.value)


def test_an_icl_clone_without_its_transcript_is_refused(any_case):
    b = builder(any_case.model_dir)
    codes = torch.zeros(3, b.ids.groups, dtype=torch.int64)
    with pytest.raises(InvalidRequest, match="ref_text"):
        b.build("hello", speaker_embedding=torch.zeros(b.talker.decoder.config.hidden_size), ref_codes=codes)


def test_a_dialect_speaker_speaks_its_dialect_only_for_chinese_and_auto(case):
    """Upstream's rule, over every speaker and language of the case's model (the recorded calls cover two pairs)."""
    ids = ModelIds.from_dir(case.model_dir)
    for speaker in [None, *ids.supported_speakers]:
        dialect = ids.dialects.get(speaker) if speaker else None
        for language in ids.supported_languages:
            got = language_id(ids, language.upper(), speaker)  # names are matched in any case
            if dialect is not None and language in ("chinese", "auto"):
                assert got == ids.languages[dialect], (speaker, language)
            else:
                assert got == (None if language == "auto" else ids.languages[language]), (speaker, language)
