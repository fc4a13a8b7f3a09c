"""Masks, relative positions and input layers of the wenet-lineage encoders."""

import math

import pytest
import torch

from mizuoto.nn.transformer.attention import RelPositionMultiHeadedAttention
from mizuoto.nn.transformer.embedding import EspnetRelPositionalEncoding, PositionalEncoding, make_input_layer
from mizuoto.nn.transformer.masks import add_optional_chunk_mask, make_pad_mask, mask_to_bias, subsequent_chunk_mask


def test_make_pad_mask_marks_padding():
    mask = make_pad_mask(torch.tensor([5, 3, 2]))
    assert mask.tolist() == [[False] * 5, [False] * 3 + [True] * 2, [False] * 2 + [True] * 3]
    assert make_pad_mask(torch.tensor([2]), max_len=4).tolist() == [[False, False, True, True]]


def test_subsequent_chunk_mask_sees_to_the_end_of_its_chunk():
    assert subsequent_chunk_mask(4, 2).int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert subsequent_chunk_mask(3, 1).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_add_optional_chunk_mask_static_full_and_empty_rows():
    xs = torch.zeros(1, 5, 2)
    pad = torch.tensor([[[True, True, True, False, False]]])
    assert add_optional_chunk_mask(xs, pad, 0) is pad
    chunked = add_optional_chunk_mask(xs, pad, 2)
    assert chunked.shape == (1, 5, 5)
    assert chunked[0, 0].tolist() == [True, True, False, False, False]
    assert chunked[0, 4].tolist() == [True, True, True, False, False]
    # A row with nothing visible is opened fully rather than producing NaNs.
    nothing = torch.zeros(1, 1, 5, dtype=torch.bool)
    opened = add_optional_chunk_mask(xs, nothing, 0)
    assert opened.all() and not nothing.any()
    decoding = add_optional_chunk_mask(xs, torch.ones(1, 1, 5, dtype=torch.bool), 0, 2, use_dynamic_chunk=True)
    assert torch.equal(decoding[0], subsequent_chunk_mask(5, 2))


def test_mask_to_bias_is_zero_or_minus_1e10():
    bias = mask_to_bias(torch.tensor([True, False]), torch.float32)
    assert bias.tolist() == [0.0, -1.0e10]
    with pytest.raises(TypeError):
        mask_to_bias(torch.ones(2), torch.float32)


def test_espnet_rel_encoding_layout():
    enc = EspnetRelPositionalEncoding(8, 0.0).eval()
    x = torch.ones(1, 6, 8)
    scaled, pos = enc(x)
    assert torch.equal(scaled, x * math.sqrt(8))
    assert pos.shape == (1, 11, 8)
    # Middle row is relative offset 0: sin(0) = 0, cos(0) = 1; rows before it are positive offsets.
    assert pos[0, 5, 0::2].abs().max() == 0 and torch.equal(pos[0, 5, 1::2], torch.ones(4))
    assert torch.allclose(pos[0, 4, 0], torch.sin(torch.tensor(1.0)))
    assert torch.allclose(pos[0, 6, 0], torch.sin(torch.tensor(-1.0)))


def test_espnet_rel_encoding_grows_past_its_table():
    enc = EspnetRelPositionalEncoding(4, 0.0, max_len=3).eval()
    _, pos = enc(torch.zeros(1, 5, 4))
    assert pos.shape == (1, 9, 4)


def test_abs_encoding_adds_the_table():
    enc = PositionalEncoding(4, 0.0).eval()
    out, pos = enc(torch.zeros(1, 3, 4), offset=2)
    assert torch.equal(out, pos) and torch.allclose(pos[0, 0, 0], torch.sin(torch.tensor(2.0)))


def test_rel_shift_indexes_by_key_position():
    t = 4
    # scores[i, r] where r indexes relative offsets t-1 ... -(t-1); entry = offset value.
    offsets = torch.arange(t - 1, -t, -1).float()
    x = offsets.expand(1, 1, t, 2 * t - 1).clone()
    shifted = RelPositionMultiHeadedAttention.rel_shift(x)
    assert shifted.shape == (1, 1, t, t)
    for i in range(t):
        for j in range(t):
            assert shifted[0, 0, i, j] == i - j


def test_input_layers_and_unknown_names():
    legacy = make_input_layer("linear_legacy", "rel_pos_espnet", 3, 4, 0.0, 0.0)
    assert isinstance(legacy.out[-1], torch.nn.ReLU)
    plain = make_input_layer("linear", "abs_pos", 3, 4, 0.0, 0.0)
    assert len(plain.out) == 3
    with pytest.raises(ValueError, match="conv2d"):
        make_input_layer("conv2d", "rel_pos_espnet", 3, 4, 0.0, 0.0)
    with pytest.raises(ValueError, match="rel_pos"):
        make_input_layer("linear", "rel_pos", 3, 4, 0.0, 0.0)
