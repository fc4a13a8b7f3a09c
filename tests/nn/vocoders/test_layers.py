"""HiFT building blocks: weight-norm folding is torch's parametrization bit for bit; causal convs."""

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from mizuoto.nn.vocoders.layers import (CausalConv1d, CausalConv1dDownSample, CausalConv1dUpsample, ResBlock,
                                         Snake, fold_weight_norm)


@pytest.mark.parametrize("make", [lambda: nn.Conv1d(6, 5, 7, padding=3), lambda: nn.ConvTranspose1d(6, 3, 16, 8),
                                  lambda: nn.Conv1d(80, 16, 4)], ids=["conv", "conv_transpose", "conv_k4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_equals_parametrization(make, dtype):
    torch.manual_seed(0)
    module = weight_norm(make())
    with torch.no_grad():
        module.parametrizations.weight.original0.mul_(3.0)  # g no longer equals ||v||
    module = module.to(dtype)
    g, v = module.parametrizations.weight.original0, module.parametrizations.weight.original1
    assert torch.equal(fold_weight_norm(g.float(), v.float(), dtype), module.weight)


def test_fold_casts_before_normalizing():
    """Folding in float64 (CosyVoice 3's F0 predictor) is not folding in float32 and casting."""
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(64, 64, 3, generator=gen)
    g = torch.rand(64, 1, 1, generator=gen) + 0.5
    folded = fold_weight_norm(g, v, torch.float64)
    assert folded.dtype == torch.float64
    assert torch.equal(folded, torch._weight_norm(v.double(), g.double(), 0))
    assert not torch.equal(folded, fold_weight_norm(g, v).double())


def test_snake_formula():
    snake = Snake(4)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([0.5, 1.0, 2.0, 3.0]))
    x = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(0))
    a = snake.alpha.detach()[None, :, None]
    assert torch.allclose(snake(x), x + torch.sin(a * x) ** 2 / a, atol=1e-6)


def test_causal_conv_sides_and_cache():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 10)
    left = CausalConv1d(3, 2, 3, dilation=2)
    assert left.causal_padding == 4 and left(x).shape == (1, 2, 10)
    # Output t depends only on inputs up to t.
    y = left(x)
    x2 = x.clone()
    x2[:, :, 6:] += 1.0
    assert torch.equal(left(x2)[:, :, :6], y[:, :, :6])
    right = CausalConv1d(3, 2, 4, causal_type="right")
    assert right.causal_padding == 3
    # Handing the last frames as the look-ahead cache equals running on them with no padding.
    tail = right(x[:, :, :-3], x[:, :, -3:])
    assert torch.equal(tail, nn.functional.conv1d(x, right.weight, right.bias))
    with pytest.raises(ValueError):
        right(x, x[:, :, :2])


def test_causal_resampling_shapes():
    x = torch.randn(1, 4, 12)
    assert CausalConv1dUpsample(4, 2, 7, 3)(x).shape == (1, 2, 36)
    # Left padding of stride - 1, then a plain strided conv.
    assert CausalConv1dDownSample(4, 2, 6, 3)(x).shape == (1, 2, (12 + 2 - 6) // 3 + 1)


@pytest.mark.parametrize("causal", [False, True])
def test_resblock_keeps_shape_and_names_weight_normed_convs(causal):
    block = ResBlock(4, 3, [1, 3, 5], causal=causal)
    assert block(torch.randn(1, 4, 20)).shape == (1, 4, 20)
    assert block.weight_normed() == [f"convs{j}.{i}" for j in (1, 2) for i in range(3)]
