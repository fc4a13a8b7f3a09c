"""librosa 0.11's `load` and `resample` (res_type 'soxr_hq', its default) through python-soxr, without librosa.

librosa decodes with soundfile to float32, averages channels with np.mean, and resamples each
signal with `soxr.resample(y, orig, new, quality='soxr_hq')` (float32 in, float32 out, libsoxr's
HQ), then pads with zeros or cuts to ceil(len * new / orig). Calling the same soxr build gives the
same samples. soxr is imported on use: only engines that need librosa's resampling depend on it.
"""

from __future__ import annotations


import numpy as np

from mizuoto.errors import AudioError
from mizuoto.nn.dsp.wav import AudioSource, read_audio


def soxr_resample(y: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """librosa.resample(y, orig_sr, target_sr) of float audio (N,), soxr HQ, in y's dtype."""
    y = np.asarray(y)
    if orig_rate == new_rate:
        return y
    try:
        import soxr
    except ImportError as exc:  # a declared dependency of the engines that call this
        raise AudioError(f"resampling {orig_rate} -> {new_rate} Hz needs the soxr package: {exc}") from None
    size = int(np.ceil(y.shape[-1] * (float(new_rate) / orig_rate)))  # librosa's fix_length target
    out = soxr.resample(np.ascontiguousarray(y), orig_rate, new_rate, quality="soxr_hq")
    out = out[:size] if len(out) >= size else np.pad(out, (0, size - len(out)))
    return np.asarray(out, dtype=y.dtype)


def to_mono_numpy(audio: np.ndarray) -> np.ndarray:
    """librosa.to_mono of float32 (channels, N): np.mean over the channels (float32), (N,) unchanged."""
    audio = np.asarray(audio)
    return audio if audio.ndim == 1 else np.mean(audio, axis=tuple(range(audio.ndim - 1)))


def load_resampled(source: AudioSource | tuple[np.ndarray, int], rate: int) -> np.ndarray:
    """librosa.load(source, sr=rate): mono float32 (N,) at rate, from a file or (samples, rate)."""
    if isinstance(source, tuple):
        samples, native = source
        samples = np.asarray(samples.detach().cpu().numpy() if hasattr(samples, "detach") else samples)
        if not np.issubdtype(samples.dtype, np.floating) or samples.ndim not in (1, 2) or samples.shape[-1] == 0:
            raise AudioError(f"expected float samples shaped (N,) or (channels, N), got {samples.dtype} "
                             f"{samples.shape}")
        if not np.isfinite(samples).all():
            raise AudioError("audio contains NaN or infinite samples")
        audio = samples.astype(np.float32)
    else:
        decoded, native = read_audio(source)  # soundfile's float32, as librosa's SoundFile.read
        audio = decoded.numpy()  # (channels, N), a transposed view as librosa's `.T`
        if audio.shape[0] == 1:
            audio = audio[0]
    if not (isinstance(native, (int, np.integer)) or float(native).is_integer()) or native <= 0:
        raise AudioError(f"invalid sample rate {native}")
    return soxr_resample(to_mono_numpy(audio), int(native), rate)
