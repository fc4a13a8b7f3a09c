"""Key/value caches for decoder LMs: dynamic (grows by concatenation) and static (preallocated).

Both store keys and values at the model's KV width (before heads are repeated) and return,
for attention, exactly the valid positions; so the attention call sees the same tensors with
either cache and the results are bit-identical. The static cache slices its buffers to the
valid length instead of masking the whole buffer: on the CPU, SDPA over a masked longer buffer
differs from SDPA over the exact length in the last bits (measured up to 1.8e-7), which would
change sampled tokens. Only the attention call sees a variable length; the writes are index
copies at a position tensor, so the code on either side of attention can be captured as a
CUDA graph.
"""

from __future__ import annotations

import torch


class KVCache:
    """Interface: `update` stores one layer's new keys/values and returns that layer's valid K/V."""

    length: int = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at `positions` for `layer`; return all valid K, V of it."""
        raise NotImplementedError

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (after every layer has been updated)."""
        self.length += n

    def reset(self) -> None:
        """Forget every position (a static cache keeps its buffers)."""
        self.length = 0


class DynamicKVCache(KVCache):
    """Grows with torch.cat, as transformers' DynamicCache does."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v to the layer's cache (positions are implied by the order of calls)."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=-2)
        return self.keys[layer], self.values[layer]

    def reset(self) -> None:
        """Drop every stored tensor."""
        self.keys, self.values, self.length = [], [], 0


class StaticKVCache(KVCache):
    """Two preallocated buffers (layers, B, Hkv, max_len, D); new positions are index-copied in.

    Without a dtype the buffers are allocated at the first write, each in the dtype of what it
    stores: under autocast, values stay in the autocast dtype while RoPE promotes keys.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 batch: int = 1) -> None:
        self.shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = self.v = None
        if dtype is not None:
            self._allocate(dtype, dtype, device)
        self.max_len = max_len
        self.length = 0

    def _allocate(self, k_dtype: torch.dtype, v_dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros(self.shape, dtype=k_dtype, device=device)
        self.v = torch.zeros(self.shape, dtype=v_dtype, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v at `positions` and return the buffers' first `length + T` positions."""
        end = self.length + k.shape[-2]
        if end > self.max_len:
            raise RuntimeError(f"static KV cache overflow: {end} positions > its {self.max_len}")
        if self.k is None:
            self._allocate(k.dtype, v.dtype, k.device)
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
