"""Audio in and out of the server: response encoders (whole files and streams) and reference decoding."""

from __future__ import annotations

import base64
import binascii
import io
import logging

import numpy as np
import torch

from mizuoto.errors import quoted
from mizuoto.nn.dsp.encode import (ENCODER_HINTS, MEDIA_TYPES, OPUS_RATES, SOUNDFILE_FORMATS as _SOUNDFILE,  # noqa: F401
                                   aac_available as _aac_available, available_formats, encode_aac, wav_header)
from mizuoto.nn.dsp.encode import encode as _encode
from mizuoto.nn.dsp.wav import to_pcm16 as pcm16  # one PCM16 rounding; speech/websocket import pcm16
from mizuoto.server.errors import ApiError
from mizuoto.server.native_stderr import routed_stderr

log = logging.getLogger("mizuoto.server")

# the encoders are shared with `mizuoto say -o FILE` (nn/dsp/encode.py); the names stay importable from here
STREAMABLE = ("wav", "pcm")
MIN_REFERENCE_RATE = 16000
MAX_REFERENCE_RATE = 192000  # studio rates; anything above is a decoding bomb, not a recording
MAX_REFERENCE_CHANNELS = 8
# A reference (a request's ref_audio, a kept voice) lasts at most what the engines read: CosyVoice's speech
# tokenizer refuses more than 30 s (engines/cosyvoice/frontend.py MAX_PROMPT_SECONDS, upstream's limit). Checked
# from the header: a longer clip was decoded whole (+182 MB at 192 kHz) only for the engine to refuse it.
MAX_VOICE_SECONDS = 30.0
REFERENCE_SECONDS = (0.5, MAX_VOICE_SECONDS)
# A kept voice is mono float32 at its file's rate, or at 48 kHz when the file's is higher: the engines read a
# reference at 24 kHz at most (CosyVoice: 16 kHz for speech tokens and CAM++, 24 kHz for the prompt mel), and
# 48 kHz keeps everything below 23.7 kHz, so no engine loses what it uses. Files at 48 kHz or less are kept as
# decoded (the engines resample them exactly as an inline ref_audio). So a voice holds at most 5.8 MB.
MAX_VOICE_RATE = 48000
DECODE_FRAMES = 1 << 16  # frames decoded at a time: 8 channels of float32 hold 2 MB, not the whole file's size
# Float files may overshoot full scale a little; far past it the engine's arithmetic overflows.
MAX_REFERENCE_PEAK = 2.0


def missing_format(fmt: object, formats: tuple[str, ...]) -> str:
    """The 400 message for a response_format this server cannot write: what it needs, and what is available."""
    if isinstance(fmt, str) and fmt in ENCODER_HINTS:  # a list or an object is no format (nor hashable)
        return (f"response_format {fmt!r} has no encoder on this server (it needs {ENCODER_HINTS[fmt]});"
                f" available: {', '.join(formats)}")
    return f"response_format {quoted(fmt)} is not supported; use one of: {', '.join(formats)}"


def encode(samples: torch.Tensor, rate: int, fmt: str) -> bytes:
    """A whole response body in `fmt`; non-finite samples never reach an encoder (a 500 instead)."""
    check_finite(samples)
    return _encode(samples, rate, fmt)


def decode_base64(text: str, param: str) -> bytes:
    """Bytes of a base64 (or data: URL) string; corrupt input is a 400 naming `param`."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param} is neither a registered voice id nor valid base64 audio", param) from None


def decode_reference(data: bytes, param: str, max_seconds: float = REFERENCE_SECONDS[1],
                     max_rate: int | None = None) -> tuple[torch.Tensor, int]:
    """(mono float32 samples, rate) of an uploaded reference; a 400 for anything the engine should not see.

    The header is checked (rate, channels, duration up to `max_seconds`) before any sample is
    decoded, and decoding reads at most `max_seconds`, a block at a time mixed down to mono, so a
    small file that claims an hour of 8 channels costs nothing. Silent, non-finite or far out-of-range
    samples are refused after decoding. Audio above `max_rate` is resampled down to it.
    """
    import soundfile

    if not data:
        raise ApiError(400, f"{param} is empty", param)
    try:
        with routed_stderr(log, f"libmpg123 reading {param}"):  # its notes on an mp3 go to the log, not stderr
            info = soundfile.info(io.BytesIO(data))
    except Exception:  # soundfile raises several types for non-audio bytes
        raise ApiError(400, f"{param} is not a readable audio file (wav, flac, ogg or mp3 expected)", param) from None
    rate, channels = int(info.samplerate), int(info.channels)
    if not MIN_REFERENCE_RATE <= rate <= MAX_REFERENCE_RATE:
        raise ApiError(400, f"{param} is sampled at {rate} Hz; between {MIN_REFERENCE_RATE} and "
                            f"{MAX_REFERENCE_RATE} Hz is needed", param)
    if not 1 <= channels <= MAX_REFERENCE_CHANNELS:
        raise ApiError(400, f"{param} has {channels} channels; at most {MAX_REFERENCE_CHANNELS} are read", param)
    lo, hi = REFERENCE_SECONDS[0], max_seconds
    limit = int(hi * rate)
    if info.frames > limit:
        raise ApiError(400, f"{param} lasts {info.frames / rate:.2f} s; between {lo:g} and {hi:g} s is needed", param)
    # frames bound the decode even where the header's length is unknown or wrong (mp3, ogg)
    with routed_stderr(log, f"libmpg123 decoding {param}"):
        audio, finite, peak = _decode_mono(data, limit + 1, param)
    seconds = audio.numel() / rate
    if not lo <= seconds <= hi:
        raise ApiError(400, f"{param} lasts {seconds:.2f} s; between {lo:g} and {hi:g} s is needed", param)
    if not finite:
        raise ApiError(400, f"{param} holds non-finite samples (NaN or infinity)", param)
    if peak == 0.0:
        raise ApiError(400, f"{param} is silent", param)
    if peak > MAX_REFERENCE_PEAK:
        raise ApiError(400, f"{param} peaks at {peak:.3g}; samples must lie within [-1, 1] "
                            f"(float files up to +-{MAX_REFERENCE_PEAK:g} are accepted)", param)
    if max_rate is not None and rate > max_rate:
        from mizuoto.nn.dsp.resample import resample

        audio, rate = resample(audio, rate, max_rate), max_rate
    return audio, rate


def _decode_mono(data: bytes, frames: int, param: str) -> tuple[torch.Tensor, bool, float]:
    """(mono float32 samples, all finite, peak) of the first `frames` frames, decoded DECODE_FRAMES at a time."""
    import soundfile

    blocks, finite, peak = [], True, 0.0
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            while frames > 0:
                block = f.read(min(DECODE_FRAMES, frames), dtype="float32", always_2d=True)
                if not len(block):  # the header claimed more than the stream holds
                    break
                frames -= len(block)
                finite = finite and bool(np.isfinite(block).all())
                peak = max(peak, float(np.abs(block).max()))
                blocks.append(torch.from_numpy(block).mean(dim=1))
    except Exception:
        raise ApiError(400, f"{param} is not a readable audio file (wav, flac, ogg or mp3 expected)", param) from None
    return (torch.cat(blocks) if blocks else torch.zeros(0)), finite, peak


def check_finite(samples: torch.Tensor) -> None:
    """A 500 for engine output an encoder must never see (NaN or infinity)."""
    # numpy, not torch: this runs on the event loop, and a torch reduction over a whole utterance
    # would start an OpenMP team in the main thread for good (docs/performance.md, "Threads")
    if not np.isfinite(samples.detach().cpu().numpy()).all():
        raise ApiError(500, "the engine produced non-finite audio (NaN or infinity); the request was stopped")
