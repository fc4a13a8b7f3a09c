"""Padding and chunk masks of the wenet lineage (bool masks, True = may attend)."""

from __future__ import annotations

import torch


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    """(B, T) bool, True at padded positions; T is max_len, or the longest length when 0."""
    batch = lengths.size(0)
    max_len = max_len if max_len > 0 else int(lengths.max().item())
    positions = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    return positions.unsqueeze(0).expand(batch, max_len) >= lengths.unsqueeze(-1)


def subsequent_chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1,
                          device: torch.device | None = None) -> torch.Tensor:
    """(size, size) bool: a frame sees every frame up to the end of its own chunk.

    num_left_chunks is accepted for signature parity and ignored, as upstream ignores it.
    """
    positions = torch.arange(size, device=device)
    chunk_end = (torch.div(positions, chunk_size, rounding_mode="trunc") + 1) * chunk_size
    return positions.unsqueeze(0) < chunk_end.unsqueeze(1)


def add_optional_chunk_mask(xs: torch.Tensor, masks: torch.Tensor, static_chunk_size: int,
                            decoding_chunk_size: int = 0, num_decoding_left_chunks: int = -1,
                            use_dynamic_chunk: bool = False) -> torch.Tensor:
    """The attention mask an encoder uses: the padding mask, narrowed to chunks when streaming.

    Inference only: dynamic chunks follow the decoding chunk size (full context when < 0);
    the random chunk sizes of training are not drawn here.
    """
    if use_dynamic_chunk:
        if decoding_chunk_size == 0:
            raise ValueError("random dynamic chunks are a training feature; pass decoding_chunk_size")
        chunk = xs.size(1) if decoding_chunk_size < 0 else decoding_chunk_size
        chunk_masks = masks & subsequent_chunk_mask(xs.size(1), chunk, -1, xs.device).unsqueeze(0)
    elif static_chunk_size > 0:
        chunk_masks = masks & subsequent_chunk_mask(
            xs.size(1), static_chunk_size, num_decoding_left_chunks, xs.device).unsqueeze(0)
    else:
        chunk_masks = masks
    # A row with nothing to attend to would give NaN after softmax; upstream opens it fully.
    empty_rows = chunk_masks.sum(dim=-1) == 0
    if empty_rows.any():
        chunk_masks = chunk_masks.clone()
        chunk_masks[empty_rows] = True
    return chunk_masks


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive bias: 0 where allowed, -1e10 where masked (upstream's constant)."""
    if mask.dtype != torch.bool:
        raise TypeError("mask_to_bias expects a bool mask")
    return (1.0 - mask.to(dtype)) * -1.0e10
