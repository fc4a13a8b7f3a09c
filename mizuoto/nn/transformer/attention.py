"""Multi-head self-attention of the wenet lineage, with and without relative positions."""

from __future__ import annotations

import math

import torch
from torch import nn

_NO_MASK = torch.ones((0, 0, 0), dtype=torch.bool)
_NO_CACHE = torch.zeros((0, 0, 0, 0))


class MultiHeadedAttention(nn.Module):
    """Scaled dot-product attention ("selfattn"); mask (B, 1|T1, T2) bool, True = attend."""

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float = 0.0, key_bias: bool = True):
        super().__init__()
        if n_feat % n_head:
            raise ValueError(f"attention width {n_feat} is not divisible by {n_head} heads")
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and split heads: each (B, H, T, d_k)."""
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked softmax over scores, weighted values, output projection."""
        n_batch = value.size(0)
        if mask.size(2) > 0:
            blocked = mask.unsqueeze(1).eq(0)[:, :, :, :scores.size(-1)]
            scores = scores.masked_fill(blocked, -float("inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(blocked, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.dropout(attn), value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    @staticmethod
    def _with_cache(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if cache.size(0) > 0:
            key_cache, value_cache = torch.split(cache, cache.size(-1) // 2, dim=-1)
            k = torch.cat([key_cache, k], dim=2)
            v = torch.cat([value_cache, v], dim=2)
        return k, v, torch.cat((k, v), dim=-1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor = _NO_MASK, pos_emb: torch.Tensor | None = None,
                cache: torch.Tensor = _NO_CACHE) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, new_cache); cache is (1, H, T_cache, 2 * d_k) keys and values side by side."""
        q, k, v = self.forward_qkv(query, key, value)
        k, v, new_cache = self._with_cache(k, v, cache)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask), new_cache


class RelPositionMultiHeadedAttention(MultiHeadedAttention):
    """Transformer-XL style attention with relative positions ("rel_selfattn")."""

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float = 0.0, key_bias: bool = True):
        super().__init__(n_head, n_feat, dropout_rate, key_bias)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        """(B, H, T1, 2*T1-1) scores by relative offset -> (B, H, T1, T1) scores by key position."""
        zero_pad = torch.zeros((x.size(0), x.size(1), x.size(2), 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1)
        x_padded = x_padded.view(x.size(0), x.size(1), x.size(3) + 1, x.size(2))
        return x_padded[:, :, 1:].view_as(x)[:, :, :, :x.size(-1) // 2 + 1]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor = _NO_MASK, pos_emb: torch.Tensor | None = None,
                cache: torch.Tensor = _NO_CACHE) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, new_cache); pos_emb is (1, 2*T-1, n_feat) from EspnetRelPositionalEncoding."""
        if pos_emb is None:
            raise ValueError("relative-position attention needs pos_emb")
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)  # (B, T1, H, d_k), so the per-head biases broadcast
        k, v, new_cache = self._with_cache(k, v, cache)

        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k).transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        if matrix_ac.shape != matrix_bd.shape:
            matrix_bd = self.rel_shift(matrix_bd)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask), new_cache


ATTENTIONS = {
    "selfattn": MultiHeadedAttention,
    "rel_selfattn": RelPositionMultiHeadedAttention,
}
