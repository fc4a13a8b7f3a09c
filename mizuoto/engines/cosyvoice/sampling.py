"""CosyVoice's token samplers (upstream cosyvoice/utils/common.py), drawing from a given generator.

The order and dtype of every operation is upstream's, because the tokens depend on it: the
nucleus is grown one 0-d float32 addition at a time and compared with top_p; the draw is
`multinomial(1, replacement=True)` on the kept (unnormalized) probabilities, which consumes the
generator exactly as upstream's draw on the global generator does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.sampling import SAMPLER_KINDS, SamplerSettings


def nucleus_sampling(scores: torch.Tensor, generator: torch.Generator | None,
                     top_p: float = 0.8, top_k: int = 25) -> int:
    """Draw from the smallest prefix of the sorted distribution reaching top_p, at most top_k long."""
    probs, ids = [], []
    cum_prob = 0.0  # becomes a 0-d tensor after the first addition, as upstream's does
    sorted_value, sorted_idx = scores.softmax(dim=0).sort(descending=True, stable=True)
    for i in range(len(sorted_idx)):
        if not (cum_prob < top_p and len(probs) < top_k):
            break
        cum_prob += sorted_value[i]
        probs.append(sorted_value[i])
        ids.append(sorted_idx[i])
    prob = torch.tensor(probs).to(scores)
    indices = torch.tensor(ids, dtype=torch.long).to(scores.device)
    return indices[prob.multinomial(1, replacement=True, generator=generator)].item()


def random_sampling(scores: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw from the full softmax distribution."""
    return scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator).item()


def ras_sampling(scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None,
                 top_p: float = 0.8, top_k: int = 25, win_size: int = 10, tau_r: float = 0.1) -> int:
    """Repetition-aware sampling: nucleus, redrawn from the full distribution when repetitive.

    Like upstream, a repetition sets the drawn id's score to -inf in `scores` itself.
    """
    top_id = nucleus_sampling(scores, generator, top_p=top_p, top_k=top_k)
    rep_num = (torch.tensor(list(decoded[-win_size:])).to(scores.device) == top_id).sum().item()
    if rep_num >= win_size * tau_r:
        scores[top_id] = -float("inf")
        top_id = random_sampling(scores, generator)
    return top_id


@dataclass(frozen=True)
class Sampler(SamplerSettings):
    """The yaml's `llm.sampling` node: which upstream sampler, with its keyword arguments."""

    @classmethod
    def from_yaml(cls, node) -> "Sampler":
        """From a `!name:cosyvoice.utils.common.<sampler>` Tagged node (kwargs as in the yaml)."""
        kind = getattr(node, "cls", None)
        if kind not in SAMPLER_KINDS:
            raise ModelLoadError(f"llm.sampling: unknown sampler {getattr(node, 'target', node)!r}")
        allowed = {"ras_sampling": {"top_p", "top_k", "win_size", "tau_r"},
                   "nucleus_sampling": {"top_p", "top_k"}, "random_sampling": set()}[kind]
        extra = set(node.kwargs) - allowed
        if extra:
            raise ModelLoadError(f"llm.sampling: {kind} has no argument(s) {sorted(extra)}")
        return cls(kind=kind, **node.kwargs)

    def __call__(self, scores: torch.Tensor, decoded: Sequence[int],
                 generator: torch.Generator | None) -> int:
        """Draw one token id from 1-D log-probabilities (may modify `scores`, as upstream)."""
        if self.kind == "ras_sampling":
            return ras_sampling(scores, decoded, generator, self.top_p, self.top_k, self.win_size, self.tau_r)
        if self.kind == "nucleus_sampling":
            return nucleus_sampling(scores, generator, self.top_p, self.top_k)
        return random_sampling(scores, generator)
