"""The flow U-Net: shapes, upstream's key layout, causality and streaming chunks."""

import math

import pytest
import torch

from mizuoto.nn.flow.unet1d import Attention, CausalConv1d, ConditionalDecoder, SinusoidalPosEmb


def _unet(causal: bool, channels=(16,), chunk=0):
    torch.manual_seed(0)
    return ConditionalDecoder(in_channels=4 * 6, out_channels=6, channels=channels, dropout=0.0,
                              attention_head_dim=4, n_blocks=1, num_mid_blocks=1, num_heads=2,
                              act_fn="gelu", causal=causal, static_chunk_size=chunk).eval()


def _inputs(t: int, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    x, mu, cond = (torch.randn(batch, 6, t, generator=g) for _ in range(3))
    return x, torch.ones(batch, 1, t), mu, torch.rand(batch, generator=g), torch.randn(batch, 6, generator=g), cond


def test_sinusoidal_pos_emb_formula():
    emb = SinusoidalPosEmb(8)(torch.tensor([0.5]))
    freqs = torch.exp(torch.arange(4).float() * -(math.log(10000) / 3))
    want = torch.cat([(1000 * 0.5 * freqs).sin(), (1000 * 0.5 * freqs).cos()])
    assert torch.allclose(emb[0], want)
    with pytest.raises(ValueError):
        SinusoidalPosEmb(7)


def test_causal_conv_ignores_the_future():
    torch.manual_seed(0)
    conv = CausalConv1d(3, 3, 3)
    x = torch.randn(1, 3, 8)
    y = x.clone()
    y[:, :, 5:] = 9.0
    assert torch.equal(conv(x)[:, :, :5], conv(y)[:, :, :5])


@pytest.mark.parametrize("causal,channels", [(False, (16, 16)), (True, (16,))])
def test_unet_shapes_and_key_layout(causal, channels):
    unet = _unet(causal, channels)
    out = unet(*_inputs(10))
    assert out.shape == (2, 6, 10)
    keys = set(unet.state_dict())
    norm = "block.2" if causal else "block.1"  # LayerNorm sits between two transposes when causal
    assert f"down_blocks.0.0.block1.{norm}.weight" in keys
    assert "down_blocks.0.1.0.attn1.to_out.0.bias" in keys and "down_blocks.0.1.0.ff.net.0.proj.weight" in keys
    assert "down_blocks.0.1.0.attn1.to_q.bias" not in keys
    if len(channels) > 1:
        assert "down_blocks.0.2.conv.weight" in keys and "up_blocks.0.2.conv.weight" in keys


def test_streaming_chunks_hide_later_frames():
    unet = _unet(True, chunk=4)
    x, mask, mu, t, spks, cond = _inputs(12)
    changed = x.clone()
    changed[:, :, 8:] = torch.randn(2, 6, 4)
    a = unet(x, mask, mu, t, spks, cond, streaming=True)
    b = unet(changed, mask, mu, t, spks, cond, streaming=True)
    assert torch.equal(a[:, :, :8], b[:, :, :8]) and not torch.equal(a[:, :, 8:], b[:, :, 8:])
    # Without streaming every frame attends to every other.
    c = unet(x, mask, mu, t, spks, cond)
    d = unet(changed, mask, mu, t, spks, cond)
    assert not torch.equal(c[:, :, :4], d[:, :, :4])


def test_attention_matches_the_textbook_formula():
    torch.manual_seed(0)
    attn = Attention(8, heads=2, dim_head=4).eval()
    x = torch.randn(2, 5, 8)
    allowed = torch.ones(2, 5, 5, dtype=torch.bool)
    allowed[:, :, 3:] = False
    bias = (1.0 - allowed.float()) * -1e10
    got = attn(x, bias)
    q, k, v = (w(x).view(2, 5, 2, 4).transpose(1, 2) for w in (attn.to_q, attn.to_k, attn.to_v))
    scores = q @ k.transpose(-1, -2) / 2.0 + bias[:, None]
    want = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 8)
    assert torch.allclose(got, attn.to_out[0](want), atol=1e-6)


def test_only_gelu_feed_forward_is_built():
    with pytest.raises(NotImplementedError, match="snake"):
        ConditionalDecoder(in_channels=24, out_channels=6, channels=(16,), act_fn="snake")
