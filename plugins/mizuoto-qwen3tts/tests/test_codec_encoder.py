"""The 12 Hz codec encoder (Mimi's encoder half) gives upstream's reference codes for every ICL clone case."""

import json
import shutil

import pytest
import torch

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto_qwen3tts.codec_encoder import load_codec_encoder
from mizuoto_qwen3tts.weights import CONFIG, WEIGHTS

CODEC = "speech_tokenizer"


@torch.inference_mode()
def test_the_reference_clip_gives_upstreams_codes(case):
    recorded = case.tensors()
    kwargs = case.kwargs
    icl = "ref_audio" in kwargs and not kwargs.get("x_vector_only_mode", False)
    # upstream records reference codes exactly when the prompt uses them (ICL clone)
    assert ("ref_codes" in recorded) == icl, f"{case.name}: ref_codes recorded {'ref_codes' in recorded}, ICL {icl}"
    if "ref_wav_24k" not in recorded:  # no reference clip: upstream never ran its codec encoder
        assert "ref_audio" not in kwargs
        return
    encoder = load_codec_encoder(case.model_dir / CODEC)
    wav = recorded["ref_wav_24k"]
    codes = encoder.encode(wav)
    frames = -(-wav.shape[0] // encoder.samples_per_frame)
    assert codes.shape == (frames, encoder.quantizers) and codes.dtype == torch.int64
    if icl:
        case.cpu.assert_equal(codes, recorded["ref_codes"], "ref_codes", f"{case.name} ref_codes")
    # x-vector mode: upstream encodes the clip too but discards the codes (nothing recorded to compare)


def test_an_empty_clip_is_refused_as_empty(any_case):
    encoder = load_codec_encoder(any_case.model_dir / CODEC)
    with pytest.raises(InvalidRequest, match="reference audio is empty"):
        encoder.encode(torch.zeros(0))


@pytest.mark.parametrize("wav", [torch.zeros(1, 1920), torch.zeros(1920, dtype=torch.float64),
                                 torch.zeros(1920, dtype=torch.int16)], ids=["2-D", "float64", "int16"])
def test_a_clip_not_1d_float32_is_refused(any_case, wav):
    encoder = load_codec_encoder(any_case.model_dir / CODEC)
    with pytest.raises(InvalidRequest, match="1-D float32 waveform"):
        encoder.encode(wav)


@torch.inference_mode()
def test_a_clip_shorter_than_one_frame_gives_one_frame(any_case):
    encoder = load_codec_encoder(any_case.model_dir / CODEC)
    for samples in (1, encoder.samples_per_frame, encoder.samples_per_frame + 1):
        codes = encoder.encode(torch.full((samples,), 0.1))
        assert codes.shape == (-(-samples // encoder.samples_per_frame), encoder.quantizers)


def _codec_dir(case, tmp_path, edit):
    """A copy of the case's speech tokenizer dir (config and weights), its config edited by `edit(config)`."""
    source, target = case.model_dir / CODEC, tmp_path / CODEC
    target.mkdir()
    shutil.copy(source / WEIGHTS, target / WEIGHTS)
    config = json.loads((source / CONFIG).read_text(encoding="utf-8"))
    edit(config)
    (target / CONFIG).write_text(json.dumps(config), encoding="utf-8")
    return target


def test_a_config_with_wider_filters_than_the_weights_is_refused_naming_a_weight(any_case, tmp_path):
    wider = lambda c: c["encoder_config"].update(num_filters=c["encoder_config"]["num_filters"] * 2)  # noqa: E731
    with pytest.raises(ModelLoadError, match=r"encoder\.encoder\.layers\.\d+\.\S+ is \([\d, ]+\), the config makes it"):
        load_codec_encoder(_codec_dir(any_case, tmp_path, wider))


def test_more_valid_quantizers_than_the_encoder_has_are_refused(any_case, tmp_path):
    more = lambda c: c.update(encoder_valid_num_quantizers=c["encoder_config"]["num_quantizers"] + 1)  # noqa: E731
    with pytest.raises(ModelLoadError, match="encoder_valid_num_quantizers"):
        load_codec_encoder(_codec_dir(any_case, tmp_path, more))


@pytest.mark.parametrize("change", [{"use_streaming": True}, {"hidden_act": "relu"}, {"pad_mode": "circular"}],
                         ids=["streaming", "relu", "circular"])
def test_an_encoder_config_this_port_cannot_reproduce_is_refused_naming_the_field(any_case, tmp_path, change):
    with pytest.raises(ModelLoadError, match=next(iter(change))):
        load_codec_encoder(_codec_dir(any_case, tmp_path, lambda c: c["encoder_config"].update(change)))
