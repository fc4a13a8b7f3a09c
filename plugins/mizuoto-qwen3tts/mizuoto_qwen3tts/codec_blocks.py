"""The 12 Hz codec decoder's parts: the split residual dequantizer, the sliding-window transformer, the upsamplers.

Each forward repeats the reference decoder's op sequence (same torch calls, shapes and order),
because the waveform is compared with upstream's sample for sample:
- dequantizer: each codebook's table is `embedding_sum / cluster_usage.clamp(min=1e-5)` (EMA
  statistics, divided at every call as upstream does), looked up with `F.embedding`; a group's
  quantizers are summed starting from a 0-d zero, projected by a 1x1 conv; the acoustic group's
  result is added in place to the semantic one's.
- transformer: pre-norm layers with per-channel layer scales on both residual branches, RoPE,
  SDPA with an explicit boolean sliding-window causal mask (transformers builds one for every
  length here, even 1), no KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.nn.codecs.causal_conv import CausalConv1d, CausalConvTranspose1d
from mizuoto.nn.codecs.mimi import LayerScale
from mizuoto.nn.lm.decoder import GatedMLP, RMSNorm
from mizuoto.nn.vocoders.snake_beta import SnakeBeta

CODEBOOK_EPS = 1e-5  # the reference codebook's floor on usage counts (a constant there, not in config.json)


class Codebook(nn.Module):
    """One quantizer's table, stored as upstream keeps it: EMA sums of the assigned vectors and usage counts."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T) codes -> (B, dim, T) vectors."""
        table = self.embedding_sum / self.cluster_usage.clamp(min=CODEBOOK_EPS)[:, None]
        return F.embedding(codes, table).transpose(1, 2)


class ResidualDequantizer(nn.Module):
    """A group of quantizers: the sum of their vectors, projected to the output width by a 1x1 conv."""

    def __init__(self, quantizers: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.codebooks = nn.ModuleList(Codebook(size, dim) for _ in range(quantizers))
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, quantizers, T) codes -> (B, out_dim, T)."""
        summed = torch.zeros([1], device=codes.device)[0]  # upstream's start: a 0-d float zero
        for codebook, book_codes in zip(self.codebooks, codes.transpose(0, 1)):
            summed = summed + codebook(book_codes)
        return self.output_proj(summed)


class SplitDequantizer(nn.Module):
    """The semantic quantizer(s) and the acoustic ones, each group with its own projection."""

    def __init__(self, semantic: int, acoustic: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.semantic_count = semantic
        self.semantic = ResidualDequantizer(semantic, size, dim, out_dim)
        self.acoustic = ResidualDequantizer(acoustic, size, dim, out_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, quantizers, T) codes -> (B, out_dim, T)."""
        hidden = self.semantic(codes[:, : self.semantic_count])
        if codes.shape[1] > self.semantic_count:
            hidden += self.acoustic(codes[:, self.semantic_count:])
        return hidden


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's (-x2, x1) over the last dim's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def sliding_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """(1, 1, T, T) bool, True where query q may attend key k: q - window < k <= q."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


class SelfAttention(nn.Module):
    """Multi-head self-attention with RoPE over a boolean mask (no q/k norm)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.head_dim, self.n_rep = head_dim, heads // kv_heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, hidden)."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        if self.n_rep > 1:  # with a mask, transformers repeats the KV heads rather than asking SDPA for GQA
            b, h, t, d = k.shape
            k = k[:, :, None].expand(b, h, self.n_rep, t, d).reshape(b, h * self.n_rep, t, d)
            v = v[:, :, None].expand(b, h, self.n_rep, t, d).reshape(b, h * self.n_rep, t, d)
        # q, k, v go in with the strides the ops above leave (no .contiguous(), as upstream)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.head_dim ** -0.5,
                                             is_causal=False)
        out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class TransformerLayer(nn.Module):
    """Pre-norm attention and gated MLP, each branch layer-scaled before its residual add."""

    def __init__(self, hidden: int, inner: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = SelfAttention(hidden, heads, kv_heads, head_dim, bias)
        self.self_attn_layer_scale = LayerScale(hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, inner)
        self.mlp_layer_scale = LayerScale(hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, hidden)."""
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class SlidingWindowTransformer(nn.Module):
    """latent -> hidden projection, causal sliding-window layers, final norm, hidden -> latent projection."""

    def __init__(self, latent: int, hidden: int, inner: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int, bias: bool, eps: float, rope_theta: float, window: int) -> None:
        super().__init__()
        self.window = window
        self.input_proj = nn.Linear(latent, hidden)
        self.layers = nn.ModuleList(TransformerLayer(hidden, inner, heads, kv_heads, head_dim, bias, eps)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden, eps)
        self.output_proj = nn.Linear(hidden, latent)
        steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float)
        self.register_buffer("inv_freq", 1.0 / (rope_theta ** (steps / head_dim)), persistent=False)

    def rope(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (1, T, head_dim) for positions 0..T-1, in transformers' float32 op order."""
        positions = torch.arange(length, device=self.inv_freq.device)[None]
        inv = self.inv_freq[None, :, None].float().expand(1, -1, 1)
        angles = (inv.float() @ positions[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((angles, angles), dim=-1)
        # the reference multiplies both by attention_scaling, 1.0 for default RoPE: exact, left out
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, latent) -> (B, T, latent); positions start at 0 for every call (no cache)."""
        x = self.input_proj(x)
        cos, sin = self.rope(x.shape[1], x.dtype)
        mask = sliding_window_mask(x.shape[1], self.window, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.output_proj(self.norm(x))


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (kernel 7), LayerNorm, 4x pointwise MLP with GELU, scaled residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, dim, T) -> (B, dim, T)."""
        h = self.dwconv(x).permute(0, 2, 1)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 2, 1)


class ResidualUnit(nn.Module):
    """SnakeBeta, dilated causal conv (kernel 7), SnakeBeta, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, dim, T) -> (B, dim, T)."""
        return self.conv2(self.act2(self.conv1(self.act1(x)))) + x


class UpsampleBlock(nn.Module):
    """SnakeBeta, causal transposed conv (kernel 2r, stride r), residual units (dilations 1, 3, 9)."""

    DILATIONS = (1, 3, 9)

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate),
                                    *(ResidualUnit(out_dim, d) for d in self.DILATIONS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_dim, T) -> (B, out_dim, T * rate)."""
        for part in self.block:
            x = part(x)
        return x
