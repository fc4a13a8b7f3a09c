"""Encoders: chunked attention really is chunked, streaming decode equals a full causal pass."""

import pytest
import torch

from mizuoto.nn.transformer.upsample import PreLookaheadLayer, Upsample1D, UpsampleConformerEncoder
from mizuoto.nn.transformer.wenet import ConformerEncoder, TransformerEncoder


def _conformer(**kw):
    torch.manual_seed(0)
    args = dict(input_size=8, output_size=8, attention_heads=2, linear_units=16, num_blocks=2,
                input_layer="linear", pos_enc_layer_type="rel_pos_espnet", use_cnn_module=False,
                macaron_style=False)
    args.update(kw)
    return ConformerEncoder(**args).eval()


def test_conformer_output_shape_and_mask():
    enc = _conformer()
    xs = torch.randn(2, 7, 8)
    out, mask = enc(xs, torch.tensor([7, 4]))
    assert out.shape == (2, 7, 8) and mask.shape == (2, 1, 7)
    assert mask[1, 0].tolist() == [True] * 4 + [False] * 3


def test_padding_does_not_leak_into_real_frames():
    enc = _conformer()
    xs = torch.randn(1, 6, 8)
    padded = torch.cat([xs, 100 * torch.randn(1, 3, 8)], dim=1)
    a, _ = enc(xs, torch.tensor([6]))
    b, _ = enc(padded, torch.tensor([6]))
    assert torch.allclose(a, b[:, :6], atol=1e-5)


def test_static_chunks_hide_the_future():
    enc = _conformer(static_chunk_size=3)
    xs = torch.randn(1, 9, 8)
    changed = xs.clone()
    changed[:, 6:] = torch.randn(1, 3, 8)
    a, _ = enc(xs, torch.tensor([9]))
    b, _ = enc(changed, torch.tensor([9]))
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.equal(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("pos", ["rel_pos_espnet", "abs_pos"])
def test_forward_chunk_equals_a_causal_full_pass(pos):
    torch.manual_seed(0)
    enc = TransformerEncoder(8, output_size=8, attention_heads=2, linear_units=16, num_blocks=2,
                             input_layer="linear_legacy", pos_enc_layer_type=pos,
                             selfattention_layer_type="rel_selfattn" if pos == "rel_pos_espnet" else "selfattn").eval()
    xs = torch.randn(1, 6, 8)
    full, _, _ = enc.forward_chunk(xs, 0, -1, att_mask=torch.tril(torch.ones(1, 6, 6)).bool())
    # Prompt of 4, then one frame at a time with the cache, as the CosyVoice 1 LM decodes.
    first, cache, _ = enc.forward_chunk(xs[:, :4], 0, -1, att_mask=torch.tril(torch.ones(1, 4, 4)).bool())
    steps = [first]
    offset = 4
    for i in range(4, 6):
        y, cache, _ = enc.forward_chunk(xs[:, i:i + 1], offset, -1, att_cache=cache,
                                        att_mask=torch.ones(1, 1, 1, dtype=torch.bool))
        steps.append(y)
        offset += 1
    assert cache.shape == (2, 2, 6, 8)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_pre_lookahead_context_equals_the_longer_input():
    torch.manual_seed(0)
    layer = PreLookaheadLayer(4, 6, pre_lookahead_len=3).eval()
    xs = torch.randn(1, 10, 4)
    whole = layer(xs)
    with_context = layer(xs[:, :7], context=xs[:, 7:])
    assert torch.allclose(with_context, whole[:, :7], atol=1e-6)
    with pytest.raises(ValueError, match="3 frames"):
        layer(xs[:, :7], context=xs[:, 7:9])


def test_upsample_is_causal_and_doubles():
    torch.manual_seed(0)
    up = Upsample1D(4, 4, stride=2).eval()
    xs = torch.randn(1, 4, 5)
    out, lens = up(xs, torch.tensor([5]))
    assert out.shape == (1, 4, 10) and lens.tolist() == [10]
    changed = xs.clone()
    changed[:, :, 3:] = 0
    out2, _ = up(changed, torch.tensor([5]))
    assert torch.equal(out[:, :, :6], out2[:, :, :6])


def test_upsample_encoder_streaming_and_context():
    torch.manual_seed(0)
    enc = UpsampleConformerEncoder(8, output_size=8, attention_heads=2, linear_units=16, num_blocks=1,
                                   input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
                                   use_cnn_module=False, macaron_style=False, static_chunk_size=2,
                                   pre_lookahead_len=3, upsample_stride=2, num_up_blocks=2).eval()
    xs = torch.randn(1, 9, 8)
    out, mask = enc(xs, torch.tensor([9]), streaming=True)
    assert out.shape == (1, 18, 8) and mask.shape == (1, 1, 18)
    # Not final: the last 3 tokens are look-ahead only.
    part, _ = enc(xs[:, :6], torch.tensor([9]), context=xs[:, 6:], streaming=True)
    assert part.shape == (1, 12, 8)
    assert torch.allclose(part, out[:, :12], atol=1e-5)
