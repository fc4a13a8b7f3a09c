"""CosyVoice 1's length regulator: linear interpolation from token rate to mel rate, then convs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mel_frames_for_tokens(tokens: int, input_frame_rate: int, sample_rate: int, hop_length: int) -> int:
    """Mel frames of `tokens` tokens, computed in upstream's operation order."""
    return int(tokens / input_frame_rate * sample_rate / hop_length)


class InterpolateRegulator(nn.Module):
    """(conv3 -> GroupNorm -> Mish) per sampling ratio, then a 1x1 conv, after interpolation."""

    def __init__(self, channels: int, sampling_ratios: list[int] | tuple[int, ...],
                 out_channels: int | None = None, groups: int = 1):
        super().__init__()
        self.sampling_ratios = tuple(sampling_ratios)
        layers: list[nn.Module] = []
        for _ in self.sampling_ratios:
            layers += [nn.Conv1d(channels, channels, 3, 1, 1), nn.GroupNorm(groups, channels), nn.Mish()]
        layers.append(nn.Conv1d(channels, out_channels or channels, 1, 1))
        self.model = nn.Sequential(*layers)

    def inference(self, x1: torch.Tensor, x2: torch.Tensor, mel_len1: int, mel_len2: int,
                  overlap_tokens: int, overlap_frames: int) -> torch.Tensor:
        """Prompt part x1 and target part x2 (B, T, C), each stretched on its own -> (B, T_mel, C).

        A target longer than two overlaps is stretched as head / middle / tail so that chunk
        borders of streaming fall on exact mel frames.
        """
        if x2.shape[1] > 2 * overlap_tokens:
            head = F.interpolate(x2[:, :overlap_tokens].transpose(1, 2).contiguous(),
                                 size=overlap_frames, mode="linear")
            mid = F.interpolate(x2[:, overlap_tokens:-overlap_tokens].transpose(1, 2).contiguous(),
                                size=mel_len2 - overlap_frames * 2, mode="linear")
            tail = F.interpolate(x2[:, -overlap_tokens:].transpose(1, 2).contiguous(),
                                 size=overlap_frames, mode="linear")
            x2 = torch.concat([head, mid, tail], dim=2)
        else:
            x2 = F.interpolate(x2.transpose(1, 2).contiguous(), size=mel_len2, mode="linear")
        if x1.shape[1] != 0:
            x1 = F.interpolate(x1.transpose(1, 2).contiguous(), size=mel_len1, mode="linear")
            x = torch.concat([x1, x2], dim=2)
        else:
            x = x2
        return self.model(x).transpose(1, 2).contiguous()
