"""The 1-D conditional U-Net that estimates the flow's velocity (CosyVoice 1 and 2).

Matcha-TTS's decoder blocks with diffusers-style transformer blocks; the causal variant
(CosyVoice 2) pads convolutions on the left and can restrict attention to static chunks for
streaming. Module names follow upstream so `decoder.estimator.*` keys load as saved.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.nn.transformer.masks import add_optional_chunk_mask, mask_to_bias


class SinusoidalPosEmb(nn.Module):
    """Timestep -> [sin, cos] features of width `dim`, timesteps scaled by 1000."""

    def __init__(self, dim: int):
        super().__init__()
        if dim % 2:
            raise ValueError("SinusoidalPosEmb needs an even width")
        self.dim = dim

    def forward(self, x: torch.Tensor, scale: float = 1000) -> torch.Tensor:
        """(B,) -> (B, dim)."""
        if x.ndim < 1:
            x = x.unsqueeze(0)
        half_dim = self.dim // 2
        step = math.log(10000) / (half_dim - 1)
        freqs = torch.exp(torch.arange(half_dim, device=x.device).float() * -step)
        emb = scale * x.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2."""

    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        """(B, in) -> (B, time_embed_dim)."""
        return self.linear_2(self.act(self.linear_1(sample)))


class Transpose(nn.Module):
    """Swap two dimensions (lets LayerNorm sit inside a channels-first Sequential)."""

    def __init__(self, dim0: int, dim1: int):
        super().__init__()
        self.dim0, self.dim1 = dim0, dim1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x with dim0 and dim1 swapped."""
        return torch.transpose(x, self.dim0, self.dim1)


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded with kernel_size - 1 zeros on the left only."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0)
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C', T)."""
        return super().forward(F.pad(x, (self.causal_padding, 0), value=0.0))


class Block1D(nn.Module):
    """conv3 -> norm -> Mish, masked before and after. Causal: LayerNorm over channels."""

    def __init__(self, dim: int, dim_out: int, groups: int = 8, causal: bool = False):
        super().__init__()
        if causal:
            self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), Transpose(1, 2),
                                       nn.LayerNorm(dim_out), Transpose(1, 2), nn.Mish())
        else:
            self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1),
                                       nn.GroupNorm(groups, dim_out), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, C, T), mask (B, 1, T) -> (B, C', T)."""
        return self.block(x * mask) * mask


class ResnetBlock1D(nn.Module):
    """Two Block1Ds with the timestep embedding added between, plus a 1x1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int, groups: int = 8, causal: bool = False):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = Block1D(dim, dim_out, groups, causal)
        self.block2 = Block1D(dim_out, dim_out, groups, causal)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time_emb: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C', T)."""
        h = self.block1(x, mask)
        h += self.mlp(time_emb).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


class Resampled(nn.Module):
    """A length-changing conv kept under the name `conv`, as upstream's Downsample1D / Upsample1D hold theirs."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T')."""
        return self.conv(x)


class GELU(nn.Module):
    """diffusers' GELU: a projection followed by exact GELU."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(.., dim_in) -> (.., dim_out)."""
        return F.gelu(self.proj(hidden_states))


class Attention(nn.Module):
    """diffusers' self-attention through torch SDPA (AttnProcessor2_0), no q/k/v bias."""

    def __init__(self, query_dim: int, heads: int, dim_head: int, dropout: float = 0.0):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(dropout)])

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) with an additive mask (B, T, T) -> (B, T, C)."""
        batch, _, _ = hidden_states.shape
        if attention_mask is not None:
            # diffusers repeats the mask per head on the batch axis, then views it as (B, H, T, T).
            if attention_mask.shape[0] < batch * self.heads:
                attention_mask = attention_mask.repeat_interleave(self.heads, dim=0)
            attention_mask = attention_mask.view(batch, self.heads, -1, attention_mask.shape[-1])
        query = self.to_q(hidden_states)
        key = self.to_k(hidden_states)
        value = self.to_v(hidden_states)
        head_dim = key.shape[-1] // self.heads
        query = query.view(batch, -1, self.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, self.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, self.heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, self.heads * head_dim).to(query.dtype)
        return self.to_out[1](self.to_out[0](out))


class FeedForward(nn.Module):
    """GELU projection to 4x width, dropout, projection back (`net.0`, `net.1`, `net.2`)."""

    def __init__(self, dim: int, dropout: float = 0.0, activation_fn: str = "gelu", mult: int = 4):
        super().__init__()
        if activation_fn != "gelu":
            raise NotImplementedError(f"U-Net act_fn {activation_fn!r} is not implemented (only 'gelu')")
        inner_dim = int(dim * mult)
        self.net = nn.ModuleList([GELU(dim, inner_dim), nn.Dropout(dropout), nn.Linear(inner_dim, dim)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


class BasicTransformerBlock(nn.Module):
    """Pre-norm self-attention and feed-forward (Matcha's block with LayerNorm, no cross-attention)."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int,
                 dropout: float = 0.0, activation_fn: str = "gelu"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, num_attention_heads, attention_head_dim, dropout)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout=dropout, activation_fn=activation_fn)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        hidden_states = self.attn1(self.norm1(hidden_states), attention_mask) + hidden_states
        return self.ff(self.norm3(hidden_states)) + hidden_states


class ConditionalDecoder(nn.Module):
    """U-Net over [x, mu, spks, cond] stacked on channels, conditioned on the timestep.

    causal=True is upstream's CausalConditionalDecoder: left-padded convs, LayerNorm blocks, and
    with streaming=True attention limited to chunks of `static_chunk_size` frames (and the past).
    meanflow=True is Chatterbox Turbo's: the step's end time r is embedded too, and both embeddings
    are mixed by `time_embed_mixer`.
    """

    def __init__(self, in_channels: int, out_channels: int, channels: list[int] | tuple[int, ...] = (256, 256),
                 dropout: float = 0.05, attention_head_dim: int = 64, n_blocks: int = 1,
                 num_mid_blocks: int = 2, num_heads: int = 4, act_fn: str = "snake",
                 causal: bool = False, static_chunk_size: int = 0, num_decoding_left_chunks: int = -1,
                 meanflow: bool = False):
        super().__init__()
        channels = tuple(channels)
        self.in_channels = in_channels
        self.causal = causal
        self.static_chunk_size = static_chunk_size
        # num_decoding_left_chunks is accepted and unused: upstream's forward attends to every left chunk.
        self.time_embeddings = SinusoidalPosEmb(in_channels)
        time_embed_dim = channels[0] * 4
        self.time_mlp = TimestepEmbedding(in_channels, time_embed_dim)

        def resnet(dim: int, dim_out: int) -> ResnetBlock1D:
            return ResnetBlock1D(dim, dim_out, time_embed_dim, causal=causal)

        def transformers(dim: int) -> nn.ModuleList:
            return nn.ModuleList([BasicTransformerBlock(dim, num_heads, attention_head_dim, dropout, act_fn)
                                  for _ in range(n_blocks)])

        def same_length_conv(dim: int) -> nn.Module:
            return CausalConv1d(dim, dim, 3) if causal else nn.Conv1d(dim, dim, 3, padding=1)

        self.down_blocks = nn.ModuleList()
        output_channel = in_channels
        for i, width in enumerate(channels):
            input_channel, output_channel = output_channel, width
            is_last = i == len(channels) - 1
            # upstream's Downsample1D: a stride-2 conv3, not causal even in the causal U-Net
            down = same_length_conv(output_channel) if is_last else \
                Resampled(nn.Conv1d(output_channel, output_channel, 3, 2, 1))
            self.down_blocks.append(nn.ModuleList([resnet(input_channel, output_channel),
                                                   transformers(output_channel), down]))
        self.mid_blocks = nn.ModuleList([
            nn.ModuleList([resnet(channels[-1], output_channel), transformers(output_channel)])
            for _ in range(num_mid_blocks)
        ])
        up_channels = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(up_channels) - 1):
            input_channel, output_channel = up_channels[i] * 2, up_channels[i + 1]
            is_last = i == len(up_channels) - 2
            # upstream's Upsample1D: a transposed conv (kernel 4, stride 2) doubling the length
            up = same_length_conv(output_channel) if is_last else \
                Resampled(nn.ConvTranspose1d(output_channel, output_channel, 4, 2, 1))
            self.up_blocks.append(nn.ModuleList([resnet(input_channel, output_channel),
                                                 transformers(output_channel), up]))
        self.final_block = Block1D(up_channels[-1], up_channels[-1], causal=causal)
        self.final_proj = nn.Conv1d(up_channels[-1], out_channels, 1)
        self.time_embed_mixer = nn.Linear(2 * time_embed_dim, time_embed_dim, bias=False) if meanflow else None

    def _attention_bias(self, x: torch.Tensor, mask: torch.Tensor, streaming: bool) -> torch.Tensor:
        if self.causal and streaming:
            allowed = add_optional_chunk_mask(x, mask.bool(), self.static_chunk_size)
        else:
            allowed = add_optional_chunk_mask(x, mask.bool(), 0).repeat(1, x.size(1), 1)
        return mask_to_bias(allowed, x.dtype)

    def _transformers(self, blocks: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor,
                      streaming: bool) -> torch.Tensor:
        x = x.transpose(1, 2).contiguous()
        bias = self._attention_bias(x, mask, streaming)
        for block in blocks:
            x = block(x, bias)
        return x.transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor | None = None, cond: torch.Tensor | None = None,
                streaming: bool = False, r: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity (B, out, T) for x, mu, cond (B, C, T), mask (B, 1, T), t and r (B,) (r: mean flow), spks (B, S)."""
        t = self.time_embeddings(t).to(t.dtype)
        t = self.time_mlp(t)
        if self.time_embed_mixer is not None:
            if r is None:
                raise ValueError("a mean-flow estimator needs the step's end time r")
            r = self.time_mlp(self.time_embeddings(r).to(t.dtype))
            t = self.time_embed_mixer(torch.cat([t, r], dim=1))
        parts = [x, mu]
        if spks is not None:
            parts.append(spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        if cond is not None:
            parts.append(cond)
        x = torch.cat(parts, dim=1)

        hiddens = []
        masks = [mask]
        for resnet, transformers, downsample in self.down_blocks:
            mask_down = masks[-1]
            x = resnet(x, mask_down, t)
            x = self._transformers(transformers, x, mask_down, streaming)
            hiddens.append(x)
            x = downsample(x * mask_down)
            masks.append(mask_down[:, :, ::2])
        masks = masks[:-1]
        mask_mid = masks[-1]

        for resnet, transformers in self.mid_blocks:
            x = resnet(x, mask_mid, t)
            x = self._transformers(transformers, x, mask_mid, streaming)

        for resnet, transformers, upsample in self.up_blocks:
            mask_up = masks.pop()
            skip = hiddens.pop()
            x = torch.cat([x[:, :, :skip.shape[-1]], skip], dim=1)
            x = resnet(x, mask_up, t)
            x = self._transformers(transformers, x, mask_up, streaming)
            x = upsample(x * mask_up)
        x = self.final_block(x, mask_up)
        return self.final_proj(x * mask_up) * mask
