"""Wenet-lineage encoders CosyVoice uses: TransformerEncoder and ConformerEncoder.

Module and parameter names follow upstream so checkpoints load by their own keys; every size
is a constructor argument (from the model's yaml). The upsampling conformer of CosyVoice 2's
flow lives in `upsample.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from mizuoto.nn.transformer.attention import _NO_CACHE, _NO_MASK, ATTENTIONS
from mizuoto.nn.transformer.embedding import make_input_layer
from mizuoto.nn.transformer.masks import add_optional_chunk_mask, make_pad_mask

ACTIVATIONS = {
    "hardtanh": nn.Hardtanh,
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "selu": nn.SELU,
    "swish": nn.SiLU,
    "gelu": nn.GELU,
}


def make_activation(name: str) -> nn.Module:
    """An activation module by its wenet yaml name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation_type {name!r} is not supported (known: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]()


def _attention_class(selfattention_layer_type: str) -> type:
    if selfattention_layer_type not in ATTENTIONS:
        raise ValueError(f"selfattention_layer_type {selfattention_layer_type!r} is not supported")
    return ATTENTIONS[selfattention_layer_type]


class PositionwiseFeedForward(nn.Module):
    """w_2(dropout(act(w_1(x))))."""

    def __init__(self, idim: int, hidden_units: int, dropout_rate: float, activation: nn.Module):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = activation
        self.dropout = nn.Dropout(dropout_rate)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.w_2(self.dropout(self.activation(self.w_1(xs))))


class TransformerEncoderLayer(nn.Module):
    """Self-attention + feed-forward, pre- or post-norm."""

    def __init__(self, size: int, self_attn: nn.Module, feed_forward: nn.Module,
                 dropout_rate: float, normalize_before: bool = True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor,
                mask_pad: torch.Tensor = _NO_MASK, att_cache: torch.Tensor = _NO_CACHE,
                cnn_cache: torch.Tensor = _NO_CACHE
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, mask, new_att_cache, empty cnn cache)."""
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x_att, new_att_cache = self.self_attn(x, x, x, mask, pos_emb=pos_emb, cache=att_cache)
        x = residual + self.dropout(x_att)
        if not self.normalize_before:
            x = self.norm1(x)

        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm2(x)
        return x, mask, new_att_cache, torch.zeros((0, 0, 0), dtype=x.dtype, device=x.device)


class ConformerEncoderLayer(nn.Module):
    """Conformer block without the convolution module (CosyVoice's yamls turn it off)."""

    def __init__(self, size: int, self_attn: nn.Module, feed_forward: nn.Module,
                 feed_forward_macaron: nn.Module | None, dropout_rate: float,
                 normalize_before: bool = True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.feed_forward_macaron = feed_forward_macaron
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)
        if feed_forward_macaron is not None:
            self.norm_ff_macaron = nn.LayerNorm(size, eps=1e-12)
            self.ff_scale = 0.5
        else:
            self.ff_scale = 1.0
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor,
                mask_pad: torch.Tensor = _NO_MASK, att_cache: torch.Tensor = _NO_CACHE,
                cnn_cache: torch.Tensor = _NO_CACHE
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, mask, new_att_cache, empty cnn cache)."""
        if self.feed_forward_macaron is not None:
            residual = x
            if self.normalize_before:
                x = self.norm_ff_macaron(x)
            x = residual + self.ff_scale * self.dropout(self.feed_forward_macaron(x))
            if not self.normalize_before:
                x = self.norm_ff_macaron(x)

        residual = x
        if self.normalize_before:
            x = self.norm_mha(x)
        x_att, new_att_cache = self.self_attn(x, x, x, mask, pos_emb, att_cache)
        x = residual + self.dropout(x_att)
        if not self.normalize_before:
            x = self.norm_mha(x)

        residual = x
        if self.normalize_before:
            x = self.norm_ff(x)
        x = residual + self.ff_scale * self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm_ff(x)
        return x, mask, new_att_cache, torch.zeros((0, 0, 0), dtype=x.dtype, device=x.device)


def conformer_layers(n: int, output_size: int, attention_heads: int, linear_units: int,
                     dropout_rate: float, attention_dropout_rate: float, normalize_before: bool,
                     macaron_style: bool, selfattention_layer_type: str, activation_type: str,
                     use_cnn_module: bool, key_bias: bool) -> nn.ModuleList:
    """n conformer layers of one width (shared by ConformerEncoder and the upsampling encoder)."""
    if use_cnn_module:
        raise NotImplementedError("conformer convolution modules are not implemented (use_cnn_module: True)")
    attn_cls = _attention_class(selfattention_layer_type)
    activation = make_activation(activation_type)  # one module shared by every layer, as upstream
    return nn.ModuleList([
        ConformerEncoderLayer(
            output_size,
            attn_cls(attention_heads, output_size, attention_dropout_rate, key_bias),
            PositionwiseFeedForward(output_size, linear_units, dropout_rate, activation),
            PositionwiseFeedForward(output_size, linear_units, dropout_rate, activation) if macaron_style else None,
            dropout_rate,
            normalize_before,
        ) for _ in range(n)
    ])


class BaseEncoder(nn.Module):
    """Input layer, a stack of `encoders`, optional final LayerNorm; full or chunked attention."""

    def __init__(self, input_size: int, output_size: int, dropout_rate: float,
                 positional_dropout_rate: float, input_layer: str, pos_enc_layer_type: str,
                 normalize_before: bool, static_chunk_size: int, use_dynamic_chunk: bool):
        super().__init__()
        self._output_size = output_size
        self.embed = make_input_layer(input_layer, pos_enc_layer_type, input_size, output_size,
                                      dropout_rate, positional_dropout_rate)
        self.normalize_before = normalize_before
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)
        self.static_chunk_size = static_chunk_size
        self.use_dynamic_chunk = use_dynamic_chunk
        self.encoders = nn.ModuleList()

    def output_size(self) -> int:
        """Width of the encoder's output."""
        return self._output_size

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor, decoding_chunk_size: int = 0,
                num_decoding_left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, D_in) -> ((B, T, D), padding mask (B, 1, T))."""
        masks = ~make_pad_mask(xs_lens, xs.size(1)).unsqueeze(1)
        xs, pos_emb, masks = self.embed(xs, masks)
        chunk_masks = add_optional_chunk_mask(xs, masks, self.static_chunk_size, decoding_chunk_size,
                                              num_decoding_left_chunks, self.use_dynamic_chunk)
        for layer in self.encoders:
            xs, chunk_masks, _, _ = layer(xs, chunk_masks, pos_emb, masks)
        if self.normalize_before:
            xs = self.after_norm(xs)
        return xs, masks

    def forward_chunk(self, xs: torch.Tensor, offset: int, required_cache_size: int,
                      att_cache: torch.Tensor = _NO_CACHE, cnn_cache: torch.Tensor = _NO_CACHE,
                      att_mask: torch.Tensor = _NO_MASK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One streaming step: (ys, att_cache (layers, H, T_cache, 2*d_k), cnn_cache (empty)).

        offset is the number of frames already encoded; required_cache_size < 0 keeps them all.
        """
        if xs.size(0) != 1:
            raise ValueError("forward_chunk decodes one sequence at a time")
        tmp_masks = torch.ones(1, xs.size(1), device=xs.device, dtype=torch.bool).unsqueeze(1)
        xs, _, _ = self.embed(xs, tmp_masks, offset)
        elayers, cache_t1 = att_cache.size(0), att_cache.size(2)
        attention_key_size = cache_t1 + xs.size(1)
        pos_emb = self.embed.pos_enc.chunk_encoding(xs, offset - cache_t1, attention_key_size)
        if required_cache_size < 0:
            next_cache_start = 0
        elif required_cache_size == 0:
            next_cache_start = attention_key_size
        else:
            next_cache_start = max(attention_key_size - required_cache_size, 0)
        new_att_caches = []
        for i, layer in enumerate(self.encoders):
            xs, _, new_att_cache, _ = layer(xs, att_mask, pos_emb,
                                            att_cache=att_cache[i:i + 1] if elayers > 0 else att_cache)
            new_att_caches.append(new_att_cache[:, :, next_cache_start:, :])
        if self.normalize_before:
            xs = self.after_norm(xs)
        empty_cnn = torch.zeros((0, 0, 0, 0), dtype=xs.dtype, device=xs.device)
        return xs, torch.cat(new_att_caches, dim=0), empty_cnn


class TransformerEncoder(BaseEncoder):
    """Transformer encoder (CosyVoice 1 LM); defaults as upstream's class."""

    def __init__(self, input_size: int, output_size: int = 256, attention_heads: int = 4,
                 linear_units: int = 2048, num_blocks: int = 6, dropout_rate: float = 0.1,
                 positional_dropout_rate: float = 0.1, attention_dropout_rate: float = 0.0,
                 input_layer: str = "conv2d", pos_enc_layer_type: str = "abs_pos",
                 normalize_before: bool = True, static_chunk_size: int = 0,
                 use_dynamic_chunk: bool = False, use_dynamic_left_chunk: bool = False,
                 key_bias: bool = True, selfattention_layer_type: str = "selfattn",
                 activation_type: str = "relu"):
        super().__init__(input_size, output_size, dropout_rate, positional_dropout_rate, input_layer,
                         pos_enc_layer_type, normalize_before, static_chunk_size, use_dynamic_chunk)
        attn_cls = _attention_class(selfattention_layer_type)
        activation = make_activation(activation_type)
        self.encoders = nn.ModuleList([
            TransformerEncoderLayer(
                output_size,
                attn_cls(attention_heads, output_size, attention_dropout_rate, key_bias),
                PositionwiseFeedForward(output_size, linear_units, dropout_rate, activation),
                dropout_rate,
                normalize_before,
            ) for _ in range(num_blocks)
        ])


class ConformerEncoder(BaseEncoder):
    """Conformer encoder (CosyVoice 1 flow and LM text encoder); defaults as upstream's class."""

    def __init__(self, input_size: int, output_size: int = 256, attention_heads: int = 4,
                 linear_units: int = 2048, num_blocks: int = 6, dropout_rate: float = 0.1,
                 positional_dropout_rate: float = 0.1, attention_dropout_rate: float = 0.0,
                 input_layer: str = "conv2d", pos_enc_layer_type: str = "rel_pos",
                 normalize_before: bool = True, static_chunk_size: int = 0,
                 use_dynamic_chunk: bool = False, use_dynamic_left_chunk: bool = False,
                 macaron_style: bool = True, selfattention_layer_type: str = "rel_selfattn",
                 activation_type: str = "swish", use_cnn_module: bool = True,
                 key_bias: bool = True):
        super().__init__(input_size, output_size, dropout_rate, positional_dropout_rate, input_layer,
                         pos_enc_layer_type, normalize_before, static_chunk_size, use_dynamic_chunk)
        self.encoders = conformer_layers(num_blocks, output_size, attention_heads, linear_units,
                                         dropout_rate, attention_dropout_rate, normalize_before,
                                         macaron_style, selfattention_layer_type, activation_type,
                                         use_cnn_module, key_bias)
