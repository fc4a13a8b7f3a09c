"""CosyVoice samplers: upstream's nucleus / RAS semantics, drawing from an explicit generator."""

import pytest
import torch

from mizuoto.engines.cosyvoice.sampling import Sampler, nucleus_sampling, random_sampling, ras_sampling
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.hyperyaml import Tagged


def _scores(seed: int, n: int = 300) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).log_softmax(0)


@pytest.mark.parametrize("seed", range(20))
def test_explicit_generator_draws_equal_the_global_generator(seed):
    scores = _scores(seed)
    torch.manual_seed(seed)
    a = [ras_sampling(scores.clone(), [3, 5], None) for _ in range(5)] + [random_sampling(scores, None)]
    after_global = torch.rand(4)
    g = torch.Generator().manual_seed(seed)
    b = [ras_sampling(scores.clone(), [3, 5], g) for _ in range(5)] + [random_sampling(scores, g)]
    assert a == b and torch.equal(after_global, torch.rand(4, generator=g))


def test_nucleus_keeps_top_k_in_stable_order():
    # 100 equal probabilities: 25 are kept (cumulative 0.25 < 0.8), the first 25 by index
    scores = torch.zeros(100)
    g = torch.Generator().manual_seed(0)
    drawn = {nucleus_sampling(scores, g, top_p=0.8, top_k=25) for _ in range(400)}
    assert drawn <= set(range(25)) and len(drawn) > 20


def test_nucleus_stops_at_top_p():
    # 0.5 then 0.3 reaches 0.8, so 0.15 and 0.05 are never drawn
    scores = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    g = torch.Generator().manual_seed(0)
    assert {nucleus_sampling(scores, g, top_p=0.8, top_k=25) for _ in range(300)} == {1, 3}


def test_ras_redraws_a_repeated_token_from_the_full_distribution():
    scores = torch.tensor([20.0, 0.0, 0.0, 0.0]).log_softmax(0)
    g = torch.Generator().manual_seed(0)
    assert ras_sampling(scores.clone(), [5, 6], g) == 0
    s = scores.clone()
    token = ras_sampling(s, [0], g)  # 0 occurs once in the window: win_size * tau_r = 1
    assert token != 0 and s[0] == -float("inf")
    # only the last win_size tokens count
    assert ras_sampling(scores.clone(), [0] + [1] * 10, g) == 0


def test_sampler_from_yaml_node():
    node = Tagged("name", "cosyvoice.utils.common.ras_sampling",
                  {"top_p": 0.7, "top_k": 20, "win_size": 8, "tau_r": 0.2})
    s = Sampler.from_yaml(node)
    assert (s.kind, s.top_p, s.top_k, s.win_size, s.tau_r) == ("ras_sampling", 0.7, 20, 8, 0.2)
    with pytest.raises(ModelLoadError, match="unknown sampler"):
        Sampler.from_yaml(Tagged("name", "x.y.beam_search", {}))
    with pytest.raises(ModelLoadError, match="no argument"):
        Sampler.from_yaml(Tagged("name", "cosyvoice.utils.common.nucleus_sampling", {"win_size": 3}))
