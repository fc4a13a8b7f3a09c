"""ECAPA-TDNN speaker encoder (Desplanques et al. 2020), in SpeechBrain's module layout.

A mel [B, T, mels] runs through a TDNN, SE-Res2Net blocks, a TDNN over the blocks' outputs
concatenated (multi-layer feature aggregation), attentive statistics pooling (each channel's
attention-weighted mean and standard deviation, the attention seeing the utterance's plain mean
and std as context), and a 1x1 convolution to the embedding [B, embed_dim].

Every convolution pads "same" by reflection (`nn.Conv1d`'s reflect mode: the input padded, then
an unpadded convolution), as the checkpoints were trained. The state dict's names are
SpeechBrain's (`blocks.N`, `tdnn1`, `res2net_block.blocks.N`, `se_block.conv1`, `mfa`, `asp.tdnn`,
`asp.conv`, `fc`), so the released weights load without renaming. Utterances in a batch are
taken as whole (no length mask): every frame counts in the pooling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _conv(inputs: int, outputs: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    """A convolution padded to keep the length, by reflection."""
    return nn.Conv1d(inputs, outputs, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """A time-delay layer: a dilated convolution, then ReLU."""

    def __init__(self, inputs: int, outputs: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(inputs, outputs, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, inputs, T] -> [B, outputs, T]."""
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Channels cut in `scale` groups; group i > 0 goes through its TDNN after adding group i-1's output (i > 1)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        if channels % scale:
            raise ValueError(f"Res2Net: {channels} channels do not split into {scale} groups")
        width = channels // scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> [B, C, T]."""
        groups = torch.chunk(x, self.scale, dim=1)
        outputs = [groups[0]]
        for i, (group, tdnn) in enumerate(zip(groups[1:], self.blocks)):
            outputs.append(tdnn(group if i == 0 else group + outputs[-1]))
        return torch.cat(outputs, dim=1)


class SqueezeExcite(nn.Module):
    """Channel gates from the time-mean: 1x1 conv down, ReLU, 1x1 conv up, sigmoid."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, squeezed)
        self.conv2 = _conv(squeezed, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> [B, C, T]."""
        gates = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gates


class SERes2NetBlock(nn.Module):
    """TDNN (1x1), Res2Net, TDNN (1x1), squeeze-excitation, plus the input."""

    def __init__(self, inputs: int, channels: int, scale: int, squeezed: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNN(inputs, channels, 1, 1)
        self.res2net_block = Res2Net(channels, scale, kernel, dilation)
        self.tdnn2 = TDNN(channels, channels, 1, 1)
        self.se_block = SqueezeExcite(channels, squeezed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, inputs, T] -> [B, channels, T] (inputs == channels: the sum needs it)."""
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time of x [B, C, T] under weights [B, 1 or C, T] summing to 1; the variance floored at eps."""
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(eps))
    return mean, std


class AttentiveStatsPooling(nn.Module):
    """Attention over frames, per channel, from the frames and the utterance's mean and std; -> [B, 2C, 1]."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> [B, 2C, 1]."""
        frames = x.shape[-1]
        # Uniform weights as SpeechBrain makes them for whole utterances: a mask of ones over its sum.
        ones = x.new_ones(x.shape[0], 1, frames)
        mean, std = _weighted_stats(x, ones / ones.sum(dim=2, keepdim=True), self.eps)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention, self.eps)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class ECAPATDNN(nn.Module):
    """ECAPA-TDNN: mel [B, T, mels] -> embedding [B, embed_dim]."""

    def __init__(self, mels: int, embed_dim: int, channels: Sequence[int], kernel_sizes: Sequence[int],
                 dilations: Sequence[int], attention_channels: int, res2net_scale: int, se_channels: int) -> None:
        super().__init__()
        if not len(channels) == len(kernel_sizes) == len(dilations) or len(channels) < 2:
            raise ValueError(f"ECAPA-TDNN: channels {list(channels)}, kernel sizes {list(kernel_sizes)} and "
                             f"dilations {list(dilations)} must be lists of one length, at least 2")
        self.blocks = nn.ModuleList([TDNN(mels, channels[0], kernel_sizes[0], dilations[0])])
        for i in range(1, len(channels) - 1):
            self.blocks.append(SERes2NetBlock(channels[i - 1], channels[i], res2net_scale, se_channels,
                                              kernel_sizes[i], dilations[i]))
        # The aggregation's input is every SE-Res2Net block's output, concatenated.
        self.mfa = TDNN(sum(channels[1:-1]), channels[-1], kernel_sizes[-1], dilations[-1])
        self.asp = AttentiveStatsPooling(channels[-1], attention_channels)
        self.fc = _conv(channels[-1] * 2, embed_dim)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, T, mels] -> [B, embed_dim]."""
        # Channels first; contiguous as a [B, mels, T] spectrogram transposed twice would be.
        x = mel.transpose(1, 2).contiguous()
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)
