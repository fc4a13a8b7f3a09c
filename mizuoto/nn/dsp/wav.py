"""Reading audio files and writing WAV, through soundfile (libsndfile).

Reading follows upstream's `load_wav` (cosyvoice.utils.file_utils): `torchaudio.load(path,
backend='soundfile')` decodes to float32 [C, N] (PCM scaled by 1/2^(bits-1), so int16 / 32768),
the channels are averaged to [1, N], and audio at another rate is resampled with torchaudio's
sinc resampler, which upstream only allows from 16 kHz or more.

Writing quantizes floats to PCM itself (`quantize_pcm`: rint(x * 2^(bits-1)), clipped), so that a
PCM file we write reads back exactly to the samples that produced it; libsndfile's own float-to-PCM
conversion scales by 2^(bits-1) - 1, the inverse of nothing it reads. `to_pcm16` is the same
rounding as raw bytes: the server's wav/pcm bodies and Wyoming's chunks use it, so they carry the
same PCM as a PCM_16 file written here.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile as sf
import torch
from torch import Tensor

from mizuoto.nn.dsp.resample import resample
from mizuoto.files import atomic_write_bytes
from mizuoto.errors import AudioError

AudioSource = Union[str, os.PathLike, bytes, BinaryIO]
AudioArray = Union[Tensor, np.ndarray]

MIN_RESAMPLE_RATE = 16000  # upstream asserts the source rate is at least this before resampling
WAV_SUBTYPES = ("PCM_16", "PCM_24", "FLOAT")


def _describe(source: object) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    name = getattr(source, "name", None)
    return str(name) if isinstance(name, (str, os.PathLike)) else f"<{type(source).__name__}>"


def read_audio(source: AudioSource) -> tuple[Tensor, int]:
    """Decode a WAV/FLAC/... file, bytes or file object to float32 [C, N] in [-1, 1) and its rate."""
    name = _describe(source)
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_file():
            raise AudioError(f"audio file not found: {name}")
        if Path(source).stat().st_size == 0:
            raise AudioError(f"audio file {name} is empty (0 bytes)")
    if isinstance(source, bytes) and not source:
        raise AudioError("audio data is empty (0 bytes)")
    data = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        samples, rate = sf.read(data, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        reason = getattr(e, "error_string", None) or str(e)
        raise AudioError(f"cannot decode audio {name}: {reason}") from None
    if samples.shape[0] == 0 or samples.shape[1] == 0:
        raise AudioError(f"audio {name} contains no samples")
    if not np.isfinite(samples).all():
        raise AudioError(f"audio {name} contains NaN or infinite samples")
    return torch.from_numpy(samples).t(), int(rate)


def to_mono(audio: Tensor) -> Tensor:
    """Average the channels of [C, N] audio to [1, N], as upstream's load_wav does."""
    if audio.dim() == 1:
        return audio.unsqueeze(0)
    return audio.mean(dim=0, keepdim=True)


def _as_tensor(audio: AudioArray, name: str) -> Tensor:
    t = torch.from_numpy(np.asarray(audio)) if isinstance(audio, np.ndarray) else audio
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise AudioError(f"{name}: expected floating-point samples, got {getattr(t, 'dtype', type(t))}")
    if t.dim() not in (1, 2) or t.shape[-1] == 0:
        raise AudioError(f"{name}: expected audio shaped [N] or [C, N] with N > 0, got {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise AudioError(f"{name}: audio contains NaN or infinite samples")
    return t.to(torch.float32)


def load_wav(source: AudioSource | AudioArray, target_rate: int, source_rate: int | None = None) -> Tensor:
    """Load mono float32 audio [1, N] at target_rate, as upstream load_wav (mean of channels, sinc resample).

    `source` is a file path, bytes, a file object, or an array [N] / [C, N] whose rate is
    `source_rate`. Resampling from a rate below 16 kHz is refused, as upstream asserts.
    """
    if isinstance(source, (Tensor, np.ndarray)):
        if source_rate is None:
            raise AudioError("load_wav: an audio array needs its source_rate")
        name = f"<{type(source).__name__} at {source_rate} Hz>"
        speech, rate = to_mono(_as_tensor(source, name)), int(source_rate)
    else:
        name = _describe(source)
        audio, rate = read_audio(source)
        speech = to_mono(audio)
    if rate != target_rate:
        if rate < MIN_RESAMPLE_RATE:
            raise AudioError(
                f"audio {name} is sampled at {rate} Hz; at least {MIN_RESAMPLE_RATE} Hz is needed "
                f"to resample it to {target_rate} Hz"
            )
        speech = resample(speech, rate, target_rate)
    return speech


def quantize_pcm(samples: np.ndarray, bits: int) -> np.ndarray:
    """Float samples -> int16 (16 bits) or left-justified int32 (24 bits): the one float-to-PCM rounding.

    x * 2^(bits-1), rounded half to even (np.rint), clipped to [-2^(bits-1), 2^(bits-1) - 1]. The
    scale is the inverse of how libsndfile (and so read_audio) decodes PCM, int / 2^(bits-1): a
    written sample reads back within half a step, and a sample on that grid reads back exactly.
    """
    if bits not in (16, 24):
        raise AudioError(f"PCM bit depth must be 16 or 24, got {bits}")
    scale = float(1 << (bits - 1))
    q = np.clip(np.rint(samples.astype(np.float64) * scale), -scale, scale - 1)
    if bits == 16:
        return q.astype(np.int16)
    return q.astype(np.int32) << 8  # libsndfile takes the top 24 bits of int32 data


def to_pcm16(samples: AudioArray) -> bytes:
    """Little-endian signed 16-bit PCM bytes of float samples, quantized by quantize_pcm (x * 32768, rint, clipped)."""
    x = samples.detach().cpu().numpy() if isinstance(samples, Tensor) else np.asarray(samples)
    return quantize_pcm(x, 16).astype("<i2", copy=False).tobytes()


def encode_audio(audio: AudioArray, sample_rate: int, fmt: str, subtype: str) -> bytes:
    """Encode [N] or [C, N] float audio to the bytes of a file (fmt "WAV" or "FLAC")."""
    t = _as_tensor(audio, "audio to write")
    frames = (t.unsqueeze(0) if t.dim() == 1 else t).detach().cpu().numpy().T  # [frames, channels]
    if subtype.startswith("PCM_"):
        frames = quantize_pcm(frames, int(subtype[4:]))
    buf = io.BytesIO()
    try:
        sf.write(buf, frames, int(sample_rate), format=fmt, subtype=subtype)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        reason = getattr(e, "error_string", None) or str(e)
        raise AudioError(f"cannot encode {fmt}/{subtype} audio at {sample_rate} Hz: {reason}") from None
    return buf.getvalue()


def wav_bytes(audio: AudioArray, sample_rate: int, subtype: str = "PCM_16") -> bytes:
    """A WAV file's bytes (subtype PCM_16, PCM_24 or FLOAT) for [N] or [C, N] float audio."""
    if subtype not in WAV_SUBTYPES:
        raise AudioError(f"WAV subtype must be one of {WAV_SUBTYPES}, got {subtype!r}")
    return encode_audio(audio, sample_rate, "WAV", subtype)


def write_wav(path: str | os.PathLike, audio: AudioArray, sample_rate: int, subtype: str = "PCM_16") -> None:
    """Write [N] or [C, N] float audio as a WAV file (atomically: no half file on a crash)."""
    atomic_write_bytes(path, wav_bytes(audio, sample_rate, subtype))
