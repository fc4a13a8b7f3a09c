"""A clone clip's front, as upstream's `prepare_conditionals` computes it (English and Turbo).

Upstream loads the clip with `librosa.load(path, sr=24000)` (soundfile, channel mean, soxr HQ),
Turbo then scales it to -27 LUFS (pyloudnorm), and `librosa.resample` makes the 16 kHz copy the S3
tokenizer and the voice encoder read; S3Gen's reference is the 24 kHz wav's first 10 s. The voice
encoder trims silence (librosa.effects.trim, 20 dB) and takes a 40-band power mel (numpy STFT).
Each step is reproduced bit for bit by `mizuoto.nn.dsp` (soxr_resample, loudness, stft_mel).
"""

from __future__ import annotations

import os
from typing import Union

import numpy as np
import torch

from mizuoto.errors import AudioError
from mizuoto.nn.dsp.loudness import normalize_loudness
from mizuoto.nn.dsp.soxr_resample import load_resampled, soxr_resample
from mizuoto.nn.dsp.stft_mel import stft_mel, trim_silence

GEN_RATE = 24000   # S3Gen's rate, the rate the clip is loaded at
TOKEN_RATE = 16000  # the S3 tokenizer's and the voice encoder's rate
GEN_REF_SECONDS = 10  # S3Gen's reference: the first 10 s (upstream's DEC_COND_LEN)
TURBO_MIN_SECONDS = 5.0  # Turbo refuses a clip of 5 s or less (an assert upstream)
TURBO_LUFS = -27  # Turbo's loudness target
# the voice encoder's mel (Resemble's VoiceEncConfig) and its silence trim
VE_N_FFT, VE_HOP, VE_MELS, VE_FMAX = 400, 160, 40, 8000
VE_TRIM_DB = 20

ClipSource = Union[str, os.PathLike, bytes, tuple]


def load_clip(source: ClipSource, turbo: bool, norm_loudness: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(wav_16k, wav_24k) float32 of a clip path or (samples, rate): the tokenizer's input and S3Gen's reference.

    norm_loudness: Turbo's gain to -27 LUFS (upstream's `generate(norm_loudness=...)`; the English model has none).
    """
    wav = load_resampled(source, GEN_RATE)
    if turbo:
        if not len(wav) / GEN_RATE > TURBO_MIN_SECONDS:
            raise AudioError(f"Chatterbox-Turbo needs a reference clip longer than {TURBO_MIN_SECONDS:g} s, "
                             f"got {len(wav) / GEN_RATE:.2f} s", field="reference")
        if norm_loudness:
            wav = normalize_loudness(wav, GEN_RATE, TURBO_LUFS)
    wav_16k = soxr_resample(wav, GEN_RATE, TOKEN_RATE)
    return torch.from_numpy(np.ascontiguousarray(wav_16k)), torch.from_numpy(wav[:GEN_REF_SECONDS * GEN_RATE].copy())


def ve_mel(wav_16k: torch.Tensor) -> torch.Tensor:
    """The voice encoder's mel (frames, 40) of a 16 kHz clip (N,): silence trimmed, power 2, float32."""
    wav = np.asarray(wav_16k.detach().cpu().reshape(-1).numpy() if isinstance(wav_16k, torch.Tensor) else wav_16k,
                     dtype=np.float32)
    start, end = trim_silence(wav, top_db=VE_TRIM_DB)
    if end - start <= VE_N_FFT // 2:
        raise AudioError(f"the reference clip has too little sound for the voice encoder ({end - start} samples "
                         "above the silence threshold)", field="reference")
    mel = stft_mel(wav[start:end], TOKEN_RATE, VE_N_FFT, VE_HOP, VE_MELS, 0.0, VE_FMAX)
    return torch.from_numpy(np.ascontiguousarray(mel.T))
