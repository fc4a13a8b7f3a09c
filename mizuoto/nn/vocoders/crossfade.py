"""Crossfading consecutive pieces of a stream (audio chunks, mel chunks) with a symmetric window."""

from __future__ import annotations

import numpy as np
import torch


def fade_in_out(fade_in: torch.Tensor, fade_out: torch.Tensor, window: np.ndarray) -> torch.Tensor:
    """Crossfade as upstream: the numpy (float64) window promotes the product, then it is stored as float32."""
    n = window.shape[0] // 2
    out = fade_in.clone()
    win = torch.from_numpy(window).to(fade_in.device)
    mixed = fade_in[..., :n].double() * win[:n] + fade_out[..., -n:].double() * win[n:]
    out[..., :n] = mixed.to(out.dtype)
    return out
