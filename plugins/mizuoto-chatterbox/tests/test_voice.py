"""A voice's conditioning against upstream: the preset's tensors, and the voice encoder on a clone's mel."""

import pytest
import torch

from mizuoto_chatterbox.voice import VE_RATE, load_preset, load_voice_encoder


def test_preset_voice_is_what_upstream_conditioned_on(case):
    if case.spec["mode"] != "preset":
        assert case.spec["reference_clip"], "a case is a preset or a clone"
        return
    ref = case.tensors()
    voice = load_preset(case.model_dir / "conds.pt")
    case.assert_equal(voice.speaker_emb, "t3_cond_speaker_emb")
    case.assert_equal(voice.prompt_tokens, "t3_cond_prompt_speech_tokens")
    if "s3gen_prompt_token" in ref:  # a case upstream failed in has no S3Gen inputs
        case.assert_equal(voice.gen_prompt_token, "s3gen_prompt_token")
        case.assert_equal(voice.gen_prompt_feat, "s3gen_prompt_feat")
        case.assert_equal(voice.gen_embedding, "s3gen_embedding")


def test_voice_encoder_embeds_a_clones_mel_as_upstream(case):
    ref = case.tensors()
    if case.spec["mode"] != "clone":
        assert "ve_mel" not in ref
        return
    encoder = load_voice_encoder(case.model_dir / "ve.safetensors")
    case.assert_equal(encoder.embed(ref["ve_mel"], rate=VE_RATE), "t3_cond_speaker_emb")


def test_a_foreign_preset_is_refused_with_its_path(tmp_path):
    from mizuoto.errors import ModelLoadError

    bad = tmp_path / "conds.pt"
    torch.save({"t3": {}}, bad)
    with pytest.raises(ModelLoadError, match="conds.pt"):
        load_preset(bad)


def test_s3gen_prompt_mel_of_a_clone_equals_upstreams(case):
    from mizuoto_chatterbox.voice import prompt_mel

    ref = case.tensors()
    if case.spec["mode"] != "clone":
        assert "s3gen_ref_wav" not in ref
        return
    case.assert_equal(prompt_mel(ref["s3gen_ref_wav"]), "s3gen_prompt_feat")


def test_t3_prompt_tokens_of_a_clone_equal_upstreams(case):
    from mizuoto_chatterbox.voice import load_s3_tokenizer, prompt_tokens

    ref = case.tensors()
    if case.spec["mode"] != "clone":
        return
    tokenizer = load_s3_tokenizer(case.model_dir)
    turbo = case.spec["class"] == "ChatterboxTurboTTS"
    case.assert_equal(prompt_tokens(tokenizer, ref["clip_wav_16k"], turbo), "t3_cond_prompt_speech_tokens")
