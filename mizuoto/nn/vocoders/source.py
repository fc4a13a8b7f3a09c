"""HiFT's neural source: sine generators driven by F0 and the harmonic-merging source module.

Randomness comes from an explicit torch.Generator (None: torch's default one), drawn in
upstream's order. CosyVoice 3's causal source uses noise fixed at model construction instead,
supplied by a `FixedSourceNoise` (the engine replays upstream's construction draws).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def randn_like(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """torch.randn_like(x) drawn from `generator`: fills empty_like(x), which keeps x's strides."""
    # torch.randn_like is empty_like(x).normal_(); the strides decide which kernel fills the
    # tensor (vectorised for dense contiguous memory, element by element otherwise) and so
    # which element receives which draw. Drawing into a fresh contiguous tensor would differ.
    return torch.empty_like(x).normal_(generator=generator)


class FixedSourceNoise(Protocol):
    """Construction-time noise of CosyVoice 3's causal source (upstream draws it once, uniform)."""

    def rand_ini(self) -> torch.Tensor:
        """Initial harmonic phases, shape (1, dim), first entry 0."""

    def sine_waves(self, length: int) -> torch.Tensor:
        """The first `length` frames of the sine noise, shape (1, length, dim)."""


class SineGen(nn.Module):
    """CosyVoice 1 (22.05 kHz) sine generator: harmonics of F0 with random phases and noise."""

    def __init__(self, sampling_rate: int, harmonic_num: int, sine_amp: float, noise_std: float,
                 voiced_threshold: float):
        super().__init__()
        self.sampling_rate = sampling_rate
        self.harmonic_num = harmonic_num
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold

    def forward(self, f0: torch.Tensor, generator: torch.Generator | None = None):
        """f0 (1, L, 1) -> sine waves (1, L, dim), uv (1, L, 1), noise (1, dim, L)."""
        f0 = f0.transpose(1, 2)
        f_mat = torch.zeros((f0.size(0), self.harmonic_num + 1, f0.size(-1))).to(f0.device)
        for i in range(self.harmonic_num + 1):
            f_mat[:, i: i + 1, :] = f0 * (i + 1) / self.sampling_rate
        theta_mat = 2 * math.pi * (torch.cumsum(f_mat, dim=-1) % 1)
        # torch.distributions.Uniform(-pi, pi).sample(): float32 bounds, low + u * (high - low).
        low = torch.tensor(-math.pi, dtype=torch.float32, device=f0.device)
        high = torch.tensor(math.pi, dtype=torch.float32, device=f0.device)
        u = torch.rand((f0.size(0), self.harmonic_num + 1, 1), dtype=low.dtype, device=f0.device,
                       generator=generator)
        phase_vec = low + u * (high - low)
        phase_vec[:, 0, :] = 0
        sine_waves = self.sine_amp * torch.sin(theta_mat + phase_vec)
        uv = (f0 > self.voiced_threshold).type(torch.float32)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        noise = noise_amp * randn_like(sine_waves, generator)
        sine_waves = sine_waves * uv + noise
        return sine_waves.transpose(1, 2), uv.transpose(1, 2), noise


class SineGen2(SineGen):
    """CosyVoice 2/3 (24 kHz) sine generator: phase integrated at frame rate, then upsampled."""

    def __init__(self, sampling_rate: int, upsample_scale: int, harmonic_num: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float, fixed_noise: FixedSourceNoise | None = None):
        super().__init__(sampling_rate, harmonic_num, sine_amp, noise_std, voiced_threshold)
        self.upsample_scale = upsample_scale
        # Causal (CosyVoice 3) generators use construction-time noise and nearest-neighbour
        # phase upsampling; the others draw at every call and upsample linearly.
        self.fixed_noise = fixed_noise

    @property
    def causal(self) -> bool:
        """True for CosyVoice 3's causal source (fixed noise)."""
        return self.fixed_noise is not None

    def _f02sine(self, f0_values: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        rad_values = (f0_values / self.sampling_rate) % 1
        if self.causal:
            rad_values[:, 0, :] = rad_values[:, 0, :] + self.fixed_noise.rand_ini().to(rad_values.device)
        else:
            rand_ini = torch.rand(f0_values.shape[0], f0_values.shape[2], device=f0_values.device,
                                  generator=generator)
            rand_ini[:, 0] = 0
            rad_values[:, 0, :] = rad_values[:, 0, :] + rand_ini
        rad_values = F.interpolate(rad_values.transpose(1, 2), scale_factor=1 / self.upsample_scale,
                                   mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad_values, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=float(self.upsample_scale),
                              mode="nearest" if self.causal else "linear").transpose(1, 2)
        return torch.sin(phase)

    def forward(self, f0: torch.Tensor, generator: torch.Generator | None = None):
        """f0 (1, L, 1) -> sine waves (1, L, dim), uv (1, L, 1), noise (1, L, dim)."""
        harmonics = torch.FloatTensor([[range(1, self.harmonic_num + 2)]]).to(f0.device)
        fn = torch.multiply(f0, harmonics)
        sine_waves = self._f02sine(fn, generator) * self.sine_amp
        uv = (f0 > self.voiced_threshold).type(torch.float32)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        if self.causal:
            noise = noise_amp * self.fixed_noise.sine_waves(sine_waves.shape[1]).to(sine_waves.device)
        else:
            noise = noise_amp * randn_like(sine_waves, generator)
        sine_waves = sine_waves * uv + noise
        return sine_waves, uv, noise


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise source: sine harmonics merged by a linear layer and tanh."""

    def __init__(self, sine_gen: nn.Module, harmonic_num: int, sine_amp: float):
        super().__init__()
        self.sine_amp = sine_amp
        self.l_sin_gen = sine_gen
        self.l_linear = nn.Linear(harmonic_num + 1, 1)
        self.l_tanh = nn.Tanh()

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Upsampled F0 (1, L, 1) -> merged sine source (1, L, 1)."""
        with torch.no_grad():
            sine_wavs, uv, _ = self.l_sin_gen(x, generator)
        sine_merge = self.l_tanh(self.l_linear(sine_wavs))
        if not getattr(self.l_sin_gen, "causal", False):
            # Upstream also draws a noise branch here and never uses it; the draw still
            # advances the generator, so later calls depend on it.
            randn_like(uv, generator)
        return sine_merge
