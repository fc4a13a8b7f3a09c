"""A stand-in for the few torchaudio pieces chatterbox-tts 0.1.7 and resemble-perth touch.

No torchaudio wheel exists for torch 2.13 on the package index these recordings are made
from, and installing another torch is not an option. `install()` puts this module into
`sys.modules` as `torchaudio` (with `torchaudio.transforms`, `torchaudio.compliance` and
`torchaudio.compliance.kaldi`) before upstream is imported. Only what upstream calls is
provided, each written to follow torchaudio's own implementation op for op (the same torch calls
in the same order and dtypes), so that the values match what torchaudio computes:

- `transforms.Resample(orig, new)` with its defaults (Hann-windowed sinc, 6 zero crossings,
  roll-off 0.99): S3Gen.embed_ref (24 kHz reference -> 16 kHz for CAM++ and S3Tokenizer).
- `compliance.kaldi.fbank(wav, num_mel_bins=80)`, every other option at its default
  (no dither, povey window, pre-emphasis 0.97, DC removal, snip_edges, power spectrum,
  log floor float32 eps, no energy): CAM++ (chatterbox.models.s3gen.xvector).
- `transforms.Spectrogram(power=None)` / `transforms.InverseSpectrogram` (center, reflect,
  onesided, not normalized) and `transforms.TimeStretch` (constructed only, for its
  `phase_advance` buffer that perth's checkpoint carries): the Perth watermarker.
- `load`: not used on these paths; it raises.

`check_torchaudio_stub.py` compares Resample and fbank with real torchaudio's output recorded
in the shared frontend fixtures.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import torch
from torch import nn

# ---------------------------------------------------------------- resampling


def _sinc_resample_kernel(orig: int, new: int, gcd: int, lowpass_filter_width: int = 6, rolloff: float = 0.99):
    orig = int(orig) // gcd
    new = int(new) // gcd
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    # torchaudio: index offsets in float64, the per-phase offsets from an integer arange
    # divided by an int (so float32), summed in float64, kernel cast to float32 at the end
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=None)[:, None, None] / new + idx
    t *= base_freq
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    scale = base_freq / orig
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    return kernels.to(dtype=torch.float32), width


class Resample(nn.Module):
    def __init__(self, orig_freq: int = 16000, new_freq: int = 16000, resampling_method: str = "sinc_interp_hann",
                 lowpass_filter_width: int = 6, rolloff: float = 0.99, beta=None, *, dtype=None):
        super().__init__()
        if resampling_method != "sinc_interp_hann" or beta is not None or dtype is not None:
            raise NotImplementedError("torchaudio stub: only Resample's defaults are implemented")
        self.orig_freq, self.new_freq = orig_freq, new_freq
        self.gcd = math.gcd(int(orig_freq), int(new_freq))
        if orig_freq != new_freq:
            kernel, self.width = _sinc_resample_kernel(orig_freq, new_freq, self.gcd, lowpass_filter_width, rolloff)
            self.register_buffer("kernel", kernel, persistent=False)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        if self.orig_freq == self.new_freq:
            return waveform
        orig = int(self.orig_freq) // self.gcd
        new = int(self.new_freq) // self.gcd
        shape = waveform.size()
        waveform = waveform.view(-1, shape[-1])
        num_wavs, length = waveform.shape
        waveform = torch.nn.functional.pad(waveform, (self.width, self.width + orig))
        resampled = torch.nn.functional.conv1d(waveform[:, None], self.kernel, stride=orig)
        resampled = resampled.transpose(1, 2).reshape(num_wavs, -1)
        target_length = torch.ceil(torch.as_tensor(new * length / orig)).long()
        resampled = resampled[..., :target_length]
        return resampled.view(shape[:-1] + resampled.shape[-1:])


# ---------------------------------------------------------------- kaldi fbank


def _mel_scale_scalar(freq: float) -> float:
    return 1127.0 * math.log(1.0 + freq / 700.0)


def _mel_scale(freq: torch.Tensor) -> torch.Tensor:
    return 1127.0 * (1.0 + freq / 700.0).log()


def _mel_banks(num_bins: int, window_length_padded: int, sample_freq: float, low_freq: float, high_freq: float):
    num_fft_bins = window_length_padded / 2
    nyquist = 0.5 * sample_freq
    if high_freq <= 0.0:
        high_freq += nyquist
    fft_bin_width = sample_freq / window_length_padded
    mel_low_freq = _mel_scale_scalar(low_freq)
    mel_high_freq = _mel_scale_scalar(high_freq)
    mel_freq_delta = (mel_high_freq - mel_low_freq) / (num_bins + 1)
    b = torch.arange(num_bins).unsqueeze(1)
    left_mel = mel_low_freq + b * mel_freq_delta
    center_mel = mel_low_freq + (b + 1.0) * mel_freq_delta
    right_mel = mel_low_freq + (b + 2.0) * mel_freq_delta
    mel = _mel_scale(fft_bin_width * torch.arange(num_fft_bins)).unsqueeze(0)
    up_slope = (mel - left_mel) / (center_mel - left_mel)
    down_slope = (right_mel - mel) / (right_mel - center_mel)
    return torch.max(torch.zeros(1), torch.min(up_slope, down_slope))


def fbank(waveform: torch.Tensor, *, num_mel_bins: int = 23, dither: float = 0.0, frame_length: float = 25.0,
          frame_shift: float = 10.0, sample_frequency: float = 16000.0, low_freq: float = 20.0,
          high_freq: float = 0.0, **unsupported) -> torch.Tensor:
    if unsupported or dither != 0.0:
        raise NotImplementedError(f"torchaudio stub: fbank options {sorted(unsupported)} / dither not implemented")
    device, dtype = waveform.device, waveform.dtype
    waveform = waveform[0, :]  # channel -1 -> 0
    window_shift = int(sample_frequency * frame_shift * 0.001)
    window_size = int(sample_frequency * frame_length * 0.001)
    padded = 1 if window_size == 0 else 2 ** (window_size - 1).bit_length()  # round_to_power_of_two
    epsilon = torch.tensor(torch.finfo(torch.float).eps, device=device, dtype=dtype)
    # frames, snip_edges=True
    n = waveform.size(0)
    if n < window_size:
        return torch.empty((0, num_mel_bins), device=device, dtype=dtype)
    m = 1 + (n - window_size) // window_shift
    stride = waveform.stride(0)
    frames = waveform.as_strided((m, window_size), (window_shift * stride, stride))
    # remove_dc_offset
    frames = frames - torch.mean(frames, dim=1).unsqueeze(1)
    # preemphasis 0.97 (replicate-padded previous sample)
    prev = torch.nn.functional.pad(frames.unsqueeze(0), (1, 0), mode="replicate").squeeze(0)
    frames = frames - 0.97 * prev[:, :-1]
    # povey window
    window = torch.hann_window(window_size, periodic=False, device=device, dtype=dtype).pow(0.85).unsqueeze(0)
    frames = frames * window
    if padded != window_size:
        frames = torch.nn.functional.pad(frames.unsqueeze(0), (0, padded - window_size), mode="constant", value=0).squeeze(0)
    spectrum = torch.fft.rfft(frames).abs().pow(2.0)
    banks = _mel_banks(num_mel_bins, padded, sample_frequency, low_freq, high_freq).to(device=device, dtype=dtype)
    banks = torch.nn.functional.pad(banks, (0, 1), mode="constant", value=0)
    mel_energies = torch.mm(spectrum, banks.T)
    mel_energies = torch.max(mel_energies, epsilon).log()
    return mel_energies  # subtract_mean=False


# ---------------------------------------------------------------- STFT transforms (perth)


def _frame(module, n_fft, win_length, hop_length, window_fn, wkwargs):
    """torchaudio's defaults for the STFT's frame: window n_fft long, hop half the window."""
    module.n_fft = n_fft
    module.win_length = win_length if win_length is not None else n_fft
    module.hop_length = hop_length if hop_length is not None else module.win_length // 2
    window = window_fn(module.win_length) if wkwargs is None else window_fn(module.win_length, **wkwargs)
    module.register_buffer("window", window)


class Spectrogram(nn.Module):
    def __init__(self, n_fft=400, win_length=None, hop_length=None, pad=0, window_fn=torch.hann_window, power=2.0,
                 normalized=False, wkwargs=None, center=True, pad_mode="reflect", onesided=True):
        super().__init__()
        if power is not None or normalized or pad:
            raise NotImplementedError("torchaudio stub: only Spectrogram(power=None, normalized=False, pad=0)")
        _frame(self, n_fft, win_length, hop_length, window_fn, wkwargs)
        self.center, self.pad_mode, self.onesided = center, pad_mode, onesided

    def forward(self, waveform):
        shape = waveform.size()
        waveform = waveform.reshape(-1, shape[-1])
        spec = torch.stft(input=waveform, n_fft=self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                          window=self.window, center=self.center, pad_mode=self.pad_mode, normalized=False,
                          onesided=self.onesided, return_complex=True)
        return spec.reshape(shape[:-1] + spec.shape[-2:])


class InverseSpectrogram(nn.Module):
    def __init__(self, n_fft=400, win_length=None, hop_length=None, pad=0, window_fn=torch.hann_window,
                 normalized=False, wkwargs=None, center=True, pad_mode="reflect", onesided=True):
        super().__init__()
        if normalized or pad:
            raise NotImplementedError("torchaudio stub: only InverseSpectrogram(normalized=False, pad=0)")
        _frame(self, n_fft, win_length, hop_length, window_fn, wkwargs)
        self.center, self.onesided = center, onesided

    def forward(self, spectrogram, length=None):
        shape = spectrogram.size()
        spectrogram = spectrogram.reshape(-1, shape[-2], shape[-1])
        wav = torch.istft(input=spectrogram, n_fft=self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                          window=self.window, center=self.center, normalized=False, onesided=self.onesided,
                          length=length, return_complex=False)
        return wav.reshape(shape[:-2] + wav.shape[-1:])


class TimeStretch(nn.Module):
    def __init__(self, hop_length=None, n_freq=201, fixed_rate=None):
        super().__init__()
        n_fft = (n_freq - 1) * 2
        hop_length = hop_length if hop_length is not None else n_fft // 2
        self.register_buffer("phase_advance", torch.linspace(0, math.pi * hop_length, n_freq)[..., None])

    def forward(self, *args, **kwargs):
        raise NotImplementedError("torchaudio stub: TimeStretch is only constructed (perth's checkpoint has its buffer)")


def load(*args, **kwargs):
    raise NotImplementedError("torchaudio stub: load() is not used on the recorded paths")


def install() -> None:
    """Register this stub as `torchaudio` (+ submodules) unless a real torchaudio is importable."""
    if "torchaudio" in sys.modules:
        return
    ta = types.ModuleType("torchaudio")
    ta.__doc__ = __doc__
    ta.__version__ = "0+mizuoto-stub"
    ta.load = load
    transforms = types.ModuleType("torchaudio.transforms")
    for cls in (Resample, Spectrogram, InverseSpectrogram, TimeStretch):
        setattr(transforms, cls.__name__, cls)
    compliance = types.ModuleType("torchaudio.compliance")
    kaldi = types.ModuleType("torchaudio.compliance.kaldi")
    kaldi.fbank = fbank
    compliance.kaldi = kaldi
    ta.transforms, ta.compliance = transforms, compliance
    for mod in (ta, transforms, compliance, kaldi):  # importlib.util.find_spec needs a spec
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)
    sys.modules.update({"torchaudio": ta, "torchaudio.transforms": transforms,
                        "torchaudio.compliance": compliance, "torchaudio.compliance.kaldi": kaldi})
