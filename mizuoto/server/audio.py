"""Audio in and out of the server: response encoders (whole files and streams) and reference decoding."""

from __future__ import annotations

import base64
import binascii
import io
import struct

import numpy as np
import torch

from mizuoto.server.errors import ApiError

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg; codecs=opus"}
STREAMABLE = ("wav", "pcm")
_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MIN_REFERENCE_RATE = 16000
REFERENCE_SECONDS = (0.5, 60.0)


def available_formats() -> tuple[str, ...]:
    """Response formats whose encoder exists on this machine (wav and pcm always)."""
    import soundfile

    formats = soundfile.available_formats()
    found = ["wav", "pcm"]
    for name, (major, subtype) in _SOUNDFILE.items():
        if major in formats and subtype in soundfile.available_subtypes(major):
            found.append(name)
    return tuple(found)


def pcm16(samples: torch.Tensor | np.ndarray) -> bytes:
    """Little-endian signed 16-bit PCM of float samples in [-1, 1] (clipped)."""
    x = samples.detach().cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples)
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; `None` sizes (a stream of unknown length) are written as 0xFFFFFFFF."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) \
        + b"data" + struct.pack("<I", data)


def encode(samples: torch.Tensor, rate: int, fmt: str) -> bytes:
    """A whole response body in `fmt`."""
    if fmt == "pcm":
        return pcm16(samples)
    if fmt == "wav":
        body = pcm16(samples)
        return wav_header(rate, len(body)) + body
    import soundfile

    x = samples.detach().cpu().float()
    if fmt == "opus" and rate not in OPUS_RATES:
        from mizuoto.nn.dsp.resample import resample

        x, rate = resample(x, rate, 48000), 48000
    major, subtype = _SOUNDFILE[fmt]
    buf = io.BytesIO()
    soundfile.write(buf, np.clip(x.numpy(), -1.0, 1.0), rate, format=major, subtype=subtype)
    return buf.getvalue()


def decode_base64(text: str, param: str) -> bytes:
    """Bytes of a base64 (or data: URL) string; corrupt input is a 400 naming `param`."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param} is neither a registered voice id nor valid base64 audio", param) from None


def decode_reference(data: bytes, param: str) -> tuple[torch.Tensor, int]:
    """(mono float32 samples, rate) of an uploaded reference; unreadable, too short or low-rate audio is a 400."""
    import soundfile

    if not data:
        raise ApiError(400, f"{param} is empty", param)
    try:
        audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception:  # soundfile raises several types for non-audio bytes
        raise ApiError(400, f"{param} is not a readable audio file (wav, flac, ogg or mp3 expected)", param) from None
    if rate < MIN_REFERENCE_RATE:
        raise ApiError(400, f"{param} is sampled at {rate} Hz; at least {MIN_REFERENCE_RATE} Hz is needed", param)
    seconds = audio.shape[0] / rate
    lo, hi = REFERENCE_SECONDS
    if not lo <= seconds <= hi:
        raise ApiError(400, f"{param} lasts {seconds:.2f} s; between {lo:g} and {hi:g} s is needed", param)
    samples = torch.from_numpy(audio).mean(dim=1)
    if not torch.isfinite(samples).all() or float(samples.abs().max()) == 0.0:
        raise ApiError(400, f"{param} is silent or holds non-finite samples", param)
    return samples, int(rate)
