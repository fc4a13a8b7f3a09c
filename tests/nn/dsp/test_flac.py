"""FLAC writing; FLAC reads through the same decoder as WAV."""

import pytest
import soundfile as sf
import torch

from mizuoto.nn.dsp import flac_bytes, load_wav, read_audio, write_flac
from mizuoto.errors import AudioError


@pytest.mark.parametrize("bits", [16, 24])
def test_flac_round_trip_is_exact(tmp_path, bits):
    """Lossless: samples on the bit-depth grid come back bit for bit, stereo kept."""
    scale = 2 ** (bits - 1)
    g = torch.Generator().manual_seed(bits)
    x = torch.randint(-scale, scale, (2, 4801), generator=g).float() / scale
    path = tmp_path / f"x{bits}.flac"
    write_flac(path, x, 24000, bits=bits)
    info = sf.info(str(path))
    assert (info.format, info.subtype, info.samplerate) == ("FLAC", f"PCM_{bits}", 24000)
    y, rate = read_audio(path)
    assert rate == 24000 and torch.equal(y, x)
    assert torch.equal(read_audio(flac_bytes(x, 24000, bits))[0], x)
    assert torch.equal(load_wav(path, 24000), x.mean(dim=0, keepdim=True))


def test_flac_of_a_fixture_clip_loads_like_the_wav(clip, wav_path, refs, tmp_path):
    """A clip re-encoded as FLAC decodes to the same reference audio."""
    audio, rate = read_audio(wav_path)
    write_flac(tmp_path / "c.flac", audio, rate)
    assert torch.equal(load_wav(tmp_path / "c.flac", rate)[0], refs["audio"])


def test_bad_flac_arguments_and_files(tmp_path):
    with pytest.raises(AudioError, match="bit depth"):
        flac_bytes(torch.zeros(10), 16000, bits=32)
    bad = tmp_path / "bad.flac"
    bad.write_bytes(b"fLaC" + b"\x00" * 64)
    with pytest.raises(AudioError, match="bad.flac"):
        read_audio(bad)
