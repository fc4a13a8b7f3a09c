"""HiFT vocoder: F0 predictor + neural source filter + HiFi-GAN upsampler + inverse STFT.

`HiFTGenerator` is CosyVoice 1/2's (22.05 kHz uses SineGen, other rates SineGen2, as upstream
decides by the rate); `CausalHiFTGenerator` is CosyVoice 3's, with construction-time source
noise and a float64 F0 predictor. Sizes are constructor arguments named as in the yaml `hift`
node. Weight-normed convs hold their folded weight; `weight_normed()` names them for loaders.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.nn.vocoders.f0 import f0_device
from mizuoto.nn.vocoders.layers import (CausalConv1d, CausalConv1dDownSample, CausalConv1dUpsample,
                                         ResBlock, hann_window)
from mizuoto.nn.vocoders.source import FixedSourceNoise, SineGen, SineGen2, SourceModuleHnNSF


class _HiFTBase(nn.Module):
    """What both generators share: their sizes and layers (causal or not), the fusion body and the STFT pair.

    Sizes are keyword arguments named as in the yaml `hift` node; only the causal generator takes
    `conv_pre_look_right` and the construction-time `noise`, and it needs both. `sine2` chooses the
    sine generator (None: by rate, as CosyVoice does).
    """

    causal = False

    def __init__(self, *, in_channels: int, base_channels: int, nb_harmonics: int, sampling_rate: int,
                 nsf_alpha: float, nsf_sigma: float, nsf_voiced_threshold: float, upsample_rates: list[int],
                 upsample_kernel_sizes: list[int], istft_params: dict, resblock_kernel_sizes: list[int],
                 resblock_dilation_sizes: list[list[int]], source_resblock_kernel_sizes: list[int],
                 source_resblock_dilation_sizes: list[list[int]], lrelu_slope: float, audio_limit: float,
                 f0_predictor: nn.Module, conv_pre_look_right: int | None = None,
                 noise: FixedSourceNoise | None = None, sine2: bool | None = None):
        super().__init__()
        causal = self.causal
        if causal != (conv_pre_look_right is not None and noise is not None):
            raise TypeError(f"{type(self).__name__} {'needs' if causal else 'takes no'} conv_pre_look_right and noise")
        self.upsample_rates = list(upsample_rates)
        self.n_fft = int(istft_params["n_fft"])
        self.hop_len = int(istft_params["hop_len"])
        self.lrelu_slope = lrelu_slope
        self.audio_limit = audio_limit
        self.num_kernels = len(resblock_kernel_sizes)
        self.num_upsamples = len(upsample_rates)
        # Output samples per mel frame.
        self.upsample_scale = int(np.prod(upsample_rates)) * self.hop_len
        self.f0_upsamp = nn.Upsample(scale_factor=self.upsample_scale)
        widths = [base_channels // (2 ** i) for i in range(len(upsample_rates) + 1)]  # channels at each stage
        bins = self.n_fft + 2  # real and imaginary STFT bins
        self.resblocks = nn.ModuleList(ResBlock(widths[i + 1], k, d, causal=causal) for i in range(self.num_upsamples)
                                       for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes))
        self.reflection_pad = nn.ReflectionPad1d((1, 0))
        self.register_buffer("stft_window", hann_window(self.n_fft), persistent=False)
        # CosyVoice picks the generator by rate (sine2=None): the original SineGen only for v1/v2 at
        # 22.05 kHz; Chatterbox's 24 kHz HiFT keeps the original (sine2=False).
        if sine2 is None:
            sine2 = sampling_rate != 22050 or causal
        if not sine2:
            sine = SineGen(sampling_rate, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold)
        else:
            sine = SineGen2(sampling_rate, self.upsample_scale, nb_harmonics, nsf_alpha, nsf_sigma,
                            nsf_voiced_threshold, fixed_noise=noise)
        self.m_source = SourceModuleHnNSF(sine, nb_harmonics, nsf_alpha)
        if causal:
            self.conv_pre_look_right = conv_pre_look_right
            self.conv_pre = CausalConv1d(in_channels, base_channels, conv_pre_look_right + 1, causal_type="right")
            self.ups = nn.ModuleList(CausalConv1dUpsample(widths[i], widths[i + 1], k, u)
                                     for i, (u, k) in enumerate(zip(upsample_rates, upsample_kernel_sizes)))
        else:
            self.conv_pre = nn.Conv1d(in_channels, base_channels, 7, 1, padding=3)
            self.ups = nn.ModuleList(nn.ConvTranspose1d(widths[i], widths[i + 1], k, u, padding=(k - u) // 2)
                                     for i, (u, k) in enumerate(zip(upsample_rates, upsample_kernel_sizes)))
        # The source STFT is downsampled to each upsampling stage's frame rate.
        down_rates = [int(u) for u in np.cumprod([1] + list(upsample_rates)[::-1][:-1])[::-1]]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(down_rates, source_resblock_kernel_sizes, source_resblock_dilation_sizes)):
            ch = widths[i + 1]
            if causal:
                down = CausalConv1d(bins, ch, 1, causal_type="left") if u == 1 else CausalConv1dDownSample(bins, ch, u * 2, u)
            else:
                down = nn.Conv1d(bins, ch, 1, 1) if u == 1 else nn.Conv1d(bins, ch, u * 2, u, padding=u // 2)
            self.source_downs.append(down)
            self.source_resblocks.append(ResBlock(ch, k, d, causal=causal))
        if causal:
            self.conv_post = CausalConv1d(widths[-1], bins, 7, causal_type="left")
        else:
            self.conv_post = nn.Conv1d(widths[-1], bins, 7, 1, padding=3)
        self.f0_predictor = f0_predictor

    def weight_normed(self) -> list[str]:
        """Names of the convs the checkpoint stores weight-normed (folded here at load)."""
        names = ["conv_pre", "conv_post"] + [f"ups.{i}" for i in range(len(self.ups))]
        for group in ("resblocks", "source_resblocks"):
            for i, block in enumerate(getattr(self, group)):
                names += [f"{group}.{i}.{n}" for n in block.weight_normed()]
        names += [f"f0_predictor.{n}" for n in self.f0_predictor.weight_normed()]
        return names

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(x, self.n_fft, self.hop_len, self.n_fft, window=self.stft_window.to(x.device),
                          return_complex=True)
        spec = torch.view_as_real(spec)
        return spec[..., 0], spec[..., 1]

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        magnitude = torch.clip(magnitude, max=1e2)
        real = magnitude * torch.cos(phase)
        img = magnitude * torch.sin(phase)
        return torch.istft(torch.complex(real, img), self.n_fft, self.hop_len, self.n_fft,
                           window=self.stft_window.to(magnitude.device))

    def decode(self, x: torch.Tensor, s: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel (1, C, T) + source (1, 1, L) -> clamped waveform (1, L).

        finalize=False is the causal generator's streaming step: conv_pre's look-ahead frames are
        its right context, and the samples they would complete are not emitted.
        """
        s_real, s_imag = self._stft(s.squeeze(1))
        if finalize:
            x = self.conv_pre(x)
        else:
            look = self.conv_pre_look_right
            x = self.conv_pre(x[:, :, :-look], x[:, :, -look:])
            cut = int(np.prod(self.upsample_rates)) * look
            s_real, s_imag = s_real[:, :, :-cut], s_imag[:, :, :-cut]
        x = self._body(x, torch.cat([s_real, s_imag], dim=1))
        if not finalize:
            x = x[:, :-self.upsample_scale]
        return torch.clamp(x, -self.audio_limit, self.audio_limit)

    def _body(self, x: torch.Tensor, s_stft: torch.Tensor) -> torch.Tensor:
        """conv_pre output + source STFT -> waveform (before clamping)."""
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, self.lrelu_slope)
            x = self.ups[i](x)
            if i == self.num_upsamples - 1:
                x = self.reflection_pad(x)
            si = self.source_resblocks[i](self.source_downs[i](s_stft))
            x = x + si
            xs = None
            for j in range(self.num_kernels):
                if xs is None:
                    xs = self.resblocks[i * self.num_kernels + j](x)
                else:
                    xs += self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        x = F.leaky_relu(x)
        x = self.conv_post(x)
        half = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half, :])
        phase = torch.sin(x[:, half:, :])
        return self._istft(magnitude, phase)


class HiFTGenerator(_HiFTBase):
    """CosyVoice 1/2 HiFT: non-causal convs, source noise drawn from a generator at every call."""

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, cache_source: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel (1, C, T) -> (speech (1, L), source (1, 1, L)); cache_source overwrites the source's start.

        Draws from `generator` (on the model's device; None: torch's default) in upstream's order.
        """
        f0 = self.f0_predictor(speech_feat)
        s = self.f0_upsamp(f0[:, None]).transpose(1, 2)
        s = self.m_source(s, generator).transpose(1, 2)
        # Streaming: the previous chunk's source tail replaces the start, avoiding a glitch.
        if cache_source is not None and cache_source.shape[2] != 0:
            s[:, :, :cache_source.shape[2]] = cache_source
        return self.decode(speech_feat, s), s

    def vocode(self, mel: torch.Tensor, *, cache_source: torch.Tensor | None, finalize: bool,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The vocoder stage interface: every call draws fresh source noise; `finalize` changes nothing."""
        return self.inference(mel, cache_source, generator=generator)


class CausalHiFTGenerator(_HiFTBase):
    """CosyVoice 3 HiFT: causal convs, fixed construction-time noise, float64 F0 predictor."""

    causal = True

    def fixed_modules(self, device: torch.device | str) -> list[str]:
        """Children that must not follow the vocoder to `device` (the planner's fixed modules)."""
        return [] if f0_device(device) == torch.device(device) else ["f0_predictor"]

    def place(self, device: torch.device | str) -> "CausalHiFTGenerator":
        """Move to `device`; the float64 F0 predictor goes to the CPU where float64 is missing."""
        device = torch.device(device)
        for name, child in self.named_children():
            child.to(f0_device(device) if name == "f0_predictor" else device)
        self.stft_window = self.stft_window.to(device)
        return self

    def _f0(self, speech_feat: torch.Tensor, finalize: bool) -> torch.Tensor:
        # F0 integrates into phase over the whole sentence, so upstream runs it in float64;
        # the predictor may sit on another device (see place), so it gets its input there.
        param = self.f0_predictor.classifier.weight
        f0 = self.f0_predictor(speech_feat.to(param.device, param.dtype), finalize=finalize)
        return f0.to(speech_feat)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel (1, C, T) -> (speech, source); streaming re-runs on all mel so far with finalize=False."""
        f0 = self._f0(speech_feat, finalize)
        s = self.f0_upsamp(f0[:, None]).transpose(1, 2)
        s = self.m_source(s).transpose(1, 2)
        if not finalize:
            speech_feat = speech_feat[:, :, :-self.f0_predictor.lookahead]
        return self.decode(speech_feat, s, finalize), s

    def vocode(self, mel: torch.Tensor, *, cache_source: torch.Tensor | None, finalize: bool,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The vocoder stage interface: fixed noise, so no cache and no draws; streaming re-runs all mel."""
        return self.inference(mel, finalize=finalize)
