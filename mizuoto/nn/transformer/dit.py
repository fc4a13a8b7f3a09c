"""DiT estimator of the CosyVoice 3 flow: adaLN-zero transformer blocks over [x, cond, mu, spk].

Module names follow the upstream checkpoint (`decoder.estimator.*`), so its state_dict loads as is.
Numerics follow upstream's F5-TTS-derived modules and x_transformers 2.11's rotary embedding,
including its quirk: the rotary table has `dim_head` channels but is applied to the projected
query/key before the head split, so only the first `dim_head` channels (the first head) rotate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.nn.flow.unet1d import SinusoidalPosEmb
from mizuoto.nn.transformer.masks import subsequent_chunk_mask


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_embed_dim: int = 256):
        super().__init__()
        self.time_embed = SinusoidalPosEmb(freq_embed_dim)
        self.time_mlp = nn.Sequential(nn.Linear(freq_embed_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(self.time_embed(t).to(t.dtype))


class CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 1)
        x = self.conv1(F.pad(x, (self.kernel_size - 1, 0, 0, 0)))
        x = self.conv2(F.pad(x, (self.kernel_size - 1, 0, 0, 0)))
        return x.permute(0, 2, 1)


class InputEmbedding(nn.Module):
    def __init__(self, mel_dim: int, mu_dim: int, out_dim: int, spk_dim: int):
        super().__init__()
        self.spk_dim = spk_dim
        self.proj = nn.Linear(mel_dim * 2 + mu_dim + spk_dim, out_dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(out_dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        parts = [x, cond, mu]
        if self.spk_dim > 0:
            parts.append(spks.unsqueeze(1).expand(-1, x.shape[1], -1))
        x = self.proj(torch.cat(parts, dim=-1))
        return self.conv_pos_embed(x) + x


class RotaryEmbedding(nn.Module):
    """x_transformers' rotary table: interleaved (d r) pairs, no xpos scaling."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq_len: int) -> torch.Tensor:
        t = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = torch.einsum("b i , j -> b i j", t.unsqueeze(0), self.inv_freq)
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [1, n, dim]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first freqs.shape[-1] channels of t ([b, n, d]); the rest pass through."""
    rot = freqs.shape[-1]
    freqs = freqs[:, -t.shape[-2]:, :]
    head, tail = t[..., :rot], t[..., rot:]
    head = (head * freqs.cos()) + (_rotate_half(head) * freqs.sin())
    return torch.cat((head, tail), dim=-1).type(t.dtype)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: torch.Tensor, emb: torch.Tensor):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(emb, 6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = torch.chunk(self.linear(self.silu(emb)), 2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(dropout)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = apply_rotary(self.to_q(x), rope)
        k = apply_rotary(self.to_k(x), rope)
        v = self.to_v(x)
        head_dim = k.shape[-1] // self.heads
        q, k, v = (y.view(b, -1, self.heads, head_dim).transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(b, -1, self.heads * head_dim).to(q.dtype)
        out = self.to_out[1](self.to_out[0](out))  # the dropout acts in training only
        # mask is [b, 1, n, n]; its last query row marks the valid keys
        return out.masked_fill(~mask[:, 0, -1].unsqueeze(-1), 0.0)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float, dropout: float = 0.0):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
                                nn.Dropout(dropout), nn.Linear(inner, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: float, dropout: float = 0.0):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head, dropout)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, ff_mult, dropout)

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, emb=t)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm, mask, rope)
        ff_in = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(ff_in)


class DiT(nn.Module):
    """The flow estimator: (x, mask, mu, t, spks, cond) -> velocity, all [b, mel, n] like the U-Net's."""

    def __init__(self, *, dim: int, depth: int, heads: int, dim_head: int, ff_mult: float, mel_dim: int,
                 mu_dim: int | None, spk_dim: int | None, static_chunk_size: int,
                 long_skip_connection: bool = False):
        super().__init__()
        self.time_embed = TimestepEmbedding(dim)
        self.input_embed = InputEmbedding(mel_dim, mu_dim or mel_dim, dim, spk_dim or 0)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(dim, heads, dim_head, ff_mult) for _ in range(depth))
        self.long_skip_connection = nn.Linear(dim * 2, dim, bias=False) if long_skip_connection else None
        self.norm_out = AdaLayerNormZeroFinal(dim)
        self.proj_out = nn.Linear(dim, mel_dim)
        self.static_chunk_size = static_chunk_size

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
        batch, seq_len = x.shape[0], x.shape[1]
        if t.ndim == 0:
            t = t.repeat(batch)
        t = self.time_embed(t)
        x = self.input_embed(x, cond, mu, spks)
        rope = self.rotary_embed(seq_len)
        residual = x
        valid = mask.bool()  # [b, 1, n]
        if streaming:
            attn_mask = (valid & subsequent_chunk_mask(seq_len, self.static_chunk_size, device=x.device).unsqueeze(0)).unsqueeze(1)
        else:
            attn_mask = valid.repeat(1, seq_len, 1).unsqueeze(1)
        for block in self.transformer_blocks:
            x = block(x, t, attn_mask, rope)
        if self.long_skip_connection is not None:
            x = self.long_skip_connection(torch.cat((x, residual), dim=-1))
        x = self.norm_out(x, t)
        return self.proj_out(x).transpose(1, 2)
