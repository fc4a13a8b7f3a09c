"""`logits.suppress`: transformers' suppress-tokens (and min-length) masking, on hand-made scores."""

import torch

from mizuoto.nn.lm import logits as lp

INF = float("inf")


def test_suppress_sets_the_given_ids_to_minus_infinity_in_every_row_and_leaves_the_input():
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0, -3.0, -4.0]])
    out = lp.suppress(scores, torch.tensor([1, 3]))
    assert torch.equal(out, torch.tensor([[1.0, -INF, 3.0, -INF], [-1.0, -INF, -3.0, -INF]]))
    assert torch.equal(scores[0], torch.tensor([1.0, 2.0, 3.0, 4.0])), "the input is left as it was"


def test_suppressing_no_id_or_an_id_outside_the_vocabulary_changes_nothing():
    scores = torch.tensor([[1.0, 2.0]])
    assert torch.equal(lp.suppress(scores, torch.tensor([], dtype=torch.int64)), scores)
    assert torch.equal(lp.suppress(scores, torch.tensor([5])), scores)
