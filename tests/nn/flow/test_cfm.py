"""The flow-matching sampler: schedule, guidance, fixed and per-request noise, v1 streaming cache."""

import math

import pytest
import torch
from torch import nn

from mizuoto.nn.flow.cfm import FIXED_NOISE_SHAPE, ConditionalCFM
from mizuoto.nn.flow.length_regulator import InterpolateRegulator, mel_frames_for_tokens


class ConstantVelocity(nn.Module):
    """Row 0 (conditional) moves at +1, row 1 (unconditional) at -1; records its inputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, mask, mu, t, spks, cond, streaming=False):
        self.calls.append({"x": x.clone(), "mu": mu.clone(), "t": t.clone(), "spks": spks.clone(),
                           "cond": cond.clone(), "streaming": streaming})
        out = torch.ones_like(x)
        out[1] = -1
        return out


def _inputs(frames=7, feats=4):
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(1, feats, frames, generator=g)
    return mu, torch.ones(1, 1, frames), torch.randn(1, feats, generator=g), torch.randn(1, feats, frames, generator=g)


def test_cosine_schedule_and_guidance():
    est = ConstantVelocity()
    cfm = ConditionalCFM(est, inference_cfg_rate=0.7, fixed=True)
    mu, mask, spks, cond = _inputs()
    out = cfm(mu, mask, n_timesteps=10, spks=spks, cond=cond, streaming=True)
    start = cfm.initial_noise(mu)
    # Velocity (1 + 0.7) * 1 - 0.7 * (-1) = 2.4 over the whole span [0, 1].
    assert torch.allclose(out, start + 2.4, atol=1e-5)
    assert len(est.calls) == 10
    ts = torch.stack([c["t"][0] for c in est.calls])
    want = 1 - torch.cos(torch.linspace(0, 1, 11)[:-1] * 0.5 * math.pi)
    assert torch.allclose(ts, want, atol=1e-6)
    first = est.calls[0]
    assert torch.equal(first["mu"][1], torch.zeros_like(mu[0])) and torch.equal(first["mu"][0], mu[0])
    assert torch.equal(first["spks"][1], torch.zeros(4)) and torch.equal(first["cond"][1], torch.zeros_like(cond[0]))
    assert first["streaming"] is True


def test_fixed_noise_is_the_seed0_prefix():
    cfm = ConditionalCFM(ConstantVelocity(), fixed=True)
    mu = torch.zeros(1, FIXED_NOISE_SHAPE[1], 33)
    want = torch.randn(FIXED_NOISE_SHAPE, generator=torch.Generator().manual_seed(0))[:, :, :33]
    assert torch.equal(cfm.initial_noise(mu), want)
    with pytest.raises(ValueError, match="frames"):
        cfm.initial_noise(torch.zeros(1, FIXED_NOISE_SHAPE[1], FIXED_NOISE_SHAPE[2] + 1))


def test_per_request_noise_follows_the_generator():
    cfm = ConditionalCFM(ConstantVelocity(), fixed=False)
    mu = torch.zeros(1, 4, 9)
    a = cfm.initial_noise(mu, generator=torch.Generator().manual_seed(5))
    b = torch.randn(1, 4, 9, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_v1_cache_reuses_prompt_and_overlap_noise():
    est = ConstantVelocity()
    cfm = ConditionalCFM(est, fixed=False, overlap_frames=3)
    mu, mask, spks, cond = _inputs(frames=10)
    g = torch.Generator().manual_seed(1)
    _, cache = cfm.forward_cached(mu.clone(), mask, 2, spks, cond, prompt_len=2,
                                  cache=torch.zeros(1, 4, 0, 2), generator=g)
    assert cache.shape == (1, 4, 5, 2)
    first_x = est.calls[0]["x"][0]
    assert torch.equal(cache[0, :, :2, 0], first_x[:, :2]) and torch.equal(cache[0, :, 2:, 0], first_x[:, -3:])
    est.calls.clear()
    mu2 = torch.randn(1, 4, 10)
    cfm.forward_cached(mu2, mask, 2, spks, cond, prompt_len=2, cache=cache, generator=g)
    second = est.calls[0]
    assert torch.equal(second["x"][0][:, :5], cache[0, :, :, 0])
    assert torch.equal(second["mu"][0][:, :5], cache[0, :, :, 1])


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="t_scheduler"):
        ConditionalCFM(ConstantVelocity(), t_scheduler="sigmoid")


def test_length_regulator_frames_and_split():
    assert mel_frames_for_tokens(20, 50, 22050, 256) == 34
    torch.manual_seed(0)
    reg = InterpolateRegulator(6, [1, 1]).eval()
    prompt, target = torch.randn(1, 5, 6), torch.randn(1, 50, 6)
    out = reg.inference(prompt, target, 9, 86, overlap_tokens=20, overlap_frames=34)
    assert out.shape == (1, 95, 6)
    short = reg.inference(torch.zeros(1, 0, 6), target[:, :30], 0, 51, overlap_tokens=20, overlap_frames=34)
    assert short.shape == (1, 51, 6)
