"""CosyVoice 2's token encoder: conformer at token rate, look-ahead conv, 2x upsample, conformer.

Upstream writes the look-ahead and upsampling widths as 512 and the look-ahead length as 3;
those equal the released model's `output_size` and the flow's `pre_lookahead_len`, which is
where they are taken from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.nn.transformer.embedding import make_input_layer
from mizuoto.nn.transformer.masks import add_optional_chunk_mask, make_pad_mask
from mizuoto.nn.transformer.wenet import conformer_layers

_NO_CONTEXT = torch.zeros(0, 0, 0)


class Upsample1D(nn.Module):
    """Nearest-neighbour upsampling by `stride`, then a causal conv of width 2*stride+1."""

    def __init__(self, channels: int, out_channels: int, stride: int = 2):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, out_channels, stride * 2 + 1, stride=1, padding=0)

    def forward(self, inputs: torch.Tensor, input_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, T) -> (B, C', T * stride), lengths * stride."""
        outputs = F.interpolate(inputs, scale_factor=float(self.stride), mode="nearest")
        outputs = F.pad(outputs, (self.stride * 2, 0), value=0.0)
        return self.conv(outputs), input_lengths * self.stride


class PreLookaheadLayer(nn.Module):
    """Residual conv that lets each frame see `pre_lookahead_len` future frames (zeros or context)."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int = 1):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1, stride=1, padding=0)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3, stride=1, padding=0)

    def forward(self, inputs: torch.Tensor, context: torch.Tensor = _NO_CONTEXT) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); context (B, L<=look-ahead, C) are the frames after the input."""
        outputs = inputs.transpose(1, 2).contiguous()
        context = context.transpose(1, 2).contiguous()
        if context.size(2) == 0:
            outputs = F.pad(outputs, (0, self.pre_lookahead_len), mode="constant", value=0.0)
        else:
            if context.size(2) != self.pre_lookahead_len:
                raise ValueError(f"look-ahead context must be {self.pre_lookahead_len} frames, got {context.size(2)}")
            outputs = F.pad(torch.concat([outputs, context], dim=2),
                            (0, self.pre_lookahead_len - context.size(2)), mode="constant", value=0.0)
        outputs = F.leaky_relu(self.conv1(outputs))
        outputs = F.pad(outputs, (self.conv2.kernel_size[0] - 1, 0), mode="constant", value=0.0)
        outputs = self.conv2(outputs).transpose(1, 2).contiguous()
        return outputs + inputs


class UpsampleConformerEncoder(nn.Module):
    """Token-rate conformer, look-ahead, upsampling by `upsample_stride`, frame-rate conformer."""

    def __init__(self, input_size: int, output_size: int = 256, attention_heads: int = 4,
                 linear_units: int = 2048, num_blocks: int = 6, dropout_rate: float = 0.1,
                 positional_dropout_rate: float = 0.1, attention_dropout_rate: float = 0.0,
                 input_layer: str = "conv2d", pos_enc_layer_type: str = "rel_pos",
                 normalize_before: bool = True, static_chunk_size: int = 0,
                 use_dynamic_chunk: bool = False, use_dynamic_left_chunk: bool = False,
                 macaron_style: bool = True, selfattention_layer_type: str = "rel_selfattn",
                 activation_type: str = "swish", use_cnn_module: bool = True, key_bias: bool = True,
                 pre_lookahead_len: int = 3, upsample_stride: int = 2, num_up_blocks: int = 4):
        super().__init__()
        if use_dynamic_chunk:
            raise NotImplementedError("dynamic chunks are a training feature of this encoder")
        self._output_size = output_size
        self.normalize_before = normalize_before
        self.static_chunk_size = static_chunk_size
        layer_args = (output_size, attention_heads, linear_units, dropout_rate, attention_dropout_rate,
                      normalize_before, macaron_style, selfattention_layer_type, activation_type,
                      use_cnn_module, key_bias)
        self.embed = make_input_layer(input_layer, pos_enc_layer_type, input_size, output_size,
                                      dropout_rate, positional_dropout_rate)
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(output_size, output_size, pre_lookahead_len)
        self.encoders = conformer_layers(num_blocks, *layer_args)
        self.up_layer = Upsample1D(output_size, output_size, stride=upsample_stride)
        self.up_embed = make_input_layer(input_layer, pos_enc_layer_type, input_size, output_size,
                                         dropout_rate, positional_dropout_rate)
        self.up_encoders = conformer_layers(num_up_blocks, *layer_args)

    def output_size(self) -> int:
        """Width of the encoder's output."""
        return self._output_size

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor, context: torch.Tensor = _NO_CONTEXT,
                streaming: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, D_in) tokens -> ((B, T * stride, D), mask (B, 1, T * stride)).

        context: the look-ahead tokens after xs when more will follow (streaming, not final);
        streaming: attention restricted to static chunks (and their past).
        """
        masks = ~make_pad_mask(xs_lens, xs.size(1)).unsqueeze(1)
        xs, pos_emb, masks = self.embed(xs, masks)
        if context.size(1) != 0:
            context_masks = torch.ones(1, 1, context.size(1)).to(masks)
            context, _, _ = self.embed(context, context_masks, offset=xs.size(1))
        chunk_masks = add_optional_chunk_mask(xs, masks, self.static_chunk_size if streaming else 0)
        xs = self.pre_lookahead_layer(xs, context=context)
        for layer in self.encoders:
            xs, chunk_masks, _, _ = layer(xs, chunk_masks, pos_emb, masks)

        xs = xs.transpose(1, 2).contiguous()
        xs, xs_lens = self.up_layer(xs, xs_lens)
        xs = xs.transpose(1, 2).contiguous()
        masks = ~make_pad_mask(xs_lens, xs.size(1)).unsqueeze(1)
        xs, pos_emb, masks = self.up_embed(xs, masks)
        chunk_masks = add_optional_chunk_mask(
            xs, masks, self.static_chunk_size * self.up_layer.stride if streaming else 0)
        for layer in self.up_encoders:
            xs, chunk_masks, _, _ = layer(xs, chunk_masks, pos_emb, masks)
        if self.normalize_before:
            xs = self.after_norm(xs)
        return xs, masks
