"""Mel spectrograms: Whisper's log-mel (speech tokenizer input) and Matcha's log-mel (prompt mel).

Both use the Slaney mel filterbank built step for step as librosa 0.11's filters.mel (htk=False,
norm='slaney', float32 output): ramps in float64, rounded to float32, then scaled by the
float64 Slaney norm and rounded again. Computed here, not shipped: it equals Whisper's
`mel_filters.npz` (80 and 128 bins) bit for bit. The STFTs and products are upstream's torch
calls; their float32 rounding depends on the code path MKL takes on the CPU (see the tests).
Pass audio as [1, N], as upstream does: MKL may round a batch differently from single rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from mizuoto.errors import InvalidRequest, ModelLoadError

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160

# Slaney's mel scale: linear below 1 kHz, logarithmic above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    mel = hz / _F_SP
    if hz >= _MIN_LOG_HZ:
        mel = _MIN_LOG_MEL + np.log(hz / _MIN_LOG_HZ) / _LOGSTEP
    return mel


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = _F_SP * mels
    log_t = mels >= _MIN_LOG_MEL
    hz[log_t] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels[log_t] - _MIN_LOG_MEL))
    return hz


@lru_cache(maxsize=16)
def _slaney_filters_np(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    # Round to float32 before the norm, as librosa fills a float32 array and then scales it.
    weights = np.maximum(0, np.minimum(lower, upper)).astype(np.float32)
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, None]
    weights.setflags(write=False)
    return weights


def slaney_mel_filters(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> Tensor:
    """The [n_mels, n_fft//2 + 1] float32 Slaney filterbank of librosa.filters.mel."""
    fmax = float(sr) / 2 if fmax is None else float(fmax)
    return torch.from_numpy(_slaney_filters_np(int(sr), int(n_fft), int(n_mels), float(fmin), fmax).copy())


@lru_cache(maxsize=16)
def _filters_on(
    sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None, device: torch.device, dtype: torch.dtype
) -> Tensor:
    # The float32 filterbank is what upstream multiplies with; other dtypes get the same values.
    return slaney_mel_filters(sr, n_fft, n_mels, fmin, fmax).to(device=device, dtype=dtype)


@lru_cache(maxsize=8)
def _hann(win: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    # Upstream builds the float32 periodic window on the CPU and moves it.
    return torch.hann_window(win).to(device=device, dtype=dtype)


def whisper_log_mel(audio: Tensor, n_mels: int) -> Tensor:
    """Whisper's log-mel of 16 kHz audio [..., N] -> [..., n_mels, N // 160] (float32)."""
    if audio.shape[-1] == 0:
        raise InvalidRequest("whisper_log_mel: empty audio")
    window = _hann(WHISPER_N_FFT, audio.device, audio.dtype)
    stft = torch.stft(audio, WHISPER_N_FFT, WHISPER_HOP, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    filters = _filters_on(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels, 0.0, None, audio.device, audio.dtype)
    log_spec = torch.clamp(filters @ magnitudes, min=1e-10).log10()
    # The dynamic-range floor is taken over the whole tensor, batch included, as upstream.
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


@dataclass(frozen=True)
class MatchaMelConfig:
    """Arguments of Matcha's mel_spectrogram, as a model yaml's `feat_extractor` gives them."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float = 0.0
    fmax: float | None = None
    center: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "MatchaMelConfig":
        """Build from the yaml's feat_extractor keyword arguments (unknown or missing keys are an error)."""
        extra = set(kwargs) - set(cls.__dataclass_fields__)
        if extra:
            raise ModelLoadError(f"feat_extractor has unknown arguments: {sorted(extra)}")
        try:
            return cls(**dict(kwargs))
        except TypeError as e:
            raise ModelLoadError(f"feat_extractor arguments incomplete: {e}") from None


def matcha_mel(y: Tensor, config: MatchaMelConfig) -> Tensor:
    """Matcha-TTS mel_spectrogram of y [B, N] (or [N]) -> natural-log mel [B, num_mels, frames] (or unbatched)."""
    if y.dim() == 1:
        return matcha_mel(y.unsqueeze(0), config)[0]
    c = config
    if c.center:
        raise InvalidRequest("matcha_mel: center=True is not used by any CosyVoice model")
    pad = int((c.n_fft - c.hop_size) / 2)
    if y.shape[-1] <= pad:
        raise InvalidRequest(f"matcha_mel: audio of {y.shape[-1]} samples is too short (needs > {pad})")
    y = torch.nn.functional.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(
        y,
        c.n_fft,
        hop_length=c.hop_size,
        win_length=c.win_size,
        window=_hann(c.win_size, y.device, y.dtype),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    spec = torch.view_as_real(spec)
    spec = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    fmax = None if c.fmax is None else float(c.fmax)
    basis = _filters_on(c.sampling_rate, c.n_fft, c.num_mels, float(c.fmin), fmax, y.device, y.dtype)
    return torch.log(torch.clamp(torch.matmul(basis, spec), min=1e-5))
