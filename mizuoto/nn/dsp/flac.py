"""FLAC output through soundfile; reading FLAC is `wav.read_audio` / `wav.load_wav` (libsndfile detects it).

FLAC is lossless integer PCM, so samples are quantized exactly as for PCM WAV and read back
to the same float32 values.
"""

from __future__ import annotations

import os

from mizuoto.nn.dsp.wav import AudioArray, encode_audio
from mizuoto.files import atomic_write_bytes
from mizuoto.errors import AudioError

FLAC_BITS = (16, 24)


def flac_bytes(audio: AudioArray, sample_rate: int, bits: int = 16) -> bytes:
    """A FLAC file's bytes for [N] or [C, N] float audio at 16 or 24 bits."""
    if bits not in FLAC_BITS:
        raise AudioError(f"FLAC bit depth must be one of {FLAC_BITS}, got {bits}")
    return encode_audio(audio, sample_rate, "FLAC", f"PCM_{bits}")


def write_flac(path: str | os.PathLike, audio: AudioArray, sample_rate: int, bits: int = 16) -> None:
    """Write [N] or [C, N] float audio as a FLAC file (atomically)."""
    atomic_write_bytes(path, flac_bytes(audio, sample_rate, bits))
