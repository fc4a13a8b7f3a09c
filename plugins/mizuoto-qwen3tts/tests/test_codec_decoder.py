"""The 12 Hz codec decoder gives upstream's waveform: every case's codes, the chunked path and its streaming.

Per case: with reference codes (ICL clone) upstream decodes the reference frames ahead of the new
ones (`decoder_wav`), and returns what follows its cut (`wav`); without, the decoded codes are the
returned `wav` itself (clamped to [-1, 1], (codes[:, 0] > -1) frames x 1920 samples).
"""

import json
import shutil

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.codec_decoder import CHUNK_FRAMES, LEFT_CONTEXT_FRAMES, chunk_windows, load_codec_decoder
from mizuoto_qwen3tts.weights import CONFIG, WEIGHTS

CODEC = "speech_tokenizer"


def _random_codes(decoder, frames: int, seed: int = 0) -> torch.Tensor:
    """Codes [frames, quantizers] drawn from the decoder's codebooks."""
    size = decoder.quantizer.semantic.codebooks[0].cluster_usage.shape[0]
    return torch.randint(0, size, (frames, decoder.num_quantizers), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_the_decoder_gives_upstreams_waveform(case):
    decoder = load_codec_decoder(case.model_dir / CODEC)
    recorded = case.tensors()
    codes = recorded["codes"]
    if "ref_codes" in recorded:
        ref = recorded["ref_codes"]
        full = torch.cat([ref, codes])
        ours = decoder.decode(full)
        case.cpu.assert_equal(ours, recorded["decoder_wav"], "decoder_wav", f"{case.name} decoder_wav")
        # upstream's ICL trimming (Python float arithmetic) leaves the returned wav
        cut = int(ref.shape[0] / max(full.shape[0], 1) * ours.shape[0])
        case.cpu.assert_equal(ours[cut:], recorded["wav"], "wav", f"{case.name} wav (after the reference)")
        return
    assert "decoder_wav" not in recorded  # without a reference the decoder's output is `wav` itself
    if codes.shape[0] == 0:  # upstream's chunked decode has no window to concatenate and fails
        with pytest.raises(ValueError, match="no frames"):
            decoder.decode(codes)
        return
    case.cpu.assert_equal(decoder.decode(codes), recorded["wav"], "wav", f"{case.name} wav")


def test_the_sizes_come_from_the_speech_tokenizers_config(any_case):
    decoder = load_codec_decoder(any_case.model_dir / CODEC)
    config = json.loads((any_case.model_dir / CODEC / CONFIG).read_text(encoding="utf-8"))
    assert decoder.samples_per_frame == config["decode_upsample_rate"]
    assert decoder.sample_rate == config["output_sample_rate"]
    assert decoder.num_quantizers == config["decoder_config"]["num_quantizers"]
    with pytest.raises(ValueError, match="no frames"):
        decoder.decode(torch.zeros(0, decoder.num_quantizers, dtype=torch.long))


@torch.inference_mode()
def test_a_long_sequence_is_decoded_window_by_window_as_upstreams_chunked_decode(any_case):
    """Beyond one chunk, upstream decodes windows independently; written out here from its arithmetic.

    No recording covers this path (every recorded case fits one chunk), so the expectation is
    upstream's `chunked_decode` transcribed: new frames [0, C), [C, 2C), [2C, T), each window
    decoded by one forward after LEFT_CONTEXT_FRAMES frames of context (none before the first),
    whose samples are dropped; codes clamped at 0 first; the result cut to (codes[:, 0] > -1)
    frames. (Checked by hand against upstream itself in the reference venv, 330 and 620 frames,
    on both CPU classes: equal.)
    """
    decoder = load_codec_decoder(any_case.model_dir / CODEC)
    c, ctx, spf = CHUNK_FRAMES, LEFT_CONTEXT_FRAMES, decoder.total_upsample
    frames = 2 * c + 40
    codes = _random_codes(decoder, frames)
    codes[c + 7, 3] = -1  # clamped to 0 before decoding
    codes[-2:, 0] = -1  # padding: not counted in the length
    assert chunk_windows(frames) == [(0, c, 0), (c, 2 * c, ctx), (2 * c, frames, ctx)]

    def window(start, end, context):
        wav = decoder(torch.clamp(codes[start - context:end], min=0).T.unsqueeze(0))
        return wav[0, 0, context * spf:]
    expected = torch.cat([window(0, c, 0), window(c, 2 * c, ctx), window(2 * c, frames, ctx)])
    expected = expected[: (frames - 2) * decoder.samples_per_frame]
    ours = decoder.decode(codes)
    assert torch.equal(ours, expected)
    # the windows matter: one forward over the whole sequence is another waveform
    whole = decoder(torch.clamp(codes, min=0).T.unsqueeze(0))[0, 0, : ours.shape[0]]
    assert not torch.equal(ours, whole)


@torch.inference_mode()
def test_a_chunk_is_final_once_its_last_frame_exists(any_case):
    """Streaming at upstream's chunk granularity is exact: later frames never change a completed chunk's samples."""
    decoder = load_codec_decoder(any_case.model_dir / CODEC)
    c, spf = CHUNK_FRAMES, decoder.samples_per_frame
    codes = _random_codes(decoder, c + LEFT_CONTEXT_FRAMES + 10, seed=1)
    whole = decoder.decode(codes)
    first = decoder.decode(codes[:c])  # all that exists when frame c - 1 is generated
    assert torch.equal(first, whole[: c * spf])
    (_, _, _), (start, end, context) = chunk_windows(codes.shape[0])
    assert torch.equal(decoder.decode_window(codes[start - context:end], context), whole[start * spf:])


def _codec_dir(case, tmp_path, edit):
    """A copy of the case's speech tokenizer, its config edited by `edit(config)`."""
    target = tmp_path / CODEC
    target.mkdir()
    shutil.copy(case.model_dir / CODEC / WEIGHTS, target / WEIGHTS)
    config = json.loads((case.model_dir / CODEC / CONFIG).read_text(encoding="utf-8"))
    edit(config)
    (target / CONFIG).write_text(json.dumps(config), encoding="utf-8")
    return target


def test_a_config_with_more_transformer_layers_than_the_weights_is_refused(any_case, tmp_path):
    deeper = lambda c: c["decoder_config"].update(  # noqa: E731
        num_hidden_layers=c["decoder_config"]["num_hidden_layers"] + 1)
    with pytest.raises(ModelLoadError, match=r"missing \['pre_transformer\.layers\.\d+\."):
        load_codec_decoder(_codec_dir(any_case, tmp_path, deeper))


def test_a_codebook_of_another_width_is_refused_naming_it(any_case, tmp_path):
    wider = lambda c: c["decoder_config"].update(codebook_dim=c["decoder_config"]["codebook_dim"] * 2)  # noqa: E731
    with pytest.raises(ModelLoadError, match=r"decoder\.\S+ is \(\d+(, \d+)*\), the config makes it"):
        load_codec_decoder(_codec_dir(any_case, tmp_path, wider))


def test_a_tokenizer_without_a_decoder_config_is_refused(any_case, tmp_path):
    with pytest.raises(ModelLoadError, match="no decoder_config"):
        load_codec_decoder(_codec_dir(any_case, tmp_path, lambda c: c.pop("decoder_config")))
