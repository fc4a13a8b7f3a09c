"""Audio files and bodies in every format Mizuoto writes: the server's responses and `mizuoto say -o FILE`.

One encoder for both, so a file named `.mp3` is an MP3 and a `wav` holds the same PCM16 samples
whether the server sent it or the command line wrote it. wav, pcm and flac share one rounding
(`nn.dsp.wav.quantize_pcm`); mp3 and opus come from libsndfile, aac (AAC-LC in ADTS) from PyAV's
FFmpeg (the `aac` extra). Importing this module needs numpy and soundfile only; PyAV is imported
when an aac body is written.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np

from mizuoto.errors import AudioError, InvalidRequest
from mizuoto.nn.dsp.wav import quantize_pcm, to_pcm16

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg; codecs=opus", "aac": "audio/aac"}
# what installs the encoder of a format missing on this machine
ENCODER_HINTS = {"aac": "pip install 'mizuoto-runtime[aac]' (PyAV)", "flac": "a libsndfile with FLAC",
                 "mp3": "libsndfile 1.1 or newer", "opus": "a libsndfile with Ogg Opus"}
SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
# a file's extension -> the format written into it
SUFFIX_FORMATS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".ogg": "opus", ".opus": "opus", ".aac": "aac",
                  ".pcm": "pcm", ".raw": "pcm"}


def aac_available() -> bool:
    """PyAV is installed and its FFmpeg has an AAC encoder."""
    try:
        import av
    except ImportError:
        return False
    return "aac" in av.codecs_available


def available_formats() -> tuple[str, ...]:
    """Formats whose encoder exists on this machine (wav and pcm always)."""
    import soundfile

    formats = soundfile.available_formats()
    found = ["wav", "pcm"]
    for name, (major, subtype) in SOUNDFILE_FORMATS.items():
        if major in formats and subtype in soundfile.available_subtypes(major):
            found.append(name)
    if aac_available():
        found.append("aac")
    return tuple(found)


def encode_aac(samples: np.ndarray, rate: int) -> bytes:
    """AAC-LC in an ADTS stream (what OpenAI's `aac` is), through PyAV's FFmpeg encoder."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="adts") as out:
        stream = out.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32)[None, :], format="flt",
                                           layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def wav_header(rate: int, data_bytes: int | None = None, float32: bool = False) -> bytes:
    """A 44-byte mono WAV header (PCM16, or IEEE float32); `None` sizes (a stream of unknown length) are 0xFFFFFFFF."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    tag, width = (3, 4) if float32 else (1, 2)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + \
        struct.pack("<IHHIIHH", 16, tag, 1, rate, rate * width, width, 8 * width) + b"data" + struct.pack("<I", data)


def encode(samples, rate: int, fmt: str, float32: bool = False) -> bytes:
    """A whole body in `fmt` (mono samples: a torch tensor or numpy array); `float32`: a float WAV (wav only)."""
    x = np.asarray(samples.detach().cpu().float().numpy() if hasattr(samples, "detach") else samples,
                   dtype=np.float32).reshape(-1)
    if fmt == "pcm":
        return to_pcm16(x)
    if fmt == "wav":
        body = x.astype("<f4").tobytes() if float32 else to_pcm16(x)
        return wav_header(rate, len(body), float32) + body
    if fmt == "aac":
        return encode_aac(np.clip(x, -1.0, 1.0), rate)
    if fmt not in SOUNDFILE_FORMATS:
        raise InvalidRequest(f"unknown audio format {fmt!r}; known: {', '.join(MEDIA_TYPES)}")
    import soundfile

    if fmt == "opus" and rate not in OPUS_RATES:
        import torch

        from mizuoto.nn.dsp.resample import resample

        x, rate = resample(torch.from_numpy(x), rate, 48000).numpy(), 48000
    major, subtype = SOUNDFILE_FORMATS[fmt]
    # FLAC's PCM_16 is quantized as wav/pcm are, not by libsndfile's own float conversion
    data = quantize_pcm(x, 16) if subtype == "PCM_16" else np.clip(x, -1.0, 1.0)
    buf = io.BytesIO()
    soundfile.write(buf, data, rate, format=major, subtype=subtype)
    return buf.getvalue()


def format_for_path(path: str | Path) -> str:
    """The format a file's extension names (`out.mp3` -> mp3); a clear error for one Mizuoto cannot write."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        known = ", ".join(sorted(SUFFIX_FORMATS))
        raise InvalidRequest(f"{path}: cannot tell the audio format from {suffix or 'a name without an extension'!r};"
                             f" name the file with one of {known}")
    fmt = SUFFIX_FORMATS[suffix]
    if fmt not in available_formats():
        raise AudioError(f"{path}: writing {fmt} needs {ENCODER_HINTS[fmt]}; available here: "
                         f"{', '.join(sorted({s for s, f in SUFFIX_FORMATS.items() if f in available_formats()}))}")
    return fmt
