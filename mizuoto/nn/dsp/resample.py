"""Band-limited sinc resampling, numerically the same as torchaudio's `transforms.Resample`.

Upstream (cosyvoice.utils.file_utils.load_wav) builds `Resample(orig, new)` with its
defaults: a Hann-windowed sinc, 6 zero crossings, roll-off 0.99, rates reduced by their gcd,
output length ceil(N * new / orig). The kernel is computed in float64 (the per-phase offsets
j / new in float32 first, as torchaudio's integer `arange` divides into the default dtype)
and stored as float32; the filtering is one strided convolution.

On the CPU the convolution is always run by oneDNN. torch's own dispatch sends inputs under
20,480 samples (about 1.3 s at 16 kHz) to an im2col + MKL sgemm path instead, whose rounding
depends on which code path MKL picks for the CPU (it differs between Intel and AMD parts);
the recorded references equal oneDNN's result for every clip, short ones included.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from mizuoto.errors import InvalidRequest

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99


@lru_cache(maxsize=64)
def _kernel(orig: int, new: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, int]:
    """The sinc-Hann kernel [new, 1, 2*width + orig] for gcd-reduced rates, and its width."""
    lowpass_filter_width, rolloff = LOWPASS_FILTER_WIDTH, ROLLOFF
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    # Integer arange divided by an int lands in float32 before meeting the float64 offsets;
    # torchaudio does the same, and the float32 rounding shows in the float32 kernel's last bits.
    phase = torch.arange(0, -new, -1)[:, None, None] / new
    t = (phase + idx) * base_freq
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    scale = base_freq / orig
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t)
    kernel = kernel * (window * scale)
    return kernel.to(device=device, dtype=dtype), width


def _conv(x: Tensor, kernel: Tensor, stride: int) -> Tensor:
    # torchaudio's own call: torch's dispatch picks oneDNN or im2col + sgemm by size, and the two
    # round differently on some CPUs, so forcing either one equals torchaudio on some CPUs only.
    # One row at a time (upstream resamples one mono clip): a row's bits never depend on the batch.
    return torch.cat([torch.nn.functional.conv1d(row[None], kernel, stride=stride) for row in x])


def resampled_length(num_samples: int, orig_rate: int, new_rate: int) -> int:
    """Output length of `resample`: ceil(N * new / orig) after gcd reduction."""
    if orig_rate == new_rate:
        return num_samples
    g = math.gcd(orig_rate, new_rate)
    return math.ceil((new_rate // g) * num_samples / (orig_rate // g))


def resample(waveform: Tensor, orig_rate: int, new_rate: int) -> Tensor:
    """Resample `waveform` [..., N] from orig_rate to new_rate (Hz) like torchaudio's Resample."""
    if int(orig_rate) != orig_rate or int(new_rate) != new_rate or orig_rate <= 0 or new_rate <= 0:
        raise InvalidRequest(f"sample rates must be positive integers, got {orig_rate} -> {new_rate}")
    orig_rate, new_rate = int(orig_rate), int(new_rate)
    if orig_rate == new_rate:
        return waveform
    if not waveform.is_floating_point():
        raise InvalidRequest(f"resample needs a floating-point waveform, got {waveform.dtype}")
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _kernel(orig, new, waveform.dtype, waveform.device)
    shape = waveform.shape
    x = waveform.reshape(-1, shape[-1])
    n = x.shape[-1]
    x = torch.nn.functional.pad(x, (width, width + orig))
    y = _conv(x[:, None], kernel, orig)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    y = y[..., : math.ceil(new * n / orig)]
    return y.reshape(shape[:-1] + y.shape[-1:])
