"""Kaldi log-mel filterbank, numerically as torchaudio.compliance.kaldi.fbank computes it.

CosyVoice's speaker embedding (CAM++) reads `fbank(speech16k, num_mel_bins=80, dither=0,
sample_frequency=16000)` with every other option at its default, then subtracts the per-bin
mean over time. Only that configuration (plus frame sizes and band edges) is supported: no
dither, povey window, pre-emphasis 0.97, DC removal, snip_edges, power spectrum, no energy.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from mizuoto.errors import InvalidRequest

_EPS = torch.finfo(torch.float32).eps  # Kaldi's log floor: numeric_limits<float>::epsilon()


def _mel(freq: Tensor) -> Tensor:
    return 1127.0 * (1.0 + freq / 700.0).log()


def _mel_scalar(freq: float) -> float:
    return 1127.0 * math.log(1.0 + freq / 700.0)


@lru_cache(maxsize=8)
def kaldi_mel_banks(num_bins: int, padded_window: int, sample_rate: float, low_freq: float, high_freq: float) -> Tensor:
    """Triangular mel weights [num_bins, padded_window//2 + 1] (last column zero), float32."""
    if num_bins <= 3:
        raise InvalidRequest("kaldi fbank needs more than 3 mel bins")
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    if not (0.0 <= low_freq < nyquist and 0.0 < high_freq <= nyquist and low_freq < high_freq):
        raise InvalidRequest(f"bad kaldi fbank band {low_freq}..{high_freq} Hz at {sample_rate} Hz")
    fft_bin_width = sample_rate / padded_window
    mel_low = _mel_scalar(low_freq)
    mel_delta = (_mel_scalar(high_freq) - mel_low) / (num_bins + 1)
    # Integer bin indices and a float arange promote to float32 here, as in torchaudio.
    bin_idx = torch.arange(num_bins).unsqueeze(1)
    left = mel_low + bin_idx * mel_delta
    center = mel_low + (bin_idx + 1.0) * mel_delta
    right = mel_low + (bin_idx + 2.0) * mel_delta
    mel = _mel(fft_bin_width * torch.arange(padded_window / 2)).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down))
    return torch.nn.functional.pad(banks, (0, 1))


@lru_cache(maxsize=8)
def _povey_window(size: int) -> Tensor:
    return torch.hann_window(size, periodic=False).pow(0.85)


def kaldi_fbank(
    waveform: Tensor,
    num_mel_bins: int = 80,
    sample_frequency: float = 16000.0,
    frame_length_ms: float = 25.0,
    frame_shift_ms: float = 10.0,
    low_freq: float = 20.0,
    high_freq: float = 0.0,
    preemphasis: float = 0.97,
) -> Tensor:
    """Log-mel fbank of mono audio [N] or [1, N] (float32, [-1, 1) scale) -> [T, num_mel_bins]."""
    if waveform.dim() == 2:
        if waveform.shape[0] != 1:
            raise InvalidRequest(f"kaldi_fbank expects mono audio, got {waveform.shape[0]} channels")
        waveform = waveform[0]
    if waveform.dim() != 1:
        raise InvalidRequest(f"kaldi_fbank expects [N] or [1, N] audio, got shape {tuple(waveform.shape)}")
    shift = int(sample_frequency * frame_shift_ms * 0.001)
    size = int(sample_frequency * frame_length_ms * 0.001)
    padded = 1 if size == 0 else 2 ** (size - 1).bit_length()
    if waveform.shape[0] < size:
        raise InvalidRequest(f"audio of {waveform.shape[0]} samples is shorter than one {size}-sample fbank frame")
    num_frames = 1 + (waveform.shape[0] - size) // shift
    frames = waveform.as_strided((num_frames, size), (shift * waveform.stride(0), waveform.stride(0)))
    frames = frames - torch.mean(frames, dim=1).unsqueeze(1)
    # Pre-emphasis with the first sample repeated, as Kaldi does.
    previous = torch.nn.functional.pad(frames.unsqueeze(0), (1, 0), mode="replicate").squeeze(0)
    frames = frames - preemphasis * previous[:, :-1]
    frames = frames * _povey_window(size).to(frames).unsqueeze(0)
    frames = torch.nn.functional.pad(frames.unsqueeze(0), (0, padded - size)).squeeze(0)
    power = torch.fft.rfft(frames).abs().pow(2.0)
    banks = kaldi_mel_banks(num_mel_bins, padded, float(sample_frequency), float(low_freq), float(high_freq))
    energies = torch.mm(power, banks.to(power).T)
    return torch.max(energies, torch.tensor(_EPS, dtype=energies.dtype, device=energies.device)).log()


def mean_normalize(feats: Tensor) -> Tensor:
    """Subtract each bin's mean over time (CosyVoice's CMN before CAM++): [T, F] -> [T, F]."""
    return feats - feats.mean(dim=0, keepdim=True)
