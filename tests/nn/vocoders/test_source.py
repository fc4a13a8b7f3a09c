"""Source noise: randn_like draws where torch.randn_like does; the sine generators' draw order."""

import torch

from mizuoto.nn.vocoders.source import SineGen, SineGen2, SourceModuleHnNSF, randn_like


def test_randn_like_equals_torch_randn_like_on_transposed_input():
    x = torch.zeros(1, 9, 1000).transpose(1, 2)  # (1, L, 9), strides (9L, 1, L): SineGen2's layout
    torch.manual_seed(5)
    expected = torch.randn_like(x)
    got = randn_like(x, torch.Generator().manual_seed(5))
    assert got.stride() == x.stride()
    assert torch.equal(got, expected)
    # Drawing into a fresh tensor of the same shape lands the draws elsewhere.
    assert not torch.equal(torch.randn(1, 1000, 9, generator=torch.Generator().manual_seed(5)), expected)


def test_randn_like_contiguous_and_default_generator():
    x = torch.zeros(1, 777, 1)
    torch.manual_seed(3)
    a = randn_like(x)
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn_like(x))


def _f0(length: int, voiced: float = 180.0) -> torch.Tensor:
    f0 = torch.full((1, length, 1), voiced)
    f0[:, : length // 4] = 0.0  # an unvoiced stretch
    return f0


def test_sinegen2_draw_order_matches_upstreams_global_calls():
    """rand(1, 9) for the phases, randn_like(sine) (transposed), then randn_like(uv) in the source."""
    length, scale = 480 * 6, 480
    source = SourceModuleHnNSF(SineGen2(24000, scale, 8, 0.1, 0.003, 10), 8, 0.1)
    g = torch.Generator().manual_seed(11)
    source(_f0(length), g)
    ref = torch.Generator().manual_seed(11)
    torch.rand(1, 9, generator=ref)
    torch.empty(1, 9, length).transpose(1, 2).normal_(generator=ref)
    torch.empty(1, length, 1).normal_(generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())


def test_sinegen_draw_order():
    """CosyVoice 1: Uniform(-pi, pi) phases (1, 9, 1), randn_like(sine (1, 9, L)), randn_like(uv)."""
    length = 256 * 5
    source = SourceModuleHnNSF(SineGen(22050, 8, 0.1, 0.003, 10), 8, 0.1)
    g = torch.Generator().manual_seed(2)
    out = source(_f0(length), g)
    assert out.shape == (1, length, 1)
    ref = torch.Generator().manual_seed(2)
    torch.rand(1, 9, 1, generator=ref)
    torch.randn(1, 9, length, generator=ref)
    torch.randn(1, length, 1, generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())


class _Fixed:
    def __init__(self):
        self.asked = []

    def rand_ini(self):
        return torch.zeros(1, 9)

    def sine_waves(self, length):
        self.asked.append(length)
        return torch.full((1, length, 9), 0.5)


def test_causal_sinegen2_uses_fixed_noise_and_draws_nothing():
    fixed = _Fixed()
    source = SourceModuleHnNSF(SineGen2(24000, 480, 8, 0.1, 0.003, 10, fixed_noise=fixed), 8, 0.1)
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    a = source(_f0(960), g)
    b = source(_f0(960), None)
    assert torch.equal(a, b) and torch.equal(g.get_state(), before)
    assert fixed.asked == [960, 960]
