"""Audio DSP blocks numerically equal to upstream CosyVoice's front end: file IO, resampling, mels, fbank."""

from mizuoto.nn.dsp.flac import flac_bytes, write_flac
from mizuoto.nn.dsp.kaldi import kaldi_fbank, mean_normalize
from mizuoto.nn.dsp.mel import MatchaMelConfig, matcha_mel, slaney_mel_filters, whisper_log_mel
from mizuoto.nn.dsp.resample import resample, resampled_length
from mizuoto.nn.dsp.wav import load_wav, read_audio, to_mono, wav_bytes, write_wav

__all__ = [
    "MatchaMelConfig",
    "flac_bytes",
    "kaldi_fbank",
    "load_wav",
    "matcha_mel",
    "mean_normalize",
    "read_audio",
    "resample",
    "resampled_length",
    "slaney_mel_filters",
    "to_mono",
    "wav_bytes",
    "whisper_log_mel",
    "write_flac",
    "write_wav",
]
