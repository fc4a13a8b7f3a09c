"""F0 predictors of HiFT (mel -> F0 in Hz) and where CosyVoice 3's float64 predictor may run."""

from __future__ import annotations

import torch
from torch import nn

from mizuoto.nn.vocoders.layers import CausalConv1d

# Device types whose kernels lack float64 (Apple MPS, Intel Arc via XPU).
_NO_FLOAT64 = frozenset({"mps", "xpu"})


def supports_float64(device: torch.device | str) -> bool:
    """Whether float64 tensors can be computed on this device."""
    return torch.device(device).type not in _NO_FLOAT64


def f0_device(device: torch.device | str) -> torch.device:
    """Where a float64 F0 predictor lives when its vocoder is placed on `device`."""
    device = torch.device(device)
    return device if supports_float64(device) else torch.device("cpu")


class ConvRNNF0Predictor(nn.Module):
    """Five 'same' convs with ELU, then a linear head; |output| is F0 per mel frame."""

    def __init__(self, num_class: int, in_channels: int, cond_channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, kernel_size=3, padding=1),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def weight_normed(self) -> list[str]:
        """Names of the convs the checkpoint stores weight-normed."""
        return [f"condnet.{i}" for i in range(0, len(self.condnet), 2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mel (B, in_channels, T) -> F0 (B, T)."""
        x = self.condnet(x).transpose(1, 2)
        return torch.abs(self.classifier(x).squeeze(-1))


class CausalConvRNNF0Predictor(nn.Module):
    """CosyVoice 3's F0 predictor: a look-ahead conv, four causal convs, a linear head."""

    def __init__(self, num_class: int, in_channels: int, cond_channels: int):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(in_channels, cond_channels, 4, causal_type="right"), nn.ELU()]
        for _ in range(4):
            layers += [CausalConv1d(cond_channels, cond_channels, 3, causal_type="left"), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    @property
    def lookahead(self) -> int:
        """Mel frames of right context the first conv consumes."""
        return self.condnet[0].causal_padding

    def weight_normed(self) -> list[str]:
        """Names of the convs the checkpoint stores weight-normed."""
        return [f"condnet.{i}" for i in range(0, len(self.condnet), 2)]

    def forward(self, x: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel (B, in_channels, T) -> F0 (B, T), or (B, T - lookahead) when not finalizing."""
        if finalize:
            x = self.condnet[0](x)
        else:
            # The last frames serve as the look-ahead instead of zero padding.
            pad = self.lookahead
            x = self.condnet[0](x[:, :, :-pad], x[:, :, -pad:])
        for layer in self.condnet[1:]:
            x = layer(x)
        x = x.transpose(1, 2)
        return torch.abs(self.classifier(x).squeeze(-1))
