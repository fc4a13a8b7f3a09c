"""transformers' logits processors, op for op: what a Hugging Face style sampling loop does to scores.

Each takes scores (B, V) and returns new scores, as `transformers.generation.logits_process`
(5.2.0) computes them, so a loop built from them draws the same tokens from the same generator:
repetition penalty (gather, divide or multiply by sign, scatter), temperature (a division),
top-k (below the k-th largest), top-p (an ascending sort, softmax, cumulative sum, the tail at
or under 1 - p dropped, the last token always kept) and min-p (below min_p times the top
probability, the top token always kept) and suppression (the scores of given ids set to -inf by a
`torch.where` over an `isin` mask: transformers' suppress-tokens processor, and its min-length and
min-new-tokens processors while they hold the stop ids back). Removed scores become -inf.
"""

from __future__ import annotations

import torch

NEG_INF = -float("inf")


def repetition_penalty(ids: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """Scores of the tokens in `ids` (B, N) divided by `penalty` where positive, multiplied where negative."""
    picked = torch.gather(scores, 1, ids)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(1, ids, picked)


def temperature(scores: torch.Tensor, t: float) -> torch.Tensor:
    """Scores divided by the temperature."""
    return scores / t


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Scores below the k-th largest removed."""
    k = min(k, scores.shape[-1])
    return scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], NEG_INF)


def top_p(scores: torch.Tensor, p: float, keep: int = 1) -> torch.Tensor:
    """The smallest set of top tokens whose probability reaches p kept (at least `keep`)."""
    ordered, order = torch.sort(scores, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p)
    drop[..., -keep:] = 0
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def min_p(scores: torch.Tensor, p: float, keep: int = 1) -> torch.Tensor:
    """Tokens less probable than p times the most probable one removed (the top `keep` always kept)."""
    probs = torch.softmax(scores, dim=-1)
    drop = probs < p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, torch.topk(probs, min(keep, probs.shape[-1]), dim=-1).indices, False)
    return scores.masked_fill(drop, NEG_INF)


def suppress(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Scores of the token ids in `ids` (1-D) set to -inf, every row (also how a minimum length masks the stop ids)."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    return torch.where(torch.isin(vocab, ids.to(scores.device)), NEG_INF, scores)
