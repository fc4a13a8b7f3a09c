"""Causal convolutions of the Encodec / Mimi / DAC lineage: left padding plus just enough right padding.

`CausalConv1d` pads `kernel - stride` zeros on the left (the effective kernel, dilation included)
and, on the right, only what a strided kernel needs so that the last partial window still yields
a frame (Encodec's `get_extra_padding_for_conv1d`; zero for stride 1). `CausalConvTranspose1d`
upsamples with a transposed convolution and drops the `kernel - stride` samples that would depend
on inputs not yet seen. Both keep the inner layer as `.conv`, the name upstream checkpoints use.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv1d(nn.Module):
    """Conv1d that sees only the present and the past (zero padded), any stride, dilation or groups."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 stride: int = 1, groups: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation,
                              groups=groups, bias=bias)
        self.stride = stride
        self.span = (kernel_size - 1) * dilation + 1  # the kernel's reach, dilation included
        self.left = self.span - stride

    def right_padding(self, length: int) -> int:
        """Zeros to add after `length` samples so the last (partial) stride still gives a frame."""
        # float division and ceil, as Encodec computes it (exact for any length a model sees)
        frames = (length - self.span + self.left) / self.stride + 1
        return (math.ceil(frames) - 1) * self.stride + (self.span - self.left) - length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, ceil(T / stride))."""
        x = F.pad(x, (self.left, self.right_padding(x.shape[-1])), mode="constant", value=0)
        return self.conv(x).contiguous()


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d whose last `kernel - stride` samples (waiting for the next input) are dropped."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, T * stride) when kernel >= stride."""
        x = self.conv(x)
        if self.trim > 0:
            x = x[..., : x.shape[-1] - self.trim]
        return x.contiguous()
