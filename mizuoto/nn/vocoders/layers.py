"""HiFT building blocks: Snake, residual blocks, causal convolutions, weight-norm folding, window.

Every forward here repeats the exact op sequence of CosyVoice's HiFT (same padding construct,
same operand order), because the vocoder output is checked sample for sample against upstream.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight torch's weight_norm parametrization (dim=0) computes from magnitude g and direction v."""
    if dtype is not None:
        g, v = g.to(dtype), v.to(dtype)
    # The parametrization calls exactly this op (fused kernel for dim=0); using it keeps the
    # folded weight bit-identical to what upstream recomputes at every call.
    return torch._weight_norm(v, g, 0)


def get_padding(kernel_size: int, dilation: int = 1) -> int:
    """'Same' padding of an odd kernel, as HiFi-GAN computes it."""
    return int((kernel_size * dilation - dilation) / 2)


def hann_window(n_fft: int) -> torch.Tensor:
    """Periodic Hann window computed as scipy.signal.get_window('hann', n, fftbins=True), in float32."""
    # scipy builds a symmetric window of n+1 points from cos(linspace(-pi, pi)) in float64 and
    # drops the last; torch.hann_window uses another formula whose float64 bits can differ.
    fac = np.linspace(-math.pi, math.pi, n_fft + 1)
    w = np.zeros(n_fft + 1)
    w += 0.5 * np.cos(0 * fac)
    w += 0.5 * np.cos(1 * fac)
    return torch.from_numpy(w[:n_fft].astype(np.float32))


class Snake(nn.Module):
    """Snake activation x + sin^2(a x) / a with a learned per-channel a."""

    def __init__(self, channels: int, alpha_logscale: bool = False):
        super().__init__()
        self.alpha_logscale = alpha_logscale
        self.alpha = nn.Parameter(torch.zeros(channels) if alpha_logscale else torch.ones(channels))
        self.eps = 0.000000001

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        if self.alpha_logscale:
            alpha = torch.exp(alpha)
        return x + (1.0 / (alpha + self.eps)) * torch.pow(torch.sin(x * alpha), 2)


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded on one side: 'left' (causal) or 'right' (look-ahead) with zeros or a cache."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 dilation: int = 1, causal_type: str = "left"):
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=dilation)
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type must be 'left' or 'right', not {causal_type!r}")
        self.causal_padding = int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2
        self.causal_type = causal_type

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        if cache is None or cache.size(2) == 0:
            cache = torch.zeros(x.shape[0], x.shape[1], self.causal_padding).to(x)
        if cache.size(2) != self.causal_padding:
            raise ValueError(f"cache holds {cache.size(2)} frames, the conv needs {self.causal_padding}")
        x = torch.concat([cache, x], dim=2) if self.causal_type == "left" else torch.concat([x, cache], dim=2)
        return super().forward(x)


class CausalConv1dDownSample(nn.Conv1d):
    """Strided conv left-padded by stride-1 zeros, so frame t sees only samples up to t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding=0)
        self.causal_padding = stride - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0), value=0.0))


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest upsampling by `stride`, then a causal (left-padded) stride-1 conv."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, 1, padding=0)
        self.causal_padding = kernel_size - 1
        self.upsample = nn.Upsample(scale_factor=stride, mode="nearest")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.upsample(x)
        return super().forward(F.pad(x, (self.causal_padding, 0), value=0.0))


class ResBlock(nn.Module):
    """HiFi-GAN residual block: per dilation, Snake -> conv(d) -> Snake -> conv(1), added back."""

    def __init__(self, channels: int, kernel_size: int, dilations: list[int], causal: bool = False):
        super().__init__()
        self.convs1 = nn.ModuleList()
        self.convs2 = nn.ModuleList()
        for dilation in dilations:
            if causal:
                self.convs1.append(CausalConv1d(channels, channels, kernel_size, dilation=dilation))
                self.convs2.append(CausalConv1d(channels, channels, kernel_size, dilation=1))
            else:
                self.convs1.append(nn.Conv1d(channels, channels, kernel_size, 1, dilation=dilation,
                                             padding=get_padding(kernel_size, dilation)))
                self.convs2.append(nn.Conv1d(channels, channels, kernel_size, 1, dilation=1,
                                             padding=get_padding(kernel_size, 1)))
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def weight_normed(self) -> list[str]:
        """Names (relative to this block) of the convs the checkpoint stores weight-normed."""
        return [f"convs{j}.{i}" for j in (1, 2) for i in range(len(self.convs1))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            xt = conv2(act2(conv1(act1(x))))
            x = xt + x
        return x
