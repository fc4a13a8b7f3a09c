"""SnakeBeta (BigVGAN): x + sin^2(a x) / b, with per-channel a and b learned in log scale."""

from __future__ import annotations

import torch
from torch import nn


class SnakeBeta(nn.Module):
    """SnakeBeta over (B, C, T): `alpha` sets the frequency, `beta` the magnitude, both stored as logs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.eps = 0.000000001  # keeps 1 / b finite; added after exp, as the reference does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + 1 / (exp(beta) + eps) * sin(x * exp(alpha))^2, channel by channel."""
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        beta = torch.exp(self.beta.unsqueeze(0).unsqueeze(-1))
        return x + (1.0 / (beta + self.eps)) * torch.pow(torch.sin(x * alpha), 2)
