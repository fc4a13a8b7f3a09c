"""A clone clip's front against upstream: loading, resampling, Turbo's loudness gain, the voice encoder's mel."""

import numpy as np
import pytest
import torch

from mizuoto_chatterbox.clip import load_clip, ve_mel
from mizuoto_chatterbox.voice import VE_RATE, load_voice_encoder

CLONE_KEYS = ("clip_wav_16k", "s3gen_ref_wav", "ve_mel")


def _turbo(case) -> bool:
    return case.spec["class"] == "ChatterboxTurboTTS"


def _clip(case):
    return case.path.parents[1] / case.spec["reference_clip"]  # case.json paths are relative to the tree's root


def _load(case, source):
    """load_clip as the case's generate call asked (Turbo's norm_loudness, upstream's default when unrecorded)."""
    return load_clip(source, _turbo(case), case.spec["generate_kwargs"].get("norm_loudness", True))


def test_clip_front_equals_upstreams(case):
    ref = case.tensors()
    if case.spec["mode"] != "clone":
        assert not set(CLONE_KEYS) & set(ref), "a preset case records no clip front"
        return
    wav_16k, wav_24k = _load(case, _clip(case))
    case.assert_equal(wav_16k, "clip_wav_16k")
    case.assert_equal(wav_24k, "s3gen_ref_wav")
    case.assert_equal(ve_mel(wav_16k), "ve_mel")


def test_voice_encoder_embedding_of_a_clip_equals_upstreams(case):
    ref = case.tensors()
    if case.spec["mode"] != "clone":
        return
    wav_16k, _ = _load(case, _clip(case))
    encoder = load_voice_encoder(case.model_dir / "ve.safetensors")
    case.assert_equal(encoder.embed(ve_mel(wav_16k), rate=VE_RATE), "t3_cond_speaker_emb")


def test_a_clip_given_as_samples_equals_the_file(case):
    if case.spec["mode"] != "clone":
        return
    import soundfile as sf

    samples, rate = sf.read(str(_clip(case)), dtype="float32", always_2d=True)
    from_file = _load(case, _clip(case))
    from_samples = _load(case, (samples.T, rate))
    assert all(torch.equal(a, b) for a, b in zip(from_file, from_samples))


def test_turbo_refuses_a_clip_of_five_seconds_or_less():
    from mizuoto.errors import AudioError

    with pytest.raises(AudioError, match="longer than 5 s"):
        load_clip((np.zeros(5 * 24000, np.float32), 24000), turbo=True)
