"""An LSTM speaker encoder over mel partials (GE2E style), as Resemble's voice encoder computes it.

The utterance's mel (T, M) is cut into windows of `partial_frames` at a step set by a rate (windows
per second), padded with zeros to a whole number of windows when the last one would cover at least
`min_coverage` of a window; each window runs through a stacked LSTM, its last layer's final hidden
state is projected, ReLU'd and L2-normed; the windows' mean, L2-normed again, is the embedding.
Windows run in batches of at most `batch_size`, split as `torch.chunk` splits them (the LSTM's
products round by batch size). Sizes come from the weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LSTMSpeakerEncoder(nn.Module):
    """Stacked LSTM + projection; `embed` turns one utterance's mel into its embedding."""

    def __init__(self, mels: int, hidden: int, layers: int, size: int, *, partial_frames: int = 160,
                 sample_rate: int = 16000, hop: int = 160, final_relu: bool = True) -> None:
        super().__init__()
        self.lstm = nn.LSTM(mels, hidden, num_layers=layers, batch_first=True)
        self.proj = nn.Linear(hidden, size)
        self.partial_frames, self.sample_rate, self.hop, self.final_relu = partial_frames, sample_rate, hop, final_relu

    def forward(self, partials: torch.Tensor) -> torch.Tensor:
        """L2-normed embeddings (B, size) of mel windows (B, partial_frames, mels)."""
        _, (hidden, _) = self.lstm(partials)
        raw = self.proj(hidden[-1])
        if self.final_relu:
            raw = F.relu(raw)
        return raw / torch.linalg.norm(raw, dim=1, keepdim=True)

    def windows(self, frames: int, rate: float, min_coverage: float) -> tuple[int, int, int]:
        """(count, step, padded length) of the windows over `frames` mel frames."""
        step = int(round((self.sample_rate / rate) / self.partial_frames))  # numpy's round: half to even
        if not 0 < step <= self.partial_frames:
            raise ValueError(f"a rate of {rate} windows per second gives a step of {step} frames")
        count, remainder = divmod(max(frames - self.partial_frames + step, 0), step)
        if count == 0 or (remainder + (self.partial_frames - step)) / self.partial_frames >= min_coverage:
            count += 1
        return count, step, self.partial_frames + step * (count - 1)

    @torch.inference_mode()
    def embed(self, mel: torch.Tensor, rate: float = 1.3, min_coverage: float = 0.8,
              batch_size: int = 32) -> torch.Tensor:
        """The embedding (1, size) of one utterance's mel (T, mels)."""
        if mel.dim() != 2 or mel.shape[0] == 0:
            raise ValueError(f"expected a non-empty mel of shape (frames, mels), got {tuple(mel.shape)}")
        count, step, length = self.windows(mel.shape[0], rate, min_coverage)
        if length > mel.shape[0]:
            mel = torch.cat([mel, mel.new_zeros(length - mel.shape[0], mel.shape[1])])
        partials = torch.stack([mel[i * step:i * step + self.partial_frames] for i in range(count)])
        chunks = math.ceil(count / batch_size)
        embeds = torch.cat([self(batch) for batch in partials.chunk(chunks)], dim=0)
        mean = torch.mean(embeds, dim=0)[None]
        return mean / torch.linalg.norm(mean, dim=1, keepdim=True)
