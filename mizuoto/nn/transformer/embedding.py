"""Positional encodings and the no-subsampling input layers of the wenet lineage.

The sinusoid tables are built exactly as upstream builds them (same lengths, same op order):
torch's vectorised sin/cos treat the tail of a tensor differently from its body, so a table of
another length can differ in the last bit.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

_DEFAULT_MAX_LEN = 5000


def _sinusoids(d_model: int, length: int, sign: int = 1) -> torch.Tensor:
    """(length, d_model): sin and cos of (sign * position) * frequency, interleaved, as upstream computes them."""
    pe = torch.zeros(length, d_model)
    position = torch.arange(0, length, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    angle = sign * position * div_term
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe


@functools.lru_cache(maxsize=8)
def _abs_table(d_model: int, max_len: int) -> torch.Tensor:
    return _sinusoids(d_model, max_len).unsqueeze(0)


@functools.lru_cache(maxsize=8)
def _espnet_rel_table(d_model: int, length: int) -> torch.Tensor:
    # Positive offsets reversed, then negative ones: the layout rel_shift expects.
    pe_positive = torch.flip(_sinusoids(d_model, length), [0]).unsqueeze(0)
    pe_negative = _sinusoids(d_model, length, sign=-1)[1:].unsqueeze(0)
    return torch.cat([pe_positive, pe_negative], dim=1)


class PositionalEncoding(nn.Module):
    """Absolute sinusoidal encoding ("abs_pos"): x * sqrt(d) + pe."""

    def __init__(self, d_model: int, dropout_rate: float = 0.0, max_len: int = _DEFAULT_MAX_LEN):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.max_len = max_len
        self.dropout = nn.Dropout(p=dropout_rate)
        self._pe: torch.Tensor | None = None  # the table on the device last used

    def position_encoding(self, offset: int, size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(1, size, d) table rows starting at offset."""
        if offset + size > self.max_len:
            raise ValueError(f"sequence of {offset + size} positions exceeds the encoding's {self.max_len}")
        pe = self._pe
        if pe is None or pe.device != device:
            pe = self._pe = _abs_table(self.d_model, self.max_len).to(device=device)
        return pe[:, offset:offset + size]

    def forward(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled input plus encoding, and the encoding itself."""
        pos_emb = self.position_encoding(offset, x.size(1), x.device, x.dtype)
        x = x * self.xscale + pos_emb
        return self.dropout(x), self.dropout(pos_emb)

    def chunk_encoding(self, x: torch.Tensor, offset: int, size: int) -> torch.Tensor:
        """Rows for a chunk attending over `size` keys starting at `offset` (streaming decode)."""
        return self.dropout(self.position_encoding(offset, size, x.device, x.dtype))


class EspnetRelPositionalEncoding(nn.Module):
    """ESPnet's relative encoding ("rel_pos_espnet"): returns x * sqrt(d) and 2T-1 relative rows."""

    def __init__(self, d_model: int, dropout_rate: float = 0.0, max_len: int = _DEFAULT_MAX_LEN):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        # Upstream builds the table at max_len and rebuilds it (and keeps it) at the input's
        # length when an input outgrows it; the length used is part of the numerics.
        self._length = max_len
        self._pe: torch.Tensor | None = None  # the table on the device and dtype last used

    def _table(self, x: torch.Tensor) -> torch.Tensor:
        if 2 * self._length - 1 < x.size(1) * 2 - 1:
            self._length = x.size(1)
        pe = self._pe
        if pe is None or pe.size(1) != 2 * self._length - 1 or pe.device != x.device or pe.dtype != x.dtype:
            pe = self._pe = _espnet_rel_table(self.d_model, self._length).to(device=x.device, dtype=x.dtype)
        return pe

    def position_encoding(self, offset: int, size: int, pe: torch.Tensor) -> torch.Tensor:
        """Relative rows for `size` queries whose keys reach `offset` frames further back."""
        center = pe.size(1) // 2
        return pe[:, center - size - offset + 1:center + size + offset]

    def forward(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled input and the relative encoding for it."""
        pe = self._table(x)
        x = x * self.xscale
        pos_emb = self.position_encoding(offset, x.size(1), pe)
        return self.dropout(x), self.dropout(pos_emb)

    def chunk_encoding(self, x: torch.Tensor, offset: int, size: int) -> torch.Tensor:
        """Relative rows for a chunk attending over `size` keys (streaming decode)."""
        return self.position_encoding(offset, size, self._table(x))


POS_ENCODINGS = {
    "abs_pos": PositionalEncoding,
    "embed": PositionalEncoding,
    "rel_pos_espnet": EspnetRelPositionalEncoding,
}


class LinearNoSubsampling(nn.Module):
    """Input layer "linear": Linear -> LayerNorm -> Dropout, then the positional encoding."""

    legacy_relu = False

    def __init__(self, idim: int, odim: int, dropout_rate: float, pos_enc: nn.Module):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5), nn.Dropout(dropout_rate)]
        if self.legacy_relu:
            layers.append(nn.ReLU())
        self.out = nn.Sequential(*layers)
        self.pos_enc = pos_enc

    def forward(self, x: torch.Tensor, x_mask: torch.Tensor, offset: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, pos_emb, mask) with x projected and encoded."""
        x = self.out(x)
        x, pos_emb = self.pos_enc(x, offset)
        return x, pos_emb, x_mask


class LegacyLinearNoSubsampling(LinearNoSubsampling):
    """Input layer "linear_legacy": as "linear" with a ReLU after the dropout (CosyVoice 1 LM)."""

    legacy_relu = True


INPUT_LAYERS = {
    "linear": LinearNoSubsampling,
    "linear_legacy": LegacyLinearNoSubsampling,
}


def make_input_layer(input_layer: str, pos_enc_layer_type: str, idim: int, odim: int,
                     dropout_rate: float, positional_dropout_rate: float) -> nn.Module:
    """The `embed` module a wenet encoder starts with, by its yaml names."""
    if input_layer not in INPUT_LAYERS:
        raise ValueError(f"input_layer {input_layer!r} is not supported (known: {sorted(INPUT_LAYERS)})")
    if pos_enc_layer_type not in POS_ENCODINGS:
        raise ValueError(f"pos_enc_layer_type {pos_enc_layer_type!r} is not supported (known: {sorted(POS_ENCODINGS)})")
    pos_enc = POS_ENCODINGS[pos_enc_layer_type](odim, positional_dropout_rate)
    return INPUT_LAYERS[input_layer](idim, odim, dropout_rate, pos_enc)
