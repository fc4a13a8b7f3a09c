"""WAV reading as upstream's load_wav (soundfile decode, channel mean, sinc resample), writing, bad input."""

import numpy as np
import pytest
import soundfile as sf
import torch

from mizuoto.nn.dsp import load_wav, read_audio, to_mono, wav_bytes, write_wav
from mizuoto.nn.dsp.wav import to_pcm16
from mizuoto.errors import AudioError
from mizuoto.testing.cpu_recordings import FRONT_END, tree_comparison



def test_clip_decodes_to_reference_audio(clip, clip_info, wav_path, refs):
    """The decoded file is the recorded float32 audio (int16 / 32768), bit for bit."""
    audio, rate = read_audio(wav_path)
    assert rate == clip_info["sample_rate"]
    assert audio.shape[-1] == clip_info["num_samples"]
    assert torch.equal(to_mono(audio)[0], refs["audio"])


def test_load_wav_matches_upstream_at_every_recorded_rate(clip, clip_info, wav_path, refs, parse_rate):
    """load_wav(path, rate) equals upstream's load_wav for the native rate and every recorded resampling.

    The decoded samples (int16 / 32768) are equal on every CPU; a resampling is equal on the class
    the references were recorded on, else within the front end's measured spread (cpu_recordings).
    """
    assert torch.equal(load_wav(wav_path, clip_info["sample_rate"])[0], refs["audio"])
    for name in (n for n in refs if n.startswith("resampled_")):
        ours = load_wav(wav_path, parse_rate(name[len("resampled_"):]))
        assert ours.shape == (1, refs[name].shape[0]), name
        tree_comparison("frontend").assert_equal(ours[0], refs[name], FRONT_END, f"{clip} {name}")


def _pcm16(n: int, channels: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, (channels, n), generator=g).float() / 32768


@pytest.mark.parametrize("subtype,scale", [("PCM_16", 2**15), ("PCM_24", 2**23), ("FLOAT", None)])
def test_wav_round_trip_is_exact(tmp_path, subtype, scale):
    """Samples on the format's grid come back bit for bit (PCM 16/24-bit, float), stereo kept."""
    g = torch.Generator().manual_seed(1)
    if scale is None:
        x = torch.rand(2, 3001, generator=g) * 2 - 1
    else:
        x = torch.randint(-scale, scale, (2, 3001), generator=g).float() / scale
    path = tmp_path / f"x_{subtype}.wav"
    write_wav(path, x, 22050, subtype)
    assert sf.info(str(path)).subtype == subtype
    y, rate = read_audio(path)
    assert rate == 22050 and torch.equal(y, x)
    assert torch.equal(read_audio(wav_bytes(x, 22050, subtype))[0], x)


def test_pcm_quantization_rounds_and_clips(tmp_path):
    """Off-grid floats are rounded to the nearest step; out-of-range samples clip to full scale."""
    x = torch.tensor([0.1, -0.1, 1.5, -1.5, 1.0, -1.0, 0.99999])
    write_wav(tmp_path / "q.wav", x, 16000)
    y = read_audio(tmp_path / "q.wav")[0][0]
    expected = torch.tensor([3277, -3277, 32767, -32768, 32767, -32768, 32767]) / 32768
    assert torch.equal(y, expected.float())


def test_to_pcm16_rounds_half_to_even_and_reads_back_within_half_a_step():
    """to_pcm16 is rint(x * 32768) clipped; soundfile reads it as int16 / 32768, within half a step of x."""
    ties = np.array([0.5, 1.5, -0.5, -2.5, 32767.5, 40000, -32768.5]) / 32768
    x = np.concatenate([np.random.default_rng(0).uniform(-1.1, 1.1, 20000), ties]).astype(np.float32)
    q = np.frombuffer(to_pcm16(x), "<i2")
    assert q[-len(ties):].tolist() == [0, 2, 0, -2, 32767, 32767, -32768]
    assert torch.equal(read_audio(wav_bytes(x, 16000))[0][0], torch.from_numpy(q / np.float32(32768)))
    inside = (x >= -32768.5 / 32768) & (x <= 32767.5 / 32768)
    assert np.abs(q[inside] / 32768 - x[inside].astype(np.float64)).max() <= 0.5 / 32768
    assert (q[x > 1] == 32767).all() and (q[x < -1] == -32768).all()
    assert to_pcm16(torch.from_numpy(x)) == to_pcm16(x)


def test_stereo_is_mixed_by_mean(tmp_path):
    """Multi-channel files become the channel mean, as upstream's speech.mean(dim=0)."""
    x = _pcm16(4000, channels=2)
    write_wav(tmp_path / "st.wav", x, 16000)
    assert torch.equal(load_wav(tmp_path / "st.wav", 16000), x.mean(dim=0, keepdim=True))


def test_load_wav_accepts_arrays_and_bytes(tmp_path):
    x = _pcm16(4800)[0]
    data = wav_bytes(x, 24000)
    from_bytes = load_wav(data, 16000)
    assert torch.equal(load_wav(x, 16000, source_rate=24000), from_bytes)
    assert torch.equal(load_wav(x.numpy(), 16000, source_rate=24000), from_bytes)
    assert from_bytes.shape == (1, 3200)
    with pytest.raises(AudioError, match="source_rate"):
        load_wav(x, 16000)


# --- bad input: each a clear AudioError naming the problem -------------------------------------


def test_corrupt_wav_is_an_audio_error(tmp_path):
    good = wav_bytes(_pcm16(1600)[0], 16000)
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(good[:12] + b"\xff" * 40)  # RIFF/WAVE tag, then garbage chunks
    with pytest.raises(AudioError, match="corrupt.wav"):
        load_wav(corrupt, 16000)


def test_non_audio_file_is_an_audio_error(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio\n" * 20)
    with pytest.raises(AudioError, match="cannot decode audio .*notes.wav"):
        read_audio(text)
    with pytest.raises(AudioError, match="not found"):
        read_audio(tmp_path / "missing.wav")


def test_zero_length_wav_is_an_audio_error(tmp_path):
    empty_file = tmp_path / "empty.wav"
    empty_file.write_bytes(b"")
    with pytest.raises(AudioError, match="empty"):
        load_wav(empty_file, 16000)
    no_frames = tmp_path / "no_frames.wav"
    sf.write(str(no_frames), np.zeros(0, dtype=np.int16), 16000, subtype="PCM_16")
    with pytest.raises(AudioError, match="no samples"):
        load_wav(no_frames, 16000)
    with pytest.raises(AudioError):
        load_wav(torch.zeros(0), 16000, source_rate=16000)


def test_8khz_wav_where_16khz_is_needed_is_an_audio_error(tmp_path):
    """Upstream asserts a source rate of at least 16 kHz before resampling; we refuse clearly."""
    path = tmp_path / "phone.wav"
    write_wav(path, _pcm16(8000)[0], 8000)
    with pytest.raises(AudioError, match=r"8000 Hz.*16000 Hz"):
        load_wav(path, 16000)
    with pytest.raises(AudioError, match=r"8000 Hz"):
        load_wav(path, 24000)
    assert load_wav(path, 8000).shape == (1, 8000)  # no resampling needed: allowed, as upstream


def test_non_finite_samples_are_an_audio_error(tmp_path):
    path = tmp_path / "nan.wav"
    sf.write(str(path), np.array([0.0, np.nan, 0.5], dtype=np.float32), 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN"):
        read_audio(path)


def test_bad_write_arguments_are_audio_errors(tmp_path):
    with pytest.raises(AudioError, match="subtype"):
        write_wav(tmp_path / "x.wav", torch.zeros(10), 16000, subtype="PCM_12")
    with pytest.raises(AudioError, match="floating-point"):
        write_wav(tmp_path / "x.wav", torch.zeros(10, dtype=torch.int16), 16000)
    assert not (tmp_path / "x.wav").exists()
