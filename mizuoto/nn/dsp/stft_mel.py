"""librosa 0.11's numpy STFT-magnitude mel and silence trim, bit for bit, without librosa.

Resemble's voice encoder (Real-Time-Voice-Cloning's melspec) takes `librosa.stft` of float32
audio (centred, reflect padding, scipy's periodic Hann), |.| ** power, then `np.dot` with librosa's
float32 Slaney filters, after `librosa.effects.trim`. What decides the last bits, each reproduced
here: the frames are windowed and transformed in float64 (numpy's pocketfft) and stored as
complex64; numpy's SIMD complex absolute (`exact.cabs32`). The mel product is upstream's own
call, `np.dot` (the BLAS numpy brings sums it in the order that suits the CPU, as it does for
upstream on that CPU; rebuilding one machine's order by hand equals upstream on that machine only).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mizuoto.nn.dsp.exact import cabs32, numpy1_sum
from mizuoto.nn.dsp.mel import slaney_mel_filters


@lru_cache(maxsize=8)
def hann_periodic(size: int) -> np.ndarray:
    """scipy.signal.get_window('hann', size, fftbins=True) (float64): 0.5 + 0.5 cos over a linspace."""
    n = size + 1
    step = (np.pi - -np.pi) / (n - 1)
    grid = np.arange(n, dtype=np.float64) * step + -np.pi
    grid[-1] = np.pi  # linspace sets its endpoint exactly
    window = (np.zeros(n) + 0.5 * np.cos(0 * grid)) + 0.5 * np.cos(1 * grid)
    window = window[:-1]
    window.setflags(write=False)
    return window


def _frames(y: np.ndarray, length: int, hop: int) -> np.ndarray:
    count = 1 + (len(y) - length) // hop
    return y[np.arange(length)[None, :] + hop * np.arange(count)[:, None]]


def stft_magnitude(y: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """|librosa.stft(y, n_fft, hop, center=True, pad_mode='reflect')| (bins, frames) of float32 y, float32."""
    y = np.asarray(y, dtype=np.float32)
    if y.ndim != 1 or len(y) <= n_fft // 2:
        raise ValueError(f"stft_magnitude: expected 1-D audio longer than {n_fft // 2} samples, got {y.shape}")
    padded = np.pad(y, (n_fft // 2, n_fft // 2), mode="reflect")
    windowed = hann_periodic(n_fft)[None, :] * _frames(padded, n_fft, hop)  # float64, as librosa's window
    spectrum = np.fft.rfft(windowed, axis=-1).astype(np.complex64)  # librosa stores complex64 for float32 input
    return cabs32(spectrum).T


def mel_from_power(power: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """filters (mels, bins) @ power (bins, frames) in float32: upstream's own call, `np.dot`."""
    return np.dot(np.asarray(filters, dtype=np.float32), np.asarray(power, dtype=np.float32))


def stft_mel(y: np.ndarray, rate: int, n_fft: int, hop: int, n_mels: int, fmin: float = 0.0,
             fmax: float | None = None, power: float = 2.0) -> np.ndarray:
    """The (mels, frames) float32 mel of float32 audio: np.dot(librosa mel filters, |stft| ** power)."""
    magnitude = stft_magnitude(y, n_fft, hop)
    if power == 2.0:
        magnitude = np.square(magnitude)  # numpy's `**= 2` on float32 is a square
    elif power != 1.0:
        magnitude = magnitude ** np.float32(power)
    filters = slaney_mel_filters(rate, n_fft, n_mels, fmin, fmax).numpy()
    return mel_from_power(magnitude, filters)


def frame_rms(y: np.ndarray, frame_length: int, hop: int) -> np.ndarray:
    """librosa.feature.rms(y=y) (frames,) of float32 y: zero-padded centred frames, float32 mean square."""
    y = np.asarray(y, dtype=np.float32)
    padded = np.pad(y, (frame_length // 2, frame_length // 2))
    squares = np.square(_frames(padded, frame_length, hop))
    return np.sqrt(numpy1_sum(squares) / np.float32(frame_length)).astype(np.float32)


def _log10_32(x: np.ndarray) -> np.ndarray:
    # numpy 1.x takes float32 log10 from SVML on AVX-512 CPUs; float64 log10 rounded to float32 agrees
    # but for ties, and only matters here where a frame lies within an ulp of the threshold
    return np.log10(np.asarray(x, dtype=np.float64)).astype(np.float32)


def trim_silence(y: np.ndarray, top_db: float = 60, frame_length: int = 2048, hop: int = 512) -> tuple[int, int]:
    """librosa.effects.trim's (start, end): the span of frames within top_db of the loudest frame's RMS."""
    rms = frame_rms(y, frame_length, hop)
    power = np.square(rms)
    ref = np.float32(np.max(rms)) ** 2
    # amplitude_to_db(ref=np.max, top_db=None): float32 dB of each frame less the float64 dB of the peak
    db = np.float32(10.0) * _log10_32(np.maximum(np.float32(1e-10), power))
    db = db - np.float32(10.0 * np.log10(max(1e-5 ** 2, float(ref))))
    loud = np.flatnonzero(db > -top_db)
    if loud.size == 0:
        return 0, 0
    return int(loud[0]) * hop, min(len(y), int(loud[-1] + 1) * hop)
