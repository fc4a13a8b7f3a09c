"""transformers-style logits processors: each rule on hand-made scores."""

import math

import torch

from mizuoto.nn.lm import logits as lp

INF = float("inf")


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores_of_seen_tokens():
    scores = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    out = lp.repetition_penalty(torch.tensor([[0, 1, 1]]), scores, 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, -1.0]]))
    assert torch.equal(scores, torch.tensor([[2.0, -2.0, 1.0, -1.0]])), "the input is left as it was"


def test_top_k_keeps_ties_at_the_kth_score():
    out = lp.top_k(torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]), 3)
    assert torch.equal(out, torch.tensor([[3.0, -INF, 2.0, 2.0, -INF]]))
    assert torch.equal(lp.top_k(torch.tensor([[1.0, 2.0]]), 10), torch.tensor([[1.0, 2.0]]))


def test_top_p_keeps_the_smallest_head_reaching_p_and_always_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    scores = probs.log()
    out = lp.top_p(scores, 0.7)
    assert torch.isinf(out[0, 2:]).all() and torch.equal(out[0, :2], scores[0, :2])
    assert torch.equal(lp.top_p(scores, 1e-9)[0, 0], scores[0, 0]) and torch.isinf(lp.top_p(scores, 1e-9)[0, 1:]).all()
    assert torch.equal(lp.top_p(scores, 1.0), scores)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    scores = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.06), math.log(0.04)]])
    out = lp.min_p(scores, 0.2)  # threshold 0.12
    assert torch.equal(out[0, :2], scores[0, :2]) and torch.isinf(out[0, 2:]).all()
    assert torch.equal(lp.min_p(scores, 1.0)[0, 0], scores[0, 0]), "the top token is always kept"


def test_temperature_divides():
    assert torch.equal(lp.temperature(torch.tensor([[1.0, -3.0]]), 2.0), torch.tensor([[0.5, -1.5]]))
